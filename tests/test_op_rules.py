"""The agent's per-job operation rules (``timeslice_agent._op_rules``), checked as invariants over any sequence of
commands: a hypothesis state machine drives ``decide`` and ``settle`` the way ``Agent._execute_now`` does, against a
model of where the job's state is, with backends that succeed, fail and undo, or fault."""

from __future__ import annotations

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from timeslice_agent._backend_api import Outcome
from timeslice_agent._config import AgentConfig
from timeslice_agent._job_book import JobBook
from timeslice_agent._job_locks import JobLocks
from timeslice_agent._op_rules import Answer, Begin, decide, settle
from timeslice_agent._operations import Operations
from timeslice_agent._ownership import ProcessGuard
from timeslice_agent._standalone import OpSettings, run_context
from timeslice_agent.metrics import AgentMetrics
from timeslice_client.protocol import JobContext, JobState, OpKind, SuspendMode

REGISTERED = (SuspendMode.OFFLOAD, ("weights",))
NOW = 1_000_000


def _job(state: JobState = JobState.IDLE) -> JobContext:
    return JobContext(
        node="n",
        job="j",
        group="g",
        state=state,
        backends=("app_channel",),
        pids=(5,),
        mode=REGISTERED[0],
        tags=REGISTERED[1],
    )


def _decide(
    ctx: JobContext | None,
    kind: OpKind,
    *,
    epoch: int = 1,
    newest: int = 0,
    group: str = "g",
    deadline_ms: int = NOW + 1000,
) -> tuple[Answer | Begin, int | None]:
    return decide(
        ctx,
        node="n",
        job="j",
        group=group,
        op_id="op",
        epoch=epoch,
        deadline_ms=deadline_ms,
        kind=kind,
        newest_epoch=newest,
        now_ms=NOW,
    )


def test_what_each_command_does() -> None:
    unknown, fence = _decide(None, OpKind.SNAPSHOT)
    assert isinstance(unknown, Answer) and not unknown.ok and unknown.remember and fence is None
    other, fence = _decide(_job(JobState.RUNNING), OpKind.SNAPSHOT, group="h")
    assert isinstance(other, Answer) and not other.remember and fence is None  # the other group's fence stays
    stale, fence = _decide(_job(JobState.RUNNING), OpKind.SNAPSHOT, epoch=3, newest=4)
    assert isinstance(stale, Answer) and stale.stale and "stale epoch 3" in (stale.error or "") and fence is None
    # Older than the job's own last operation, with the group's fence lost (a restarted agent, before any command):
    # a command delivered again from before the restart moves nothing.
    saved = msgspec.structs.replace(_job(JobState.SAVED), epoch=7)
    replayed, fence = _decide(saved, OpKind.RESTORE, epoch=5, newest=0)
    assert isinstance(replayed, Answer) and replayed.stale and not replayed.ok and not replayed.remember
    assert fence is None
    assert replayed.error == "stale epoch 5 (group 'g' is at 7 on node 'n')", replayed.error
    again, fence = _decide(saved, OpKind.RESTORE, epoch=7, newest=0)  # the same epoch: its own operation, sent again
    assert isinstance(again, Begin) and fence == 7
    first, fence = _decide(_job(JobState.IDLE), OpKind.RESTORE, epoch=4, newest=4)
    assert isinstance(first, Answer) and first.ok and first.save is not None and fence == 4
    assert first.save.state is JobState.RUNNING and first.save.epoch == 4
    late, _ = _decide(_job(JobState.RUNNING), OpKind.SNAPSHOT, deadline_ms=NOW)
    assert isinstance(late, Answer) and late.error == "deadline passed before start"
    cut, _ = _decide(msgspec.structs.replace(_job(), state=JobState.TRANSITIONING), OpKind.RESTORE)
    assert isinstance(cut, Begin) and cut.before is JobState.SAVED and cut.marked.state is JobState.TRANSITIONING


def test_a_job_registered_afresh_refuses_its_earlier_lives_commands_and_moves_no_group_fence() -> None:
    """A job that registered afresh stores its group's epoch then (``Operations.fence_for_new_job``) and stays IDLE
    until its first operation: a command older than that is stale for it, and a restarted agent seeds its groups'
    fences from the jobs that ran operations only, so another job's older operation, sent again, still runs."""
    fresh = msgspec.structs.replace(_job(JobState.IDLE), epoch=9)
    old, fence = _decide(fresh, OpKind.SNAPSHOT, epoch=6, newest=0)
    assert isinstance(old, Answer) and old.stale and not old.ok and fence is None
    first, fence = _decide(fresh, OpKind.RESTORE, epoch=9, newest=0)
    assert isinstance(first, Answer) and first.ok and first.save is not None and first.save.epoch == 9 and fence == 9

    book = JobBook("n", fence=_no_fence)
    ops = Operations(AgentConfig(node_id="n"), book, JobLocks(), ProcessGuard(), AgentMetrics())
    trailing = msgspec.structs.replace(_job(JobState.RUNNING), job="k", epoch=6)
    ops.seed_epochs([fresh, trailing])
    assert ops.epoch("g") == 6  # not 9: k's snapshot of epoch 6, sent again, is not refused for the newcomer
    ops.seed_epochs([msgspec.structs.replace(fresh, state=JobState.RUNNING)])
    assert ops.epoch("g") == 9  # once it ran an operation at 9, its epoch is a command's


