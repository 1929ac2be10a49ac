"""Snapshot backends: how an agent moves a job's context off the accelerators and back.

A backend has ``snapshot(ctx, op)`` and ``restore(ctx, op)``; each returns an :class:`Outcome` or
raises :class:`BackendError`. Backends compose per job (``ctx.backends``, e.g. ``("app_channel",
"freeze")``): snapshot runs them in order (application suspend first, then process-level), restore
in reverse; when a later snapshot step fails, the earlier ones are undone (restored) so the job is
RUNNING again, and only if that undo fails too is the job FAULTED.

More backends (``cuda``, ``app_endpoint``) plug in through :func:`register_backend`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec
from nats.aio.client import Client as NATS
from timeslice_client.protocol import JobContext, WorkloadCommand, WorkloadReply, encode, subjects

__all__ = [
    "AppChannelBackend",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "FreezeBackend",
    "NoopBackend",
    "OpContext",
    "Outcome",
    "make_backend",
    "register_backend",
]


class BackendError(Exception):
    """An operation failed. ``rolled_back`` says whether the job's context is as it was before."""

    def __init__(self, message: str, *, rolled_back: bool = True) -> None:
        self.rolled_back = rolled_back
        super().__init__(message)


class BackendUnavailable(BackendError):
    """The backend cannot run on this node (missing driver, library or permission)."""


@dataclass(frozen=True, slots=True)
class OpContext:
    op_id: str
    epoch: int
    deadline: float  # monotonic seconds

    def remaining(self) -> float:
        return max(0.001, self.deadline - time.monotonic())


@dataclass(frozen=True, slots=True)
class Outcome:
    bytes_moved: int = 0
    device_bytes_freed: int = 0

    def __add__(self, other: Outcome) -> Outcome:
        return Outcome(self.bytes_moved + other.bytes_moved, self.device_bytes_freed + other.device_bytes_freed)


class Backend(Protocol):
    name: str

    async def snapshot(self, ctx: JobContext, op: OpContext) -> Outcome: ...

    async def restore(self, ctx: JobContext, op: OpContext) -> Outcome: ...


class NoopBackend:
    """The context stays where it is (jobs that need no swap; control-plane tests)."""

    name = "noop"

    async def snapshot(self, ctx: JobContext, op: OpContext) -> Outcome:
        return Outcome()

    async def restore(self, ctx: JobContext, op: OpContext) -> Outcome:
        return Outcome()


class FreezeBackend:
    """SIGSTOP on snapshot, SIGCONT on restore, for the job's PIDs or its process group."""

    name = "freeze"

    async def snapshot(self, ctx: JobContext, op: OpContext) -> Outcome:
        self._signal(ctx, signal.SIGSTOP)
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
    """The workload suspends/resumes itself: it registered over the bus and answers our requests."""

    name = "app_channel"

    def __init__(self, nc: NATS, node: str) -> None:
        self._nc = nc
        self._node = node

    async def snapshot(self, ctx: JobContext, op: OpContext) -> Outcome:
        return await self._call(ctx, op, "suspend")

    async def restore(self, ctx: JobContext, op: OpContext) -> Outcome:
        return await self._call(ctx, op, "resume")

    async def _call(self, ctx: JobContext, op: OpContext, action: str) -> Outcome:
        cmd = WorkloadCommand(op_id=op.op_id, action=action, mode=ctx.mode, tags=ctx.tags,  # type: ignore[arg-type]
                              epoch=op.epoch)
        subject = subjects.workload_rpc(self._node, ctx.job)
        try:
            msg = await self._nc.request(subject, encode(cmd), timeout=op.remaining())
        except Exception as exc:
            kind = exc.__class__.__name__
            raise BackendError(f"workload {ctx.job!r} did not answer {action} ({kind})", rolled_back=False) from exc
        try:
            reply = msgspec.json.decode(msg.data, type=WorkloadReply)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError(f"workload {ctx.job!r} answered {action} with garbage: {exc}",
                               rolled_back=False) from exc
        if not reply.ok:
            # The handler contract: a failed suspend rolled itself back; a failed resume did not.
            raise BackendError(f"workload {ctx.job!r} failed to {action}: {reply.error}",
                               rolled_back=action == "suspend")
        return Outcome(reply.bytes_moved, reply.device_bytes_freed)


BackendFactory = Callable[[NATS, str], Backend]
_FACTORIES: dict[str, BackendFactory] = {
    "noop": lambda nc, node: NoopBackend(),
    "freeze": lambda nc, node: FreezeBackend(),
    "app_channel": AppChannelBackend,
}


def register_backend(name: str, factory: BackendFactory) -> None:
    _FACTORIES[name] = factory


def available_backends() -> tuple[str, ...]:
    return tuple(sorted(_FACTORIES))


def make_backend(name: str, nc: NATS, node: str) -> Backend:
    try:
        return _FACTORIES[name](nc, node)
    except KeyError:
        raise BackendUnavailable(
            f"unknown backend {name!r}; this agent has {', '.join(available_backends())}"
        ) from None
