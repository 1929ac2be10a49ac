"""trace_replay.py's ``sim`` mode: the jobs' schedules replayed through the orchestrator's pure core in simulated
time, by the same simulation as ``timeslice advise`` (``timeslice_orchestrator.advise.simulate``: the core's own
``apply``, a bus pass per message, the clients' renewals, a simulated agent that takes the switch profile's time for
a context it moves; a restore after the snapshots it follows, as on a node without room for both contexts).

An hour-long trace of three jobs is a few thousand events: well under a second.
"""

from __future__ import annotations

from _trace_model import Log, Step, SwitchProfile
from timeslice_orchestrator.advise import Phase, SwitchCost
from timeslice_orchestrator.advise import simulate as simulate_phases


def simulate(
    schedules: dict[str, list[Step]], switch: SwitchProfile, hop_s: float, group: str = "sim"
) -> tuple[Log, int]:
    """Replay the schedules; returns the run's log and the number of events the core applied."""
    cost = SwitchCost(snapshot_s=switch.snapshot_s, restore_s=switch.restore_s, source="given")
    phases = {j: [Phase(accel, s) for step in sched for _, accel, s in step] for j, sched in schedules.items()}
    run = simulate_phases(phases, dict.fromkeys(schedules, cost), hop_s=hop_s, group=group)
    log: Log = {j: list(events) for j, events in run.log.items()}
    return log, run.events