async def _no_fence(group: str) -> int:
    return 0


class OperationRules(RuleBasedStateMachine):
    """One job on one node. ``where``: where the model's state is (``device``, ``host``; ``unknown`` after a fault);
    ``suspended_with``: the settings the host copy was made with."""

    def __init__(self) -> None:
        super().__init__()
        self.ctx = _job()
        self.newest = 0
        self.epoch = 0
        self.where = "device"
        self.suspended_with: tuple[SuspendMode, tuple[str, ...]] | None = None
        self.suspends_while_saved = 0

    @rule(
        kind=st.sampled_from([OpKind.SNAPSHOT, OpKind.RESTORE]),
        step=st.sampled_from([-1, 0, 1, 1, 1]),
        asked_mode=st.sampled_from([None, None, SuspendMode.DISCARD, SuspendMode.OFFLOAD]),
        asked_tags=st.sampled_from([None, None, ("kv",), ()]),
        late=st.booleans(),
        backend=st.sampled_from(["ok", "ok", "ok", "undone", "faulted"]),
    )
    def command(
        self,
        kind: OpKind,
        step: int,
        asked_mode: SuspendMode | None,
        asked_tags: tuple[str, ...] | None,
        late: bool,
        backend: str,
    ) -> None:
        epoch = max(0, self.epoch + step)
        self.epoch = max(self.epoch, epoch)
        deadline = NOW - 1 if late else NOW + 1000
        verdict, fence = _decide(self.ctx, kind, epoch=epoch, newest=self.newest, deadline_ms=deadline)
        if epoch < self.newest:
            assert isinstance(verdict, Answer) and not verdict.ok and not verdict.remember and fence is None
        if fence is not None:
            assert fence >= self.newest, "the fence never moves back"
            self.newest = fence
        if isinstance(verdict, Answer):
            if verdict.save is not None:
                self.ctx = verdict.save
            return
        # Begin: the backends run. Never for a faulted job, nor with nothing to move.
        assert self.ctx.state is not JobState.FAULTED
        assert not (kind is OpKind.SNAPSHOT and self.ctx.state is JobState.SAVED), "a second suspend of saved state"
        assert not (kind is OpKind.RESTORE and self.ctx.state in (JobState.RUNNING, JobState.IDLE))
        assert not late
        ran = run_context(self.ctx, kind, OpSettings(mode=asked_mode, tags=asked_tags))
        self.ctx = verdict.marked
        state, failure = self._perform(kind, ran, verdict.before, backend, OpSettings(asked_mode, asked_tags))
        self.ctx = settle(self.ctx, ran, op_id="op", state=state, failure=failure, outcome=Outcome(), elapsed_ms=1.0)

    def _perform(
        self, kind: OpKind, ran: JobContext, before: JobState, backend: str, asked: OpSettings
    ) -> tuple[JobState, str | None]:
        if backend == "faulted":
            self.where = "unknown"
            return JobState.FAULTED, "the backend failed"
        if backend == "undone":
            if kind is OpKind.RESTORE:  # a failed restore is a fault: its state is half back
                self.where = "unknown"
                return JobState.FAULTED, "restore failed"
            return (JobState.IDLE if before is JobState.IDLE else JobState.RUNNING), "suspend failed (rolled back)"
        if kind is OpKind.SNAPSHOT:
            if self.where == "host":
                self.suspends_while_saved += 1
            self.where, self.suspended_with = "host", (ran.mode, ran.tags)
            return JobState.SAVED, None
        if self.suspended_with is not None:
            # the restore resumes the state the way it was suspended, unless this request says otherwise itself (a
            # wake of some tags only); never the way an earlier request asked
            mode = asked.mode if asked.mode is not None else self.suspended_with[0]
            tags = asked.tags if asked.tags is not None else self.suspended_with[1]
            assert (ran.mode, ran.tags) == (mode, tags), (ran, self.suspended_with, asked)
        self.where, self.suspended_with = "device", None
        return JobState.RUNNING, None

    @precondition(lambda self: self.ctx.state is JobState.FAULTED)
    @rule()
    def clear_fault(self) -> None:
        """``timeslice agent-clear-fault``: the state is unknown, so treat it as saved (resume is idempotent)."""
        self.ctx = msgspec.structs.replace(self.ctx, state=JobState.SAVED, reason=None)
        self.suspended_with = None  # how it was suspended is unknown too

    @invariant()
    def a_requests_settings_never_become_the_jobs(self) -> None:
        assert (self.ctx.mode, self.ctx.tags) == REGISTERED

    @invariant()
    def the_stored_state_says_where_the_state_is(self) -> None:
        if self.where == "unknown":
            return
        if self.ctx.state is JobState.SAVED:
            assert self.where == "host"
        elif self.ctx.state in (JobState.RUNNING, JobState.IDLE):
            assert self.where == "device"
        assert self.ctx.state is not JobState.TRANSITIONING, "an operation ended with the job still transitioning"

    @invariant()
    def one_suspend_per_switch(self) -> None:
        assert self.suspends_while_saved == 0

    @invariant()
    def a_faulted_job_says_why(self) -> None:
        if self.ctx.state is JobState.FAULTED:
            assert self.ctx.reason


OperationRules.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
TestOperationRules = OperationRules.TestCase
