"""The workload channel: a job registers with its node's agent and suspends/resumes itself on request.

::

    channel = await register_workload("job-a", "gpus-0", TorchOffloadHandler(model, opt))
    ...
    await channel.close()

The channel registers on ``ts.rpc.agent.<node>.register.<job>`` with a proof of its process from the agent's
node-local Unix socket (``_agent_socket``: the kernel names the caller), so the agent acts on the processes it
names only when they are this process, its descendants or its process group. Without the socket (not found, or not
reachable from here) only backends that touch no process register (``app_channel``, ``app_endpoint``, ``noop``).

The agent then snapshots this job by asking it (``ts.rpc.workload.<node>.<job>``) to ``suspend``
and restores it with ``resume``. Only the node's agent may publish there (the bus's permissions): that, not
anything in the message, is why the channel obeys it. The channel answers on a thread of its own, with its own
event loop and NATS connection (``_channel_thread``), and runs the handler there: the job's own event loop and
threads are not involved, and the reply leaves as soon as the handler returns.

Early suspend: a channel registered through a client (``AsyncTimeSliceClient.register_workload``) begins its
suspend at the job's release when the orchestrator has told the job that another job waits (``Contended``),
instead of a few bus hops later when the agent's command arrives; the command then takes that suspend's
outcome. If no command comes (the waiter left before the release was applied), the job's next ``acquire()``
resumes the state before it returns (:meth:`WorkloadChannel.settle`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, Unpack

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from . import _switch_interval
from ._agent_socket import ProofUnavailable, prove
from ._async_closing import AsyncClosing
from ._bounds import MAX_TEXT
from ._channel_thread import Responder
from ._precopy_calls import PrecopyCalls
from ._renamed import RenamedAttribute, renamed_keywords
from ._switch_interval import DEFAULT_SWITCH_INTERVAL, prompt_threads
from ._workload_options import (
    PRECOPY_CHOICES,
    WORKLOAD_KEYS,
    ClientWorkloadOptions,
    Precopy,
    WorkloadOptions,
    check_options,
)
from .bus import CredsPath, TlsOption, connect, identity_of, parse_servers
from .errors import AgentRefused, HandlerError, InvalidRequest, TimeSliceError, Unavailable
from .handlers import HandlerResult, WorkloadHandler
from .protocol import (
    DEFAULT_OP_TIMEOUT_MS,
    AgentReply,
    RegisterJob,
    SuspendMode,
    UnregisterJob,
    WorkloadCommand,
    WorkloadReply,
    encode,
    subjects,
    validate_id,
)

__all__ = ["ClientWorkloadOptions", "WorkloadChannel", "WorkloadOptions", "default_node_id", "register_workload"]

log = logging.getLogger("timeslice.workload")

_cmd_decoder = msgspec.json.Decoder(WorkloadCommand)
_reply_decoder = msgspec.json.Decoder(AgentReply)

T = TypeVar("T")


def _cut(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _within_bounds(reply: WorkloadReply) -> WorkloadReply:
    """A handler's error of any length, cut to the wire's bound (the agent refuses a longer one as undecodable)."""
    if reply.error is None or len(reply.error) <= MAX_TEXT:
        return reply
    return msgspec.structs.replace(reply, error=_cut(reply.error))


@dataclass(frozen=True, slots=True)
class _Early:
    """A suspend begun at the job's release, done: its result, or its error (the state is then as it was)."""

    result: HandlerResult | None
    error: str | None
    elapsed_ms: float


def default_node_id() -> str:
    """``$TIMESLICE_NODE_ID``, else this host's name made safe for subjects (the agent uses the same rule)."""
    env = os.environ.get("TIMESLICE_NODE_ID")
    if env:
        return validate_id("node", env)
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in os.uname().nodename)[:64].strip("-_")
    return validate_id("node", name or "node")


def _servers_of(nc: NATS) -> list[str]:
    """The servers ``nc`` knows, the one it is connected to first (none when it is not connected)."""
    current = nc.connected_url
    if current is None:
        return []
    first = current.geturl()
    return [first, *(u for u in (s.geturl() for s in nc.servers) if u != first)]


