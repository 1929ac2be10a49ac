"""Running a job's composed backends for one operation: in order for a snapshot (application suspend
first, then process-level), in reverse for a restore; a snapshot step that fails is undone by restoring the
steps before it, so the job runs again (FAULTED only when that undo fails too). A job of several parts (its
registrations on the node, ``_job_parts``) runs them all at once, each part's backends in that order; a snapshot one
part could not take and undid is undone in the parts that took it too, so the whole job runs again. And running an
operation while the job's processes are watched, so one whose job exited ends at once instead of at its timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from timeslice_client.protocol import JobContext, JobState, OpKind

from ._backend_api import Backend, BackendError, OpContext, Outcome
from ._host import alive

__all__ = ["Step", "perform", "perform_parts", "until_exited"]

T = TypeVar("T")
Performed = tuple[JobState, str | None, Outcome]


@dataclass(frozen=True, slots=True)
class Step:
    """One part of a job in an operation: its backends, its context (the settings it runs with) and its ``OpContext``
    (what its backends may act on)."""

    backends: Sequence[Backend]
    ctx: JobContext
    op: OpContext


async def perform_parts(steps: Sequence[Step], kind: OpKind, before: JobState, check_s: float) -> Performed | None:
    """Run the operation in every part at once (``perform`` each, watching the part's processes every ``check_s``);
    the job's new state, the errors (each named by its part when there are several) and the outcomes summed, or
    None when every part's processes exited before its operation ended (``until_exited``). A part whose processes
    exit mid-operation has nothing left to move: it counts as done. A restore is done when every part's is, and
    faults the job when one fails. A snapshot is done when every part took it; when one faulted, the job is faulted;
    when a part failed and undid its own steps, the parts that took it are restored too (the job faulted if one
    cannot be), so the whole job runs again."""

    def run(s: Step, k: OpKind, op: OpContext, start: JobState) -> Coroutine[Any, Any, Performed | None]:
        return until_exited(perform(s.backends, s.ctx, op, k, start), s.ctx.pids, check_s)

    if len(steps) == 1:
        return await run(steps[0], kind, steps[0].op, before)
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(run(s, kind, s.op, before)) for s in steps]
    found = [t.result() for t in tasks]
    if all(r is None for r in found):
        return None
    done = JobState.SAVED if kind is OpKind.SNAPSHOT else JobState.RUNNING
    results = [r if r is not None else (done, None, Outcome()) for r in found]
    total = Outcome()
    for _, _, outcome in results:
        total += outcome
    errors = "; ".join(f"{_named(s.ctx)}: {err}" for s, (_, err, _) in zip(steps, results, strict=True) if err)
    if all(state is done for state, _, _ in results):
        return done, None, total
    if kind is OpKind.RESTORE or any(state is JobState.FAULTED for state, _, _ in results):
        return JobState.FAULTED, errors, total
    took = [s for s, r in zip(steps, found, strict=True) if r is not None and r[0] is JobState.SAVED]
    undo_s = max(5.0, max((s.ctx.op_timeout_ms for s in took), default=0) / 1000)
    async with asyncio.TaskGroup() as tg:
        undos = [
            tg.create_task(
                run(
                    s,
                    OpKind.RESTORE,
                    OpContext(s.op.op_id, s.op.epoch, time.monotonic() + undo_s, s.op.may_act),
                    JobState.SAVED,
                )
            )
            for s in took
        ]
    failures = []
    for s, undo in zip(took, undos, strict=True):
        back = undo.result()  # None: the part's processes exited meanwhile, nothing left to bring back
        if back is not None and back[0] is not JobState.RUNNING:
            failures.append(f"{_named(s.ctx)}: {back[1]}")
    if failed := "; ".join(failures):
        return JobState.FAULTED, f"{errors}; undoing the parts that took the snapshot failed too: {failed}", total
    return (
        (JobState.RUNNING if before is not JobState.IDLE else JobState.IDLE),
        f"{errors} (rolled back in every part)",
        total,
    )


def _named(ctx: JobContext) -> str:
    """A part as errors name it: its processes, else its channel."""
    if ctx.pids:
        return f"part of pid {ctx.pids[0]}"
    return f"part of channel {ctx.channel}" if ctx.channel else "part without processes"


async def perform(
    backends: Sequence[Backend], ctx: JobContext, op: OpContext, kind: OpKind, before: JobState
) -> tuple[JobState, str | None, Outcome]:
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
