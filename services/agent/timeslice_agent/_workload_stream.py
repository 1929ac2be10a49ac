"""Workloads registered through the gRPC ``WorkloadChannel`` stream (the reference API's, served by ``_grpc_workload``),
as the ``app_channel`` backend reaches them: in this process, on their stream, instead of over the bus.

A stream's registration is an ordinary one (``Requests.register``: the job book, its parts, ``JobRegistered``), whose
``channel`` token names the stream (``STREAM_CHANNEL_PREFIX``). The ``app_channel`` backend finds the stream by that
token (:func:`call`), sends the command on it and waits for the workload's result, at most until the operation's
deadline. Nothing on the bus carries these commands, so none is asked again: each goes out once, with a command id
of its own, as the reference API says.

What a workload declared when it registered is kept here: the suspend modes it can carry out (a command in another
mode is refused, :class:`UnsupportedMode`, and never sent) and its default mode (the job's registered mode). A stream
that closes fails the command it had not answered yet at once; a stream replaced by a newer registration of its job
is closed by that registration. No process survives an agent's restart, so neither does a stream's registration
(``JobBook.recover`` drops the parts whose channel :func:`is_stream_channel`)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Literal

from timeslice_client.protocol import JobContext, SuspendMode

from ._backend_api import BackendError, OpContext, Outcome
from ._errors import StreamClosed, UnsupportedMode

__all__ = [
    "MAX_STREAMS",
    "STREAM_CHANNEL_PREFIX",
    "StreamCommand",
    "StreamResult",
    "WorkloadStream",
    "call",
    "is_stream_channel",
    "of_job",
]

STREAM_CHANNEL_PREFIX: Final = "stream-"  # RegisterJob.channel of a stream's registration: "stream-" + 24 hex digits
MAX_STREAMS: Final = 1024  # streams open on one agent, registered or not yet: one per job, far more than a node runs
Action = Literal["suspend", "resume"]


@dataclass(frozen=True, slots=True)
class StreamCommand:
    """One command for the stream's workload (``AgentCommand`` on the wire)."""

    command_id: str
    action: Action
    mode: SuspendMode  # resolved: the request's, else the job's registered (the workload's default) mode
    tags: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StreamResult:
    """The workload's answer to one command (``CommandResult``)."""

    ok: bool
    error: str = ""


Send = Callable[[StreamCommand], Awaitable[None]]


