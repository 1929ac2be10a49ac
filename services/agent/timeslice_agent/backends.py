"""Snapshot backends: how an agent moves a job's context off the accelerators and back.

A backend has ``snapshot(ctx, op)`` and ``restore(ctx, op)``; each returns an :class:`Outcome` or
raises :class:`BackendError`. Backends compose per job (``ctx.backends``, e.g. ``("app_channel",
"freeze")``): snapshot runs them in order (application suspend first, then process-level), restore
in reverse; when a later snapshot step fails, the earlier ones are undone (restored) so the job is
RUNNING again, and only if that undo fails too is the job FAULTED.

Built in: ``noop``, ``freeze``, ``app_channel``, ``app_endpoint`` (vLLM/SGLang HTTP, ``_app_endpoint``) and
``cuda`` (the CUDA driver's process checkpoint, ``_cuda``; available only where ``cuda-python`` and a
GPU are). More plug in through :func:`register_backend`; a backend that may be missing on a node gives a
``probe`` that says why, so the agent announces only what works and refuses the rest with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Iterable
from typing import Literal

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from timeslice_client.protocol import JobContext, WorkloadCommand, WorkloadReply, encode, subjects

from . import _workload_stream
from ._app_endpoint import AppEndpointBackend, make_app_endpoint_backend
from ._backend_api import Backend, BackendError, BackendUnavailable, OpContext, Outcome
from ._cuda import CudaBackend, cuda_unavailable_reason, make_cuda_backend
from ._process_stop import NotStopped, group_members, wait_stopped
from ._workload_stream import is_stream_channel

__all__ = [
    "AppChannelBackend",
    "AppEndpointBackend",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "CudaBackend",
    "FreezeBackend",
    "NoopBackend",
    "OpContext",
    "Outcome",
    "acts_on_processes",
    "available_backends",
    "make_backend",
    "node_default_backend",
    "register_backend",
    "unavailable_backends",
]


class NoopBackend:
    """The context stays where it is (jobs that need no swap; control-plane tests)."""

    name = "noop"

    async def snapshot(self, ctx: JobContext, op: OpContext) -> Outcome:
        return Outcome()

    async def restore(self, ctx: JobContext, op: OpContext) -> Outcome:
        return Outcome()


class FreezeBackend:
    """SIGSTOP on snapshot, SIGCONT on restore, for the job's PIDs or its process group.

    A snapshot ends only once every thread of those processes reads as stopped in ``/proc`` (``_process_stop``):
    ``kill`` returns before the threads stop. If they have not within ``stop_timeout`` seconds (or the operation's
    deadline, if sooner), the processes are continued again and the snapshot fails with the threads that ran."""

    name = "freeze"

    def __init__(self, *, proc: str = "/proc", stop_timeout: float = 10.0) -> None:
        self._proc = proc
        self._stop_timeout = stop_timeout

    async def snapshot(self, ctx: JobContext, op: OpContext) -> Outcome:
        self._signal(ctx, signal.SIGSTOP)
        targets = set(ctx.pids)
        if ctx.pgid is not None:
            # (a scan of every process on the node: off the agent's loop, which other jobs' operations share)
            targets |= await asyncio.to_thread(group_members, ctx.pgid, proc=self._proc)
        try:
            await wait_stopped(targets, timeout=min(self._stop_timeout, op.remaining()), proc=self._proc)
        except BaseException as exc:  # not stopped in time, or the operation cancelled: leave the job running
            with contextlib.suppress(BackendError):
                self._signal(ctx, signal.SIGCONT)
            if isinstance(exc, NotStopped):
                raise BackendError(f"freeze backend: job {ctx.job!r} did not stop: {exc}") from exc
            raise
        return Outcome()

    async def restore(self, ctx: JobContext, op: OpContext) -> Outcome:
        self._signal(ctx, signal.SIGCONT)
        return Outcome()

    @staticmethod
    def _signal(ctx: JobContext, sig: signal.Signals) -> None:
        if ctx.pgid is None and not ctx.pids:
            raise BackendError(f"freeze backend: job {ctx.job!r} was registered without pids or a process group")
        done: list[int] = []
        try:
            if ctx.pgid is not None:
                os.killpg(ctx.pgid, sig)
            for pid in ctx.pids:
                os.kill(pid, sig)
                done.append(pid)
        except ProcessLookupError as exc:
            undo = signal.SIGCONT if sig == signal.SIGSTOP else signal.SIGSTOP
            for pid in done:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, undo)
            raise BackendError(f"freeze backend: process of job {ctx.job!r} is gone ({exc})") from exc
        except PermissionError as exc:
            raise BackendUnavailable(f"freeze backend: not allowed to signal job {ctx.job!r}: {exc}") from exc


class AppChannelBackend:
    """The workload suspends/resumes itself: it registered over the bus and answers our requests, or through the
    gRPC ``WorkloadChannel`` stream (its registration's channel names the stream), which carries them instead."""

    name = "app_channel"

    def __init__(self, nc: NATS, node: str) -> None:
        self._nc = nc
        self._node = node

    async def snapshot(self, ctx: JobContext, op: OpContext) -> Outcome:
        return await self._call(ctx, op, "suspend")

    async def restore(self, ctx: JobContext, op: OpContext) -> Outcome:
        return await self._call(ctx, op, "resume")

    async def _call(self, ctx: JobContext, op: OpContext, action: Literal["suspend", "resume"]) -> Outcome:
        if is_stream_channel(ctx.channel):
            return await _workload_stream.call(self._node, ctx, op, action)
        cmd = WorkloadCommand(
            op_id=op.op_id, action=action, mode=ctx.mode, tags=ctx.tags, epoch=op.epoch, channel=ctx.channel
        )
        subject = subjects.workload_rpc(self._node, ctx.job)
        try:
            msg = await self._ask(subject, encode(cmd), op)
        except Exception as exc:
            kind = exc.__class__.__name__
            raise BackendError(f"workload {ctx.job!r} did not answer {action} ({kind})", rolled_back=False) from exc
        try:
            reply = msgspec.json.decode(msg.data, type=WorkloadReply)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError(
                f"workload {ctx.job!r} answered {action} with garbage: {exc}", rolled_back=False
            ) from exc
        if not reply.ok:
            # The handler contract: a failed suspend rolled itself back; a failed resume did not.
            raise BackendError(
                f"workload {ctx.job!r} failed to {action}: {reply.error}", rolled_back=action == "suspend"
            )
        return Outcome(reply.bytes_moved, reply.device_bytes_freed, reply.elapsed_ms, reply.began_at_release)

    async def _ask(self, subject: str, data: bytes, op: OpContext) -> Msg:
        """The workload's answer, asking again every ``_ASK_AGAIN_S`` until the operation's deadline: a connection
        cut for a moment loses a request or its answer (core NATS, docs/nats.md), and a workload answers a repeated
        op id once more with the outcome of the call it runs or ran, so asking again is safe and costs nothing."""
        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox)
        try:
            while (remaining := op.remaining()) > 0:
                await self._nc.publish(subject, data, reply=inbox)
                try:
                    msg = await sub.next_msg(timeout=min(remaining, _ASK_AGAIN_S))
                except nats.errors.TimeoutError:
                    continue
                if msg.headers and msg.headers.get("Status") == "503":  # nobody subscribed: its connection is away
                    await asyncio.sleep(max(0.0, min(op.remaining(), _NO_RESPONDERS_WAIT_S)))  # back off, ask again
                    continue
                return msg
            raise TimeoutError("the operation's deadline passed")
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


