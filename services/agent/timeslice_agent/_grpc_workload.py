"""The agent's gRPC ``WorkloadChannel`` (``snapshot_agent.v1alpha1.SnapshotAgentService``): a workload registers its job
on a bidirectional stream, and the agent sends it the job's suspends and resumes there (``_workload_stream``).

* The first message must be a ``RegisterWorkload``, within ``REGISTER_WAIT_S``: its job id (and group, when given)
  valid ids, its capabilities bounded (``_bounds``: at most 32 tags of 64 characters; modes OFFLOAD or DISCARD, the
  default among the supported ones). The caller must be allowed to act as that job, as for Snapshot and Restore
  (``guard.authorize``). The registration is then the bus's (``Requests.register``, backend ``app_channel``, the
  default mode as the job's mode, the stream's token as its channel), and the job is announced to the orchestrator.
  A group left empty is the job's group on this node, else ``standalone``.
* Every later message must be a ``CommandResult`` of a command sent on this stream (a result for a command that no
  longer waits, one that timed out, is dropped). Anything else, a message that cannot be decoded, a second
  registration, an empty or overlong command id, ends the stream with INVALID_ARGUMENT; the agent serves on.
* One stream per job: a newer registration of the job takes the older stream's place, as the reference agent does
  (its client registers again on every reconnect), and the older stream ends with ABORTED. The job keeps its state.
* The stream's end (the workload closed it, cancelled it, or its connection died: the server's keepalive notices
  within ~20 s) fails the command it had not answered and ends the registration it made, as a workload channel's
  unregistration does (``Requests.unregister``: after the operation running on the job, bounded).
* At most ``MAX_STREAMS`` streams at once (RESOURCE_EXHAUSTED beyond)."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any, Final, NoReturn

import grpc
import msgspec
from timeslice_client._bounds import MAX_TEXT, Name, OpId
from timeslice_client._grpc import snapshot_agent_pb2 as pb
from timeslice_client._internal.grpc_server.guard import Authenticator, authorize
from timeslice_client.protocol import RegisterJob, SuspendMode, UnregisterJob

from ._errors import BackendUnavailable, Refusal, Refused
from ._job_parts import views
from ._requests import BUSY
from ._untrusted import cap, check_id, shown
from ._workload_stream import MAX_STREAMS, StreamCommand, StreamResult, WorkloadStream
from .service import Agent

__all__ = ["REGISTER_WAIT_S", "WorkloadChannels"]

log = logging.getLogger("timeslice.agent.grpc")
Ctx = grpc.aio.ServicerContext[Any, Any]

REGISTER_WAIT_S: Final = 10.0  # from the stream's start to its RegisterWorkload
_REGISTER_S: Final = 30.0  # a registration's writes (KV, the JobRegistered event), through an election at worst
_MODES: Final = {pb.SUSPEND_MODE_OFFLOAD: SuspendMode.OFFLOAD, pb.SUSPEND_MODE_DISCARD: SuspendMode.DISCARD}
_TO_PB: Final = {mode: value for value, mode in _MODES.items()}
_MAX_MODES: Final = 8  # entries of supported_modes (two modes exist; repeats are allowed, not without end)
_Tags = Annotated[tuple[Name, ...], msgspec.Meta(max_length=32)]  # RegisterJob.tags' bound
_OP_ID_MAX: Final[int] = msgspec.inspect.type_info(OpId).max_length  # type: ignore[attr-defined]  # a command id's


class _Registration(msgspec.Struct, frozen=True):
    job: str
    group: str | None
    supported: frozenset[SuspendMode]
    default: SuspendMode
    tags: tuple[str, ...]


class WorkloadChannels:
    """Serves ``WorkloadChannel`` for ``agent`` (``serve`` is the method's handler)."""

    def __init__(self, agent: Agent, auth: Authenticator) -> None:
        self.agent, self.auth = agent, auth
        self._open = 0  # streams being served, registered or not yet
        self._registering = asyncio.Lock()  # a registration and its taking the job's stream over, one at a time

    async def serve(self, requests: Any, ctx: Ctx) -> None:
        if self._open >= MAX_STREAMS:
            await ctx.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._open} WorkloadChannel streams are open on node {self.agent.node!r} (at most {MAX_STREAMS})",
            )
        self._open += 1
        try:
            await self._serve(ctx)
        finally:
            self._open -= 1

    async def _serve(self, ctx: Ctx) -> None:
        try:
            async with asyncio.timeout(REGISTER_WAIT_S):
                first = await ctx.read()
        except TimeoutError:
            await self._malformed(
                ctx, Refusal.OUT_OF_RANGE, f"no RegisterWorkload within {REGISTER_WAIT_S:g} s of the stream's start"
            )
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # the message could not be decoded
            await self._malformed(ctx, Refusal.UNDECODABLE, f"the first message is no WorkloadMessage: {exc!r}")
        if first is grpc.aio.EOF:
            await self._malformed(ctx, Refusal.UNDECODABLE, "the stream ended before its RegisterWorkload")
        reg = await self._registration(ctx, first)
        current = self.agent.jobs().get(reg.job)
        group = reg.group or (current.group if current is not None else "standalone")
        await authorize(ctx, self.auth, log, reg.job, group)
        writes = asyncio.Lock()  # one write at a time on the stream

        async def send(command: StreamCommand) -> None:
            async with writes:
                await ctx.write(_command(command))

        stream = WorkloadStream(
            self.agent.node, reg.job, group, supported=reg.supported, default=reg.default, send=send
        )
        stream.open()
        try:
            previous = await self._register(ctx, stream)
            ids = {"node": self.agent.node, "job": reg.job, "group": group, "peer": ctx.peer()}
            if previous is not None:
                log.info("a newer WorkloadChannel stream of the job takes the place of the earlier one", extra=ids)
                previous.close(f"replaced by a newer registration of job {reg.job!r}", replaced=True)
            log.info(
                "workload registered on a WorkloadChannel stream (modes %s, default %s)",
                ",".join(sorted(reg.supported)) or "any",
                reg.default,
                extra=ids,
            )
            await self._follow(ctx, stream)
        finally:
            stream.close("the stream ended")
            # Also when the stream ended during its registration (cancelled, say): whatever of it was written goes.
            if self._registered_by(stream):
                self._leave(stream)

    def _registered_by(self, stream: WorkloadStream) -> bool:
        """Whether a part of the stream's job is the stream's registration (not when a newer stream replaced it)."""
        ctx = self.agent.jobs().get(stream.job)
        return ctx is not None and any(v.channel == stream.token for v in views(ctx))

    async def _registration(self, ctx: Ctx, msg: pb.WorkloadMessage) -> _Registration:
        if msg.WhichOneof("message") != "register":
            await self._malformed(
                ctx, Refusal.UNDECODABLE, "the first message on a WorkloadChannel stream must be a RegisterWorkload"
            )
        r = msg.register
        try:
            job = check_id("job", r.job_id)
            group = check_id("group", r.group) if r.group else None
            caps = r.capabilities
            if len(caps.supported_modes) > _MAX_MODES:
                raise Refused(Refusal.TOO_LARGE, f"{len(caps.supported_modes)} supported_modes (at most {_MAX_MODES})")
            unknown = [m for m in caps.supported_modes if m not in _MODES]
            if unknown or (caps.default_mode and caps.default_mode not in _MODES):
                bad = unknown[0] if unknown else caps.default_mode
                raise Refused(
                    Refusal.OUT_OF_RANGE,
                    f"suspend mode {shown(bad)} is none of SUSPEND_MODE_OFFLOAD, SUSPEND_MODE_DISCARD",
                )
            supported = frozenset(_MODES[m] for m in caps.supported_modes)
            default = _MODES.get(caps.default_mode, SuspendMode.OFFLOAD)
            if supported and default not in supported:
                raise Refused(
                    Refusal.OUT_OF_RANGE,
                    f"the default mode {default} is not among the supported modes "
                    f"({', '.join(sorted(supported))}): declare default_mode",
                )
            try:
                tags = msgspec.convert(list(caps.tags), _Tags)
            except msgspec.ValidationError as exc:
                raise Refused(
                    Refusal.TOO_LARGE, f"capabilities.tags: {exc} (at most 32 tags of 64 characters each)"
                ) from None
        except Refused as exc:
            await self._malformed(ctx, exc.code, str(exc))
        return _Registration(job, group, supported, default, tags)

    async def _register(self, ctx: Ctx, stream: WorkloadStream) -> WorkloadStream | None:
        """Register the stream's job (the bus's path); the stream it replaces as the job's, if any."""
        req = RegisterJob(
            group=stream.group, job=stream.job, backends=("app_channel",), mode=stream.default, channel=stream.token
        )
        try:
            async with asyncio.timeout(_REGISTER_S), self._registering:
                reply = await self.agent.register(req)
                previous = stream.claim() if reply.ok else None
        except Refused as exc:
            await self._malformed(ctx, exc.code, str(exc))
        except TimeoutError:
            await ctx.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the registration of job {stream.job!r} did not end within {_REGISTER_S:g} s; register again",
            )
        except (BackendUnavailable, ValueError) as exc:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, cap(str(exc)))
        if not reply.ok:
            code = grpc.StatusCode.UNAVAILABLE if reply.code == BUSY else grpc.StatusCode.FAILED_PRECONDITION
            await ctx.abort(code, cap(reply.error or "refused"))
        return previous

    async def _follow(self, ctx: Ctx, stream: WorkloadStream) -> None:
        """Take the workload's results until the stream ends: the workload closes it (OK), it is replaced (ABORTED),
        or a message is malformed (INVALID_ARGUMENT)."""
        refusal: Refused | None = None

        async def read() -> None:
            nonlocal refusal
            try:
                while (msg := await ctx.read()) is not grpc.aio.EOF:
                    self._take(stream, msg)
                stream.close("the workload closed the stream")
            except Refused as exc:
                refusal = exc
                stream.close(f"malformed message: {exc}")
            except Exception as exc:  # undecodable, or the call broke: it ends as its client left it
                refusal = Refused(Refusal.UNDECODABLE, f"a message is no WorkloadMessage: {exc!r}")
                stream.close(f"the stream broke: {exc!r}")

        async with asyncio.TaskGroup() as tg:
            reader = tg.create_task(read())
            await stream.closed.wait()  # the reader ends it, or a newer registration of the job
            reader.cancel()
        if stream.replaced:
            await ctx.abort(
                grpc.StatusCode.ABORTED,
                f"{stream.why}: only the newest WorkloadChannel stream of a job takes its commands",
            )
        if refusal is not None:
            await self._malformed(ctx, refusal.code, str(refusal))

    def _take(self, stream: WorkloadStream, msg: pb.WorkloadMessage) -> None:
        which = msg.WhichOneof("message")
        if which == "register":
            raise Refused(Refusal.UNDECODABLE, "the workload is registered on this stream already")
        if which != "result":
            raise Refused(Refusal.UNDECODABLE, "a WorkloadMessage with neither register nor result")
        r = msg.result
        if not r.command_id or len(r.command_id) > _OP_ID_MAX:
            raise Refused(
                Refusal.TOO_LARGE if r.command_id else Refusal.UNDECODABLE,
                f"a CommandResult's command_id must be 1 to {_OP_ID_MAX} characters, not {len(r.command_id)}",
            )
        error = r.error if len(r.error) <= MAX_TEXT else r.error[: MAX_TEXT - 1] + "…"
        if not stream.answer(r.command_id, StreamResult(r.ok, error)):
            log.info(
                "a result for command %s, which waits no more (it timed out, or never was)",
                shown(r.command_id),
                extra={"node": stream.node, "job": stream.job},
            )

    def _leave(self, stream: WorkloadStream) -> None:
        """End the registration the stream made, as an unregistration of its channel does, in the agent's own task:
        the handler's end (the call cancelled) must not cut it short."""
        req = UnregisterJob(group=stream.group, job=stream.job, channel=stream.token)
        ids = {"node": stream.node, "job": stream.job, "group": stream.group}
        if self.agent.unregister_soon(req):
            log.info("the registration of a WorkloadChannel stream ends with it (%s)", stream.why, extra=ids)
        else:  # the agent is stopping, say: its next start drops the registration
            log.warning("the registration of a closed WorkloadChannel stream could not end now", extra=ids)

    async def _malformed(self, ctx: Ctx, code: Refusal, why: str) -> NoReturn:
        self.agent.metrics.refusal("grpc", code)
        log.warning("WorkloadChannel refused: %s", why, extra={"node": self.agent.node, "peer": ctx.peer()})
        await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, cap(why))
        raise AssertionError("not reached: abort raises")


def _command(c: StreamCommand) -> pb.AgentCommand:
    if c.action == "suspend":
        return pb.AgentCommand(command_id=c.command_id, snapshot=pb.SnapshotCommand(mode=_TO_PB[c.mode], tags=c.tags))
    return pb.AgentCommand(command_id=c.command_id, restore=pb.RestoreCommand(tags=c.tags))