class WorkloadChannel(AsyncClosing, PrecopyCalls):
    """One registered workload. ``close()`` unregisters it (idempotent).

    ``nc`` carries the registration. The commands come on a connection of the channel's own, made on its
    thread to ``nats_url`` (one server or several, comma-separated; default: the server ``nc`` is connected to, then
    the others it knows). ``agent_socket``: the agent's Unix socket (default: ``$TIMESLICE_AGENT_SOCKET``, else where
    an agent serves it by default, see ``_agent_socket``)."""

    @renamed_keywords(
        op_timeout="op_timeout_s", switch_interval="switch_interval_s", request_timeout="request_timeout_s"
    )
    def __init__(
        self,
        nc: NATS,
        job_id: str,
        group_id: str,
        handler: WorkloadHandler,
        *,
        node_id: str | None = None,
        mode: SuspendMode | str = SuspendMode.OFFLOAD,
        tags: Iterable[str] = (),
        backends: Iterable[str] = ("app_channel",),
        pids: Iterable[int] | None = None,
        pgid: int | None = None,
        op_timeout_s: float = DEFAULT_OP_TIMEOUT_MS / 1000,
        request_timeout_s: float = 5.0,
        own_connection: bool = False,
        endpoints: Iterable[str] = (),
        switch_interval_s: float | None = DEFAULT_SWITCH_INTERVAL,
        early_suspend: bool = True,
        precopy: Precopy = "auto",
        nats_url: str | None = None,
        agent_socket: str | None = None,
    ) -> None:
        if not isinstance(handler, WorkloadHandler):
            raise InvalidRequest("handler must have suspend(mode, tags) and resume(mode, tags) methods")
        self.nc = nc
        self.job_id = validate_id("job", job_id)
        self.group_id = validate_id("group", group_id)
        self.node_id = validate_id("node", node_id) if node_id else default_node_id()
        self.handler = handler
        self.mode = SuspendMode(mode)
        self.tags = tuple(tags)
        self.backends = tuple(backends)
        # Process-level backends (freeze) act on these: name the compute processes, never the one that
        # talks to the orchestrator (a frozen process cannot ask for the group back).
        self.pids = tuple(pids) if pids is not None else (() if pgid is not None else (os.getpid(),))
        self.pgid = pgid
        self.op_timeout_s = op_timeout_s
        self.request_timeout_s = request_timeout_s
        self.endpoints = tuple(endpoints)  # app_endpoint servers, e.g. "vllm+http://127.0.0.1:8000"
        if switch_interval_s is not None and switch_interval_s <= 0:
            raise InvalidRequest(f"switch_interval_s must be positive seconds or None, not {switch_interval_s}")
        self.switch_interval_s = switch_interval_s  # the GIL switch interval while a command runs (None: as it is)
        self.nats_url = ",".join(parse_servers(nats_url)) if nats_url else None  # checked now, not at start()
        self.agent_socket = agent_socket
        self._own = own_connection
        self._responder: Responder | None = None  # the channel's thread, once opened
        self._rnc: NATS | None = None  # the channel's own connection, used on its thread only
        self._registered = False
        self.token = secrets.token_hex(8)  # RegisterJob.channel: commands for another registration are not ours
        # The state below is shared by the caller's thread (suspend_early, arm/disarm, close) and the channel's
        # (commands, settle): ``_gate`` guards it. ``_lock`` (on the channel's loop only) lets one command,
        # settle or close work at a time; ``_busy`` says one does, to the caller's thread.
        self._gate = threading.Lock()
        self._lock: asyncio.Lock  # made by _open(), on the channel's loop
        self._busy = False
        self._armed = False  # the interval is lowered until the next command is answered (see arm())
        self._answers: dict[tuple[str, str], WorkloadReply] = {}  # by (op id, action): only the latest
        self._closed = False
        self.early_suspend = early_suspend  # begin the suspend at a contended release (see suspend_early())
        if precopy not in PRECOPY_CHOICES:
            raise InvalidRequest(f"precopy must be one of {', '.join(PRECOPY_CHOICES)}, not {precopy!r}")
        self.precopy = precopy  # copy the state out while idle, when a switch is expected (see precopy_idle())
        self._precopy_stop: threading.Event | None = None  # the running or last precopy's; set at the next grant
        self._precopying: concurrent.futures.Future[None] | None = None
        self.switched_out = 0  # suspends this channel ran for a switch (commands, early ones taken)
        self.precopies = 0  # precopies that ran to the end
        self._early: concurrent.futures.Future[_Early] | None = None  # always awaited: by a command, settle, close
        self.suspended = False
        self.last_result: HandlerResult | None = None
        self.early_taken = 0  # early suspends a command took
        self.early_resumed = 0  # early suspends no command took, resumed by settle()

    # The old names, kept for one release (docs/architecture.md, "Names and units"); each use warns.
    op_timeout = RenamedAttribute[float]("op_timeout_s")
    switch_interval = RenamedAttribute[float | None]("switch_interval_s")
    request_timeout = RenamedAttribute[float]("request_timeout_s")

    # ------------------------------------------------------------------ lifecycle (the caller's loop)

    async def start(self) -> WorkloadChannel:
        await self._open()
        try:
            proof, unproven = (
                await prove(
                    self.job_id, self.node_id, path=self.agent_socket, timeout=min(self.request_timeout_s, 5.0)
                ),
                None,
            )
        except ProofUnavailable as exc:  # only backends that touch no process are registered then
            proof, unproven = None, str(exc)
        req = RegisterJob(
            group=self.group_id,
            job=self.job_id,
            backends=self.backends,
            pids=self.pids,
            pgid=self.pgid,
            mode=self.mode,
            tags=self.tags,
            op_timeout_ms=int(self.op_timeout_s * 1000),
            endpoints=self.endpoints,
            proof=proof,
            channel=self.token,
        )
        try:
            reply = await self._agent("register", encode(req), unproven=unproven)
        except BaseException:
            await self._shut()
            raise
        self._registered = True
        log.info(
            "registered with agent %s (state %s)",
            self.node_id,
            reply.state,
            extra={"job": self.job_id, "group": self.group_id, "node": self.node_id},
        )
        return self

    async def _open(self) -> None:
        """Start the channel's thread, connect there and subscribe to this workload's commands."""
        if self._responder is not None:
            raise TimeSliceError(f"the workload channel of job {self.job_id!r} was started already")
        servers = parse_servers(self.nats_url) if self.nats_url else _servers_of(self.nc)
        if not servers:
            raise Unavailable(
                "the connection given to the workload channel is not connected, and no nats_url was given"
            )
        self._lock = asyncio.Lock()  # for this start's thread and loop only
        self._responder = Responder(f"timeslice-workload-{self.job_id}")
        try:
            self._responder.start()
            self._rnc = await self._responder.call(self._subscribe(servers))
        except BaseException:
            await self._shut()
            raise

    async def _subscribe(self, servers: list[str]) -> NATS:
        nc = await connect(
            servers,
            name=f"timeslice-workload-{self.job_id}",
            connect_timeout_s=self.request_timeout_s,
            dont_randomize=True,
            **identity_of(self.nc),
        )
        try:
            await nc.subscribe(subjects.workload_rpc(self.node_id, self.job_id), cb=self._on_command)
            await asyncio.sleep(0)  # else flush() after subscribe() is no barrier (docs/nats.md)
            await nc.flush(timeout=max(1, int(self.request_timeout_s)))
        except BaseException:
            await nc.close()
            raise
        return nc

    async def _on_thread(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the channel's thread and wait for its outcome."""
        if self._responder is None:
            coro.close()
            raise TimeSliceError(f"the workload channel of job {self.job_id!r} is not started")
        return await self._responder.call(coro)

    async def _agent(self, verb: str, data: bytes, *, unproven: str | None = None) -> AgentReply:
        """One request to the agent (``unproven``: why no proof came with it, said in a refusal)."""
        subject = subjects.agent_rpc(self.node_id, verb, self.job_id)
        try:
            msg = await self.nc.request(subject, data, timeout=self.request_timeout_s)
        except Exception as exc:
            raise Unavailable(
                f"no snapshot agent answered on node {self.node_id!r} ({exc.__class__.__name__}); "
                f"is `timeslice agent --node-id {self.node_id}` running?",
                after_s=self.request_timeout_s,
            ) from exc
        reply = _reply_decoder.decode(msg.data)
        if not reply.ok:
            reason = reply.error or "no reason given"
            if reply.code == "unproven" and unproven:
                reason = f"{reason} [{unproven}]"
            raise AgentRefused(self.node_id, self.job_id, verb, reply.code, reason)
        return reply

    async def close(self) -> None:
        with self._gate:
            if self._closed:
                return
            self._closed = True  # no early suspend begins from now on
        self.disarm()
        await self._end_precopy(self.op_timeout_s)  # a copy in flight stops at its next chunk
        # Let a suspend/resume in flight finish and answer first: the agent is waiting on it. An early suspend
        # nobody took is waited for too (its call must not outlive the channel), and left as it is.
        if self._responder is not None and self._responder.running:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.op_timeout_s):
                    await self._on_thread(self._quiesce())
        if self._registered and self.nc.is_connected:
            with contextlib.suppress(Exception):
                # its own registration only: other processes (or channels) of the job stay registered
                await self._agent(
                    "unregister", encode(UnregisterJob(group=self.group_id, job=self.job_id, channel=self.token))
                )
        await self._shut()
        with self._gate:
            self._early = None  # nobody takes it now: the suspend begun at the release is left as it is
        if self._own:
            with contextlib.suppress(Exception):
                await self.nc.drain()

    async def _shut(self) -> None:
        """Close the channel's connection and stop its thread (idempotent)."""
        responder, self._responder = self._responder, None
        if responder is None:
            return
        rnc, self._rnc = self._rnc, None
        if rnc is not None and responder.running:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.request_timeout_s):
                    await responder.call(rnc.drain())
        await responder.stop(timeout=self.request_timeout_s)

    # ------------------------------------------------------------------ the job's release and acquire (caller)

    def arm(self) -> None:
        """The job yielded the group: its suspend may come while its main thread runs Python, and reading it
        would wait up to a default switch interval for the GIL. So the interval is lowered now, until the next
        command is answered or ``disarm()`` (the client calls both: on release, and on acquire or close)."""
        with self._gate:
            if self.switch_interval_s is None or self._armed or self._closed:
                return
            _switch_interval.lower(self.switch_interval_s)
            self._armed = True

    def disarm(self) -> None:
        """Undo ``arm()`` (idempotent; any thread)."""
        with self._gate:
            if self._armed:
                self._armed = False
                _switch_interval.restore()

    def suspend_early(self) -> bool:
        """The job released the group while another job waits for it, so the agent's suspend is on its way:
        begin it now on the channel's thread, with the registered mode and tags (those the agent sends), instead
        of a few bus hops later. The client calls this once its release is written to the bus. Returns whether
        it began (not when switched off, not started or closed, already suspended or answering a command, nor
        when the job's backends leave out ``app_channel``: then the agent never asks this handler to suspend).

        The suspend command then takes this outcome, a failure too (the handler rolled back, so the agent
        rolls the job back to RUNNING as for any failed snapshot). If no command comes, the job's next acquire
        resumes it (:meth:`settle`)."""
        if not self.early_suspend or "app_channel" not in self.backends:
            return False
        with self._gate:
            if self._closed or self._responder is None or self._early is not None or self.suspended or self._busy:
                return False
            # Set under the gate: a command that starts after this takes it (see _exclusive).
            self._early = self._responder.submit(self._run_early())
        return True

    async def settle(self) -> bool:
        """The job holds the group again: resume a suspend begun at its release that no command took (the
        orchestrator did not switch: the waiter left before the release was applied). The client calls this
        before ``acquire()`` returns. Returns whether it resumed; raises HandlerError when the resume fails."""
        if self._early is None:
            return False
        why = f"job {self.job_id!r} suspended at its release and no switch followed, but resuming it"
        try:
            async with asyncio.timeout(self.op_timeout_s):
                resumed = await self._on_thread(self._settle())
        except TimeoutError:
            raise HandlerError(
                f"{why} took over op_timeout_s={self.op_timeout_s:g} s; its state may not be back: restart the job"
            ) from None
        except Exception as exc:
            raise HandlerError(
                f"{why} failed ({exc.__class__.__name__}: {exc}); its state is not back where it was: restart the job"
            ) from exc
        if resumed:
            log.info(
                "suspended at release, but no switch followed: resumed",
                extra={"job": self.job_id, "group": self.group_id},
            )
        return resumed

    # ------------------------------------------------------------------ the channel's thread

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """Hold the channel's state: one command, settle or close at a time."""
        async with self._lock:
            with self._gate:
                self._busy = True
            try:
                yield
            finally:
                with self._gate:
                    self._busy = False

    async def _take_early(self) -> _Early | None:
        """The early suspend's outcome, once (None: none began). Call within ``_exclusive``."""
        with self._gate:
            future, self._early = self._early, None
        if future is None:
            return None
        return await asyncio.wrap_future(future)

    async def _run_early(self) -> _Early:
        t0 = time.perf_counter()
        with prompt_threads(self.switch_interval_s):
            try:
                result = self.handler.suspend(self.mode, frozenset(self.tags))
            except Exception as exc:  # the handler left the state as it was (its contract)
                log.warning("suspend at release failed: %r", exc, extra={"job": self.job_id, "group": self.group_id})
                return _Early(None, f"{exc.__class__.__name__}: {exc}", (time.perf_counter() - t0) * 1000)
        with self._gate:
            self.suspended = True
        self.last_result = result
        return _Early(result, None, (time.perf_counter() - t0) * 1000)

    async def _settle(self) -> bool:
        with prompt_threads(self.switch_interval_s):
            async with self._exclusive():
                early = await self._take_early()
                if early is None or early.result is None:  # none, or it failed and changed nothing
                    return False
                self.handler.resume(self.mode, frozenset(self.tags))
                with self._gate:
                    self.suspended = False
                self.early_resumed += 1
        return True

    async def _quiesce(self) -> None:
        """Wait for a command in flight, and for an early suspend to end. Its outcome stays for the agent's
        command, which may still come (a job that closes right after a contended release): taking it here made
        that command run the suspend a second time."""
        async with self._exclusive():
            with self._gate:
                future = self._early
            if future is not None:
                await asyncio.wrap_future(future)

    async def _on_command(self, msg: Msg) -> None:
        if msg.subject != subjects.workload_rpc(self.node_id, self.job_id):
            return  # a stream's message pushed here by someone's consumer (it keeps its own subject): not the agent
        try:
            cmd = _cmd_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await msg.respond(encode(WorkloadReply(op_id="", ok=False, error=f"bad command: {exc}")))
            return
        if cmd.channel is not None and cmd.channel != self.token:
            # For an earlier registration of this job on the node (a process that died, whose place this one took):
            # not ours to answer; the agent ends that operation when it sees those processes gone.
            log.warning(
                "ignored a %s command for another registration of the job",
                cmd.action,
                extra={"job": self.job_id, "group": self.group_id, "node": self.node_id, "op_id": cmd.op_id},
            )
            return
        # A main thread busy in Python would make each step below wait up to 5 ms for the GIL (see _switch_interval).
        with prompt_threads(self.switch_interval_s):
            answer = await self._answer(cmd)
            await msg.respond(encode(answer))
            await asyncio.sleep(0)  # the connection's flusher, woken by the reply, writes it before we go on
            self.disarm()

    async def _answer(self, cmd: WorkloadCommand) -> WorkloadReply:
        """One command's answer: the same for the same op id and action (a retry repeats the latest op). A resume
        with the op id of the suspend before it is the agent undoing that suspend (another part of the switch failed):
        it runs."""
        async with self._exclusive():
            key = (cmd.op_id, cmd.action)
            answer = self._answers.get(key)
            if answer is None:
                answer = _within_bounds(await self._handle(cmd))
                self._answers = {key: answer}  # only the latest
            return answer

    async def _handle(self, cmd: WorkloadCommand) -> WorkloadReply:
        """Run one command. Call within ``_exclusive``, on the channel's thread."""
        early = await self._take_early()
        if early is not None:
            if cmd.action == "suspend" and (cmd.mode, frozenset(cmd.tags)) == (self.mode, frozenset(self.tags)):
                self.early_taken += 1
                if early.result is not None:
                    self.switched_out += 1
                if early.result is None:
                    return WorkloadReply(
                        op_id=cmd.op_id, ok=False, error=early.error, elapsed_ms=early.elapsed_ms, began_at_release=True
                    )
                return WorkloadReply(
                    op_id=cmd.op_id,
                    ok=True,
                    bytes_moved=early.result.bytes_moved,
                    device_bytes_freed=early.result.device_bytes_freed,
                    elapsed_ms=early.elapsed_ms,
                    began_at_release=True,
                )
            # Otherwise a resume finds the state suspended, as it expects, and a failed early suspend changed
            # nothing. A suspend in another mode or of other tags than registered puts the state back first.
            if early.result is not None and cmd.action == "suspend":
                try:
                    self.handler.resume(self.mode, frozenset(self.tags))
                except Exception as exc:
                    return WorkloadReply(
                        op_id=cmd.op_id,
                        ok=False,
                        error=f"resuming the suspend begun at release failed: {exc.__class__.__name__}: {exc}",
                    )
                with self._gate:
                    self.suspended = False
        elif cmd.action == "suspend" and self.suspended:
            # Off the device already (an agent that lost track of it, e.g. restarted, asks again): nothing to move.
            return WorkloadReply(op_id=cmd.op_id, ok=True)
        fn = self.handler.suspend if cmd.action == "suspend" else self.handler.resume
        t0 = time.perf_counter()
        try:
            result = fn(cmd.mode, frozenset(cmd.tags))
        except Exception as exc:
            log.warning("%s failed: %s", cmd.action, _cut(f"{exc!r}"), extra={"job": self.job_id, "epoch": cmd.epoch})
            return WorkloadReply(
                op_id=cmd.op_id,
                ok=False,
                error=f"{exc.__class__.__name__}: {exc}",
                elapsed_ms=(time.perf_counter() - t0) * 1000,
            )
        with self._gate:
            self.suspended = cmd.action == "suspend"
        if cmd.action == "suspend":
            self.switched_out += 1
        self.last_result = result
        return WorkloadReply(
            op_id=cmd.op_id,
            ok=True,
            bytes_moved=result.bytes_moved,
            device_bytes_freed=result.device_bytes_freed,
            elapsed_ms=(time.perf_counter() - t0) * 1000,
        )


async def register_workload(
    job_id: str,
    group_id: str,
    handler: WorkloadHandler,
    *,
    nats_url: str | None = None,
    agent_socket: str | None = None,
    creds: CredsPath | None = None,
    tls: TlsOption | None = None,
    **options: Unpack[WorkloadOptions],
) -> WorkloadChannel:
    """Register this process with its node's agent; its own NATS connection (``creds``/``tls``: its identity; None:
    as ``bus.connect`` finds it), closed by ``close()``. ``agent_socket``: see ``WorkloadChannel``; ``options``:
    :class:`WorkloadOptions`. A channel registered here never suspends early: only a client knows when its job
    releases (see ``AsyncTimeSliceClient.register_workload``)."""
    check_options(options, WORKLOAD_KEYS, "register_workload")
    nc = await connect(nats_url, name=f"timeslice-workload-{job_id}", creds=creds, tls=tls)
    channel = WorkloadChannel(nc, job_id, group_id, handler, own_connection=True, agent_socket=agent_socket, **options)
    try:
        return await channel.start()
    except BaseException:
        await nc.close()
        raise