class WorkloadStream:
    """One open ``WorkloadChannel`` stream of job ``job`` on node ``node``: ``send`` writes a command on it (the gRPC
    handler's ``ctx.write``). ``supported``: the modes the workload can carry out (empty: any)."""

    def __init__(
        self, node: str, job: str, group: str, *, supported: frozenset[SuspendMode], default: SuspendMode, send: Send
    ) -> None:
        self.node, self.job, self.group = node, job, group
        self.supported, self.default = supported, default
        self.token = STREAM_CHANNEL_PREFIX + secrets.token_hex(12)
        self._send = send
        self._pending: dict[str, asyncio.Future[StreamResult]] = {}
        self.closed = asyncio.Event()
        self.why: str | None = None  # why it was closed, once it is
        self.replaced = False  # closed by a newer registration of its job

    def __repr__(self) -> str:
        return f"WorkloadStream(job={self.job!r}, node={self.node!r}, token={self.token!r})"

    def check_mode(self, mode: SuspendMode) -> None:
        """Raises :class:`UnsupportedMode` for a suspend mode the workload did not declare it can carry out."""
        if self.supported and mode not in self.supported:
            raise UnsupportedMode(self.job, mode, self.supported)

    async def call(self, action: Action, mode: SuspendMode, tags: tuple[str, ...], op: OpContext) -> StreamResult:
        """Send one command and wait for its result, at most until ``op``'s deadline."""
        if action == "suspend":
            self.check_mode(mode)  # refused, never sent
        if self.closed.is_set():
            raise StreamClosed(
                f"the WorkloadChannel stream of job {self.job!r} is closed ({self.why}): nothing was sent to {action}"
            )
        command = StreamCommand(f"{op.op_id[:200]}:{action}:{secrets.token_hex(8)}", action, mode, tags)
        answered: asyncio.Future[StreamResult] = asyncio.get_running_loop().create_future()
        self._pending[command.command_id] = answered
        try:
            async with asyncio.timeout(op.remaining()):
                try:
                    await self._send(command)
                except Exception as exc:  # the stream is gone: whether the workload got the command is unknown
                    raise StreamClosed(
                        f"the command to {action} could not be sent on the WorkloadChannel stream "
                        f"of job {self.job!r}: {exc!r}",
                        rolled_back=False,
                    ) from exc
                return await answered
        except TimeoutError:
            raise BackendError(
                f"workload {self.job!r} did not answer {action} on its WorkloadChannel stream before "
                "the operation's deadline",
                rolled_back=False,
            ) from None
        finally:
            self._pending.pop(command.command_id, None)

    def answer(self, command_id: str, result: StreamResult) -> bool:
        """The workload's result for ``command_id``; False when no command waits for it (one that timed out)."""
        waiting = self._pending.get(command_id)
        if waiting is None or waiting.done():
            return False
        waiting.set_result(result)
        return True

    def close(self, why: str, *, replaced: bool = False) -> None:
        """End the stream's part here (idempotent): the command it had not answered fails at once."""
        if self.closed.is_set():
            return
        self.why, self.replaced = why, replaced
        self.closed.set()
        _BY_TOKEN.pop(self.token, None)
        if _BY_JOB.get((self.node, self.job)) is self:
            del _BY_JOB[(self.node, self.job)]
        for waiting in self._pending.values():
            if not waiting.done():
                waiting.set_exception(
                    StreamClosed(
                        f"the WorkloadChannel stream of job {self.job!r} closed before the workload answered ({why})",
                        rolled_back=False,
                    )
                )

    # ------------------------------------------------------------------ the directory

    def open(self) -> None:
        """Make the stream findable by its token (before its registration names it)."""
        _BY_TOKEN[self.token] = self

    def claim(self) -> WorkloadStream | None:
        """Become the job's stream on its node (its registration succeeded); returns the one it replaces, if any."""
        previous = _BY_JOB.get((self.node, self.job))
        _BY_JOB[(self.node, self.job)] = self
        return previous if previous is not self else None


# Every open stream of this process, by token, and each job's current one: an agent's backends are made per operation
# from (connection, node) only (``backends.make_backend``), so they look their streams up here.
_BY_TOKEN: dict[str, WorkloadStream] = {}
_BY_JOB: dict[tuple[str, str], WorkloadStream] = {}


def is_stream_channel(channel: str | None) -> bool:
    """Whether a registration's ``channel`` names a ``WorkloadChannel`` stream."""
    return channel is not None and channel.startswith(STREAM_CHANNEL_PREFIX)


def of_job(node: str, job: str) -> WorkloadStream | None:
    """The stream job ``job`` registered with on node ``node``, while it is open."""
    return _BY_JOB.get((node, job))


async def call(node: str, ctx: JobContext, op: OpContext, action: Action) -> Outcome:
    """The ``app_channel`` backend's suspend or resume of ``ctx`` (a part registered by a stream): on that stream."""
    stream = _BY_TOKEN.get(ctx.channel or "")
    if stream is None or stream.node != node or stream.job != ctx.job:
        raise BackendError(
            f"the WorkloadChannel stream that registered job {ctx.job!r} is closed: nothing was sent to {action}"
        )
    t0 = time.perf_counter()
    result = await stream.call(action, ctx.mode, ctx.tags, op)
    if not result.ok:
        # As a workload channel's answer says (``AppChannelBackend``): a failed suspend undid itself, a resume did not.
        raise BackendError(
            f"workload {ctx.job!r} failed to {action}: {result.error or 'no reason given'}",
            rolled_back=action == "suspend",
        )
    return Outcome(work_ms=(time.perf_counter() - t0) * 1000)
