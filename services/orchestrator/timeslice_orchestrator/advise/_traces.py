"""Each job's recorded run, read off a replay (``timeslice_orchestrator.replay``) of the stream.

A job's phases come from its holds in the group it used: each hold (grant to release) is a phase on the
accelerators, and the time from one release to the job's next acquire (the hold's grant less what it waited) is a
phase off them. What a job waited for the group is not its own: it is what sharing changes, so it is left out, and
the simulation puts back what the shared run would make it wait. The run starts at the job's first acquire and ends
at its last release (what it does before and after never touches the group).

A switch's costs are the medians of the job's own snapshots and restores in the window (any group, any node) that
moved its context; given figures override them, per job or for all.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

from .._errors import AdviseError
from ..replay import HoldInterval, Replay
from ._model import JobTrace, Phase, SwitchCost

__all__ = ["MAX_JOBS", "job_spec", "measured_cost", "trace_of", "traces"]

MAX_JOBS = 64  # jobs one prediction takes (each adds its phases to the simulation)


def job_spec(text: str) -> tuple[str, str | None]:
    """``JOB`` or ``JOB@GROUP`` (the group whose holds make the job's run, when the window holds several)."""
    job, _, group = text.partition("@")
    return job, (group or None)


def _holds(replay: Replay, job: str, group: str | None) -> tuple[str, list[HoldInterval]]:
    found = {
        g: [h for h in t.holds if h.job == job and h.end_ms is not None]
        for g, t in replay.groups.items()
        if group is None or g == group
    }
    found = {g: hs for g, hs in found.items() if hs}
    if not found:
        where = f"group {group!r}" if group else "any group"
        raise AdviseError(
            f"job {job!r} has no finished hold in {where} of the window read; run it (alone) first, "
            "or widen the window (--since/--until)"
        )
    if len(found) > 1:
        raise AdviseError(
            f"job {job!r} held several groups in the window ({', '.join(sorted(found))}); name the one "
            f"to predict for as {job}@GROUP"
        )
    ((g, holds),) = found.items()
    return g, sorted(holds, key=lambda h: h.start_ms)


def measured_cost(replay: Replay, job: str) -> SwitchCost:
    """The medians of ``job``'s successful snapshots and restores that moved its context (reported bytes moved or
    device bytes freed: an operation on a context already where it should be moves nothing and costs no switch);
    ``none`` without any."""
    snaps: list[float] = []
    restores: list[float] = []
    for (_, lane_job), lane in replay.nodes.items():
        for op in lane.ops if lane_job == job else ():
            ms = op.copy_ms
            if op.ok and ms is not None and (op.bytes or op.device_bytes_freed):
                (snaps if op.kind == "snapshot" else restores).append(ms / 1000)
    if not snaps and not restores:
        return SwitchCost()
    return SwitchCost(
        snapshot_s=statistics.median(snaps) if snaps else 0.0,
        restore_s=statistics.median(restores) if restores else 0.0,
        source="measured",
        samples=len(snaps) + len(restores),
    )


def trace_of(replay: Replay, job: str, group: str | None = None, cost: SwitchCost | None = None) -> JobTrace:
    """``job``'s run as recorded in ``replay`` (see the module doc); ``cost``: given switch costs (else measured)."""
    g, holds = _holds(replay, job, group)
    phases: list[Phase] = []
    end_ms = None
    for h in holds:
        assert h.end_ms is not None
        asked = h.start_ms - h.waited_ms
        if end_ms is not None and asked > end_ms:
            phases.append(Phase(on_accelerator=False, seconds=(asked - end_ms) / 1000))
        phases.append(Phase(on_accelerator=True, seconds=max(0, h.end_ms - h.start_ms) / 1000))
        end_ms = h.end_ms
    first = holds[0].start_ms - holds[0].waited_ms
    assert end_ms is not None
    return JobTrace(
        job=job,
        group=g,
        phases=tuple(phases),
        wall_s=(end_ms - first) / 1000,
        cost=cost if cost is not None else measured_cost(replay, job),
        started_ms=first,
    )


def traces(replay: Replay, specs: Iterable[str], costs: Mapping[str, SwitchCost] | None = None) -> list[JobTrace]:
    """The traces of the jobs named by ``specs`` (``JOB`` or ``JOB@GROUP``), each once; ``costs``: given switch
    costs by job (``"*"``: every job without its own)."""
    seen: dict[str, JobTrace] = {}
    costs = costs or {}
    for spec in specs:
        job, group = job_spec(spec)
        if job in seen:
            raise AdviseError(f"job {job!r} is named twice; each job runs once in a prediction")
        if len(seen) == MAX_JOBS:
            raise AdviseError(f"at most {MAX_JOBS} jobs in one prediction")
        seen[job] = trace_of(replay, job, group, costs.get(job, costs.get("*")))
    if len(seen) < 2:
        raise AdviseError("name at least two jobs: a prediction is of jobs sharing a group")
    return list(seen.values())