_ASK_AGAIN_S = 1.0
_NO_RESPONDERS_WAIT_S = 0.2

BackendFactory = Callable[[NATS, str], Backend]
Probe = Callable[[], str | None]  # None: usable here; else why not
_FACTORIES: dict[str, BackendFactory] = {
    "noop": lambda nc, node: NoopBackend(),
    "freeze": lambda nc, node: FreezeBackend(),
    "app_channel": AppChannelBackend,
    "app_endpoint": make_app_endpoint_backend,
    "cuda": make_cuda_backend,
}
_PROBES: dict[str, Probe] = {"cuda": cuda_unavailable_reason}
# Backends that never signal, stop or checkpoint a process: a job may register these without proving its processes
# through the agent's socket (their pids then only tell when the job is gone). Every other backend acts on the
# job's processes, so it needs that proof (``_ownership``).
_PROCESS_FREE: set[str] = {"noop", "app_channel", "app_endpoint"}


def register_backend(
    name: str, factory: BackendFactory, *, probe: Probe | None = None, touches_processes: bool | None = None
) -> None:
    """Add (or replace) a backend. ``probe`` returns None where it can run, else the reason it cannot.
    ``touches_processes``: whether it signals, stops or checkpoints the job's processes (then a registration
    must prove them); None keeps what a replaced backend said, and a new one is taken to touch them."""
    _FACTORIES[name] = factory
    if probe is None:
        _PROBES.pop(name, None)
    else:
        _PROBES[name] = probe
    if touches_processes is True:
        _PROCESS_FREE.discard(name)
    elif touches_processes is False:
        _PROCESS_FREE.add(name)


def acts_on_processes(backends: Iterable[str]) -> tuple[str, ...]:
    """The backends among ``backends`` that act on the job's processes (need a proven registration)."""
    return tuple(b for b in backends if b not in _PROCESS_FREE)


def unavailable_backends() -> dict[str, str]:
    """The known backends that cannot run on this node, with the reason (probes run once per process)."""
    out: dict[str, str] = {}
    for name in sorted(_FACTORIES):
        probe = _PROBES.get(name)
        reason = probe() if probe is not None else None
        if reason is not None:
            out[name] = reason
    return out


def available_backends() -> tuple[str, ...]:
    """The backends this node can run."""
    missing = unavailable_backends()
    return tuple(sorted(n for n in _FACTORIES if n not in missing))


def node_default_backend(setting: str) -> str | None:
    """The backend a job that bound its process without a handler gets (``AgentConfig.default_backend``): "auto"
    is ``cuda`` where this node can run it, else None (the lock alone); "none" is None; any other is that name."""
    if setting == "none":
        return None
    if setting == "auto":
        return "cuda" if "cuda" in _FACTORIES and "cuda" not in unavailable_backends() else None
    return setting


def make_backend(name: str, nc: NATS, node: str) -> Backend:
    factory = _FACTORIES.get(name)
    if factory is None:
        raise BackendUnavailable(f"unknown backend {name!r}; this agent has {', '.join(available_backends())}")
    probe = _PROBES.get(name)
    reason = probe() if probe is not None else None
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} is unavailable on node {node!r}: {reason}")
    return factory(nc, node)
