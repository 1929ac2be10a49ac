"""What ``timeslice advise`` works with: each job's phases as it ran them, what a switch of it costs, and the
predicted run.

Plain frozen dataclasses (they never travel on the bus). Times are seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["CostSource", "JobOutcome", "JobTrace", "Phase", "Prediction", "SwitchCost"]

CostSource = Literal["measured", "given", "none"]


@dataclass(frozen=True, slots=True)
class Phase:
    """One stretch of a job's run: on the accelerators (a hold: grant to release) or off them (its release to its
    next acquire: reward scoring, data loading, whatever the job does without the group)."""

    on_accelerator: bool
    seconds: float


@dataclass(frozen=True, slots=True)
class SwitchCost:
    """What moving a job's context costs: its snapshot (device to host) and its restore (host to device), in
    seconds, and where the figures came from: ``measured`` (the median of its operations in the window read),
    ``given`` (a flag), ``none`` (nothing known: switches taken as free, which the report says)."""

    snapshot_s: float = 0.0
    restore_s: float = 0.0
    source: CostSource = "none"
    samples: int = 0  # operations the measured figures are the median of


@dataclass(frozen=True, slots=True)
class JobTrace:
    """A job's recorded run, as ``timeslice advise`` replays it: its phases from its first acquire on, the group it
    held, the wall time it took (first acquire to last release), and what a switch of it costs."""

    job: str
    group: str
    phases: tuple[Phase, ...]
    wall_s: float
    cost: SwitchCost = SwitchCost()
    started_ms: int = 0  # stream time of its first acquire (ms since the epoch; 0: not from a stream)
    priority: int = 0  # the class it is to ask at when sharing (``Acquire.priority``)

    @property
    def held_s(self) -> float:
        return sum(p.seconds for p in self.phases if p.on_accelerator)

    @property
    def holds(self) -> int:
        return sum(1 for p in self.phases if p.on_accelerator)


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """One job in the predicted shared run."""

    job: str
    alone_s: float  # its recorded wall time
    shared_s: float  # its predicted wall time when sharing (from the common start)
    held_s: float
    waited_s: float  # asked for the group and did not have it yet
    switched_in: int  # grants that needed its context restored


@dataclass(frozen=True)
class Prediction:
    """The predicted shared run of several jobs on one group, beside the same jobs run one after the other."""

    jobs: list[JobOutcome]
    makespan_s: float  # all jobs started together, until the last one ended
    back_to_back_s: float  # the recorded wall times, added up
    duty_cycle: float  # share of the makespan in which some job held the group
    alone_duty_cycle: float  # held time over wall time of the recorded runs
    switches: int  # grants to another job than the group's last holder
    switching_s: float  # the group idle between a release and the next job's grant, added up
    switch_median_s: float
    hop_s: float  # one bus pass, as modelled
    room: bool  # restores modelled beside the snapshots they follow (the agent's room rule)
    events: int  # events the core applied
    notes: list[str] = field(default_factory=list)  # what the prediction assumed that the reader should know

    @property
    def speedup(self) -> float:
        """Back to back over shared: above 1, sharing finishes sooner."""
        return self.back_to_back_s / self.makespan_s if self.makespan_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["speedup"] = self.speedup
        return out
