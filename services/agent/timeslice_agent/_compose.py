"""Running a job's composed backends for one operation: in order for a snapshot (application suspend
first, then process-level), in reverse for a restore; a snapshot step that fails is undone by restoring the
steps before it, so the job runs again (FAULTED only when that undo fails too). And running an operation
while the job's processes are watched, so one whose job exited ends at once instead of at its timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from timeslice_client.protocol import JobContext, JobState, OpKind

from ._backend_api import Backend, BackendError, OpContext, Outcome
from ._host import alive

__all__ = ["perform", "until_exited"]

T = TypeVar("T")


async def perform(backends: Sequence[Backend], ctx: JobContext, op: OpContext, kind: OpKind,
                  before: JobState) -> tuple[JobState, str | None, Outcome]:
    """Run the operation through ``backends``; returns (the job's new state, the error or None, the outcome)."""
    total = Outcome()
    done: list[Backend] = []
    try:
        async with asyncio.timeout(op.remaining()):
            if kind is OpKind.SNAPSHOT:
                for b in backends:
                    total += await b.snapshot(ctx, op)
                    done.append(b)
                return JobState.SAVED, None, total
            for b in reversed(backends):
                total += await b.restore(ctx, op)
            return JobState.RUNNING, None, total
    except TimeoutError:
        return JobState.FAULTED, f"{kind} timed out after {ctx.op_timeout_ms} ms budget", total
    except BackendError as exc:
        if kind is OpKind.RESTORE or not exc.rolled_back:
            return JobState.FAULTED, str(exc), total
        # Undo the steps that succeeded, newest first, so the job runs again.
        undo = OpContext(op.op_id, op.epoch, time.monotonic() + max(5.0, ctx.op_timeout_ms / 1000))
        try:
            async with asyncio.timeout(undo.remaining()):
                for b in reversed(done):
                    await b.restore(ctx, undo)
        except (BackendError, TimeoutError) as undo_exc:
            return JobState.FAULTED, f"{exc}; rollback failed too: {undo_exc}", total
        return (JobState.RUNNING if before is not JobState.IDLE else JobState.IDLE), f"{exc} (rolled back)", total
    except Exception as exc:  # a backend's bug or a library's own error: what it did is unknown, never TRANSITIONING
        return JobState.FAULTED, f"{kind} failed in a backend: {exc!r}", total


async def until_exited(work: Coroutine[Any, Any, T], pids: Sequence[int], check_s: float) -> T | None:
    """``work``'s result; or ``None`` as soon as every one of ``pids`` has exited (checked every ``check_s``),
    ``work`` then cancelled. With no pids to watch, just ``work``.

    ``work`` runs in the calling task, so it starts at once: its first publish joins the socket write of the
    caller's (a separate task would start only after the connection's flusher has written those). A timer
    checks the pids and cancels the caller when they are gone; it is stopped before this returns."""
    if not pids:
        return await work
    loop = asyncio.get_running_loop()
    caller = asyncio.current_task()
    assert caller is not None
    exited = False
    timer: asyncio.TimerHandle | None = None

    def check() -> None:
        nonlocal exited, timer
        if any(alive(p) for p in pids):
            timer = loop.call_later(check_s, check)
        else:
            exited = True
            caller.cancel()

    timer = loop.call_later(check_s, check)
    try:
        result = await work
    except asyncio.CancelledError:
        # Ours (the pids are gone) and nobody else's: end with None. Any other cancellation goes on.
        if exited and caller.uncancel() == 0:
            return None
        raise
    finally:
        timer.cancel()
    if exited:  # ``work`` swallowed our cancellation: take the request back
        caller.uncancel()
    return result
