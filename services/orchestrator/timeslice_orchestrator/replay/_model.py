"""What a replay reconstructs: intervals per group, per (node, job) and per job, and the summary figures.

Plain dataclasses (they never travel on the bus). Times are stream timestamps in milliseconds since the
epoch; an interval still open at the end of the stream has ``end_ms`` None.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "FairShareChoice",
    "Fault",
    "GroupSummary",
    "GroupTimeline",
    "Handoff",
    "HoldInterval",
    "JobLane",
    "JobSummary",
    "OpBar",
    "PhaseSpan",
    "PredictedRestore",
    "Replay",
    "StateInterval",
    "StreamEvent",
    "Summary",
    "SwitchInterval",
    "WaitInterval",
]


@dataclass(frozen=True)
class StreamEvent:
    """One raw ``TIMESLICE`` message: stream sequence, stream timestamp (ms), subject and payload."""

    seq: int
    ts_ms: int
    subject: str
    data: bytes


@dataclass
class HoldInterval:
    """A job held the group at ``epoch`` from its grant to its release or revocation."""

    job: str
    epoch: int
    start_ms: int
    end_ms: int | None = None
    request_id: str = ""
    waited_ms: int = 0
    context_restored: bool = False
    end: str = ""  # "released", or the revocation's reason
    yield_requested_ms: int | None = None  # when it was asked to yield (held past the quantum while others waited)


@dataclass
class WaitInterval:
    """A job waited for the group (queued, or the target of a running switch)."""

    job: str
    start_ms: int
    end_ms: int | None = None
    outcome: str = ""  # "granted", a dequeue reason ("timeout", "cancelled", …), "refused: CODE"
    epoch: int | None = None  # the epoch it was granted, if granted
    priority: int = 0  # the class it waited at (``Acquire.priority``)


@dataclass
class SwitchInterval:
    """The group moved contexts: snapshots of the loaded jobs, then restores of the incoming one."""

    epoch: int
    to_job: str | None
    start_ms: int
    end_ms: int | None = None
    restore_from_ms: int | None = None  # when the restore phase began (the switch's last snapshot ended)
    snapshotted: list[str] = field(default_factory=list)  # jobs whose context went to host memory
    granted: bool = False


@dataclass
class Handoff:
    """The group passed from one job to another: the previous hold ended, the next job was granted."""

    from_job: str
    to_job: str
    epoch: int
    released_ms: int
    granted_ms: int

    @property
    def ms(self) -> int:
        return self.granted_ms - self.released_ms


@dataclass
class Fault:
    job: str
    ts_ms: int
    reason: str


@dataclass
class FairShareChoice:
    """Fair share put ``job`` first at ``ts_ms``, ahead of ``over`` (a waiter of the same effective priority):
    ``why`` says each one's recent held time and share (``GroupRecord.picked``)."""

    job: str
    over: str
    ts_ms: int
    why: str


@dataclass
class PredictedRestore:
    """A predictive restore of ``job``'s context planned at ``ts_ms`` (``GroupRecord.plan``; the group's ``predict``
    policy), started at ``started_ms`` (a switch with ``SwitchRecord.ahead``; None: never), and how it ended at
    ``end_ms``: ``dropped`` (a job asked before it started), ``hit`` (it started and ``job`` was the next job granted),
    ``missed`` (it started and another job was granted next), ``replaced`` (a phase start planned an earlier restore
    before it started), ``""`` (still open where the stream read ends). ``phase``: the phase whose start planned it
    (``Prediction.phase``; None: the cycle rule, at a release)."""

    job: str
    ts_ms: int
    started_ms: int | None = None
    end_ms: int | None = None
    outcome: str = ""
    phase: str | None = None


@dataclass
class MinHold:
    """The group was kept for ``job`` (its hold at ``epoch`` came through a switch and ended before the group's
    minimum hold while others waited) from ``start_ms`` until ``end_ms``: ``outcome`` says how it ended
    (``reacquired``: the job took the group back without a switch; ``expired``: the window ended and the next
    waiter was served; ``ended``: the job faulted or left a node)."""

    job: str
    epoch: int
    start_ms: int
    until_ms: int
    end_ms: int | None = None
    outcome: str = ""


@dataclass
class GroupTimeline:
    group: str
    holds: list[HoldInterval] = field(default_factory=list)
    waits: list[WaitInterval] = field(default_factory=list)
    switches: list[SwitchInterval] = field(default_factory=list)
    handoffs: list[Handoff] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    min_holds: list[MinHold] = field(default_factory=list)
    fair_shares: list[FairShareChoice] = field(default_factory=list)
    predictions: list[PredictedRestore] = field(default_factory=list)
    lease_expiries: int = 0
    events: int = 0  # input events folded


