"""The agent's rules for one operation on one job, as pure functions (the orchestrator's core has its own): what a
command does given the job's stored context (``decide``), and what the context becomes once the job's backends ran
(``settle``). ``Agent._execute_now`` holds the job's lock, calls them and does the I/O they ask for; the property
tests (``tests/test_op_rules.py``) check the rules as invariants over any sequence of commands:

* a command of an older epoch than its group's newest never runs a backend, and never moves the fence;
* a faulted job's backends never run (its state is unknown until the fault is cleared);
* nothing runs when there is nothing to move: a snapshot of a saved job, a restore of a running or never-run one
  (so one switch suspends a job once, however often the command comes);
* a request's own suspend mode and tags never become the job's: the stored ones stay the registration's, and only
  the saved state remembers how it was suspended, for the restore after it;
* an operation that begins marks the job TRANSITIONING, and ends it SAVED, RUNNING (or IDLE, rolled back before it
  ever ran), or FAULTED with the reason."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from timeslice_client.protocol import JobContext, JobState, OpKind

from ._backend_api import Outcome
from ._standalone import settled

__all__ = ["Answer", "Begin", "decide", "settle"]


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer the command without running a backend: ``ok`` or ``error``. ``remember``: the same op id gets this
    answer again (a verdict about the job, not about a stale or misaddressed command). ``save``: the job's context
    to store first (a never-run job becomes RUNNING at its first restore), None: unchanged. ``stale``: refused for its
    epoch (older than the group's newest here or the job's last operation)."""

    ok: bool
    error: str | None = None
    remember: bool = True
    save: JobContext | None = None
    stale: bool = False


@dataclass(frozen=True, slots=True)
class Begin:
    """Run the job's backends: store ``marked`` (TRANSITIONING, this op's id) first; ``before`` is the state the
    operation starts from (the one a restart cut short began from, when the job was TRANSITIONING)."""

    before: JobState
    marked: JobContext


def decide(
    ctx: JobContext | None,
    *,
    node: str,
    job: str,
    group: str,
    op_id: str,
    epoch: int,
    deadline_ms: int,
    kind: OpKind,
    newest_epoch: int,
    now_ms: int,
) -> tuple[Answer | Begin, int | None]:
    """What an operation does, and the group's fence after it (None: unchanged). Pure: the caller stores and runs."""
    if ctx is None:
        return Answer(ok=False, error=f"job {job!r} is not registered on node {node!r}"), None
    if ctx.group != group:  # neither moves this job nor the other group's epoch fence
        return Answer(
            ok=False,
            remember=False,
            error=f"job {job!r} is registered in group {ctx.group!r} on node {node!r}, not {group!r}",
        ), None
    if epoch < newest_epoch or epoch < ctx.epoch:
        # Older than the group's newest command here, or than the job's own last operation (stored: it outlives a
        # restart of this agent, after which the durable consumer may deliver commands from before it again).
        return Answer(
            ok=False,
            remember=False,
            error=f"stale epoch {epoch} (group {group!r} is at {max(newest_epoch, ctx.epoch)} on node {node!r})",
            stale=True,
        ), None
    if ctx.state is JobState.FAULTED:
        return Answer(ok=False, error=f"job is faulted: {ctx.reason}"), epoch
    if (kind is OpKind.SNAPSHOT and ctx.state is JobState.SAVED) or (
        kind is OpKind.RESTORE and ctx.state in (JobState.RUNNING, JobState.IDLE)
    ):
        # Nothing to move: already saved, already running, or never ran (nothing was saved).
        save = msgspec.structs.replace(ctx, state=JobState.RUNNING, epoch=epoch) if ctx.state is JobState.IDLE else None
        return Answer(ok=True, save=save), epoch
    if deadline_ms <= now_ms:
        return Answer(ok=False, error="deadline passed before start"), epoch
    before = ctx.state
    if before is JobState.TRANSITIONING:  # cut short by a restart of this agent: where it started from
        before = JobState.RUNNING if kind is OpKind.SNAPSHOT else JobState.SAVED
    marked = msgspec.structs.replace(
        ctx, state=JobState.TRANSITIONING, epoch=epoch, last_op_id=op_id, last_op_ok=None, last_op_error=None
    )
    return Begin(before=before, marked=marked), epoch


def settle(
    current: JobContext,
    ran: JobContext,
    *,
    op_id: str,
    state: JobState,
    failure: str | None,
    outcome: Outcome,
    elapsed_ms: float,
) -> JobContext:
    """The job's context once its backends ended the operation in ``state``: ``current`` (the registration now, which
    may have changed while the operation ran) with the outcome, and how the saved state was suspended when ``ran``
    (the settings the operation ran with) differ from the registered ones."""
    return msgspec.structs.replace(
        current,
        state=state,
        reason=failure if state is JobState.FAULTED else None,
        last_op_id=op_id,
        last_op_ok=failure is None,
        last_op_error=failure,
        bytes_moved=outcome.bytes_moved,
        device_bytes_freed=outcome.device_bytes_freed,
        elapsed_ms=elapsed_ms,
        **settled(ran, current, state),
    )