@dataclass
class StateInterval:
    """A job's context on one node was in ``state`` (RUNNING, TRANSITIONING, SAVED, FAULTED, IDLE)."""

    state: str
    start_ms: int
    end_ms: int | None = None


@dataclass
class OpBar:
    """One snapshot or restore: issued by the core, started by the agent, answered with its outcome."""

    op_id: str
    kind: str  # "snapshot" | "restore"
    epoch: int
    start_ms: int  # the agent's start (OpStarted) or, without one, when the core issued it
    end_ms: int | None = None
    issued_ms: int = 0
    bytes: int = 0
    device_bytes_freed: int = 0
    elapsed_ms: float | None = None  # as the agent measured it
    work_ms: float | None = None  # the workload's own call, where reported; see began_at_release
    began_at_release: bool = False  # a suspend begun at the job's release: elapsed_ms is only its end
    backend: str = ""
    ok: bool | None = None
    error: str | None = None

    @property
    def duration_ms(self) -> float | None:
        if self.elapsed_ms is not None and self.elapsed_ms > 0:
            return self.elapsed_ms
        return None if self.end_ms is None else float(self.end_ms - self.start_ms)

    @property
    def copy_ms(self) -> float | None:
        """The time its bytes took to move: the workload's whole call when its suspend began at the release
        (the operation saw only the end of it), else the operation's duration."""
        if self.began_at_release and self.work_ms:
            return self.work_ms
        return self.duration_ms


@dataclass
class JobLane:
    node: str
    job: str
    group: str
    states: list[StateInterval] = field(default_factory=list)
    ops: list[OpBar] = field(default_factory=list)


@dataclass
class PhaseSpan:
    name: str
    group: str
    start_ms: int
    end_ms: int | None = None
    epoch: int | None = None
    error: str | None = None


@dataclass
class GroupSummary:
    duty_cycle: float  # share of the window in which some job held the group, 0..1
    switches: int
    handoffs: int
    wait_p50_ms: float | None
    wait_p95_ms: float | None
    snapshot_p50_ms: float | None
    restore_p50_ms: float | None
    snapshot_gbps: float | None  # median over snapshots that moved bytes
    restore_gbps: float | None
    faults: int
    lease_expiries: int
    window_ms: int
    grants: int = 0
    handoff_p50_ms: float | None = None  # previous hold ended -> next job granted
    yield_requests: int = 0  # holders asked to yield (the group's quantum)
    min_holds_kept: int = 0  # short releases that kept the group for their job (the group's minimum hold)
    min_holds_reacquired: int = 0  # of those, taken back by their job without a switch
    fair_share_choices: int = 0  # waiters put first by fair share (ahead of one of the same effective priority)
    predictions: int = 0  # predictive restores planned (the group's predict policy)
    predictions_hit: int = 0  # of those, started and their job granted next (its context back before it asked)


@dataclass
class JobSummary:
    held_ms: float
    waited_ms: float
    phase_ms: dict[str, float] = field(default_factory=dict)
    grants: int = 0


@dataclass
class Summary:
    since_ms: int
    until_ms: int
    groups: dict[str, GroupSummary] = field(default_factory=dict)
    jobs: dict[str, JobSummary] = field(default_factory=dict)


@dataclass
class Replay:
    """A window of the stream, rebuilt by folding it through the orchestrator's pure core."""

    since_ms: int
    until_ms: int
    groups: dict[str, GroupTimeline]
    nodes: dict[tuple[str, str], JobLane]
    phases: dict[str, list[PhaseSpan]]
    summary: Summary
    violations: list[str] = field(default_factory=list)  # invariant violations met while folding
    first_seq: int = 0
    last_seq: int = 0

    def to_json(self) -> dict[str, Any]:
        """Builtins only (``json.dumps`` takes it as it is); lanes are listed with their node and job."""
        return {
            "since_ms": self.since_ms,
            "until_ms": self.until_ms,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "groups": {g: asdict(t) for g, t in sorted(self.groups.items())},
            "nodes": [asdict(lane) for _, lane in sorted(self.nodes.items())],
            "phases": {j: [asdict(p) for p in spans] for j, spans in sorted(self.phases.items())},
            "summary": asdict(self.summary),
            "violations": list(self.violations),
        }
