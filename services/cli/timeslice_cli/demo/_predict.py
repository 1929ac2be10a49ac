"""The demo's prediction of its shared run, made from its solo runs before the shared run starts
(``timeslice advise``, docs/scheduling.md "Predicting a shared run").

Each job's run as ``advise`` reads it covers its first acquire to its last release; the demo times a job from its
``go`` to its final checkpoint, so the time before the first acquire and after the last release (the model's build
is done before ``go``; the first batch, the final checkpoint) is added back as phases off the accelerators, as they
were in the solo run. The demo's agent runs on the host, where two small models fit at once: restores run beside the
snapshots they follow (``room``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ._runner import RunResult

__all__ = ["SharedPrediction", "predict_shared"]


@dataclass(frozen=True, slots=True)
class SharedPrediction:
    shared_s: float  # the predicted wall time of the shared run (go to the last job's final checkpoint)
    switches: int
    duty_cycle: float  # of the group over the jobs' span of holds
    switch_costs: str  # where the switch costs came from, for the report


BUS_PASSES_S = 0.002  # an agent operation's bus passes beside the handler's own call (command in, answer out)


async def predict_shared(nats_url: str, solo: RunResult) -> SharedPrediction:
    """Read the solo runs' windows of the stream and predict the jobs sharing one group, with each job's switch
    costs as its process timed its handler (``Built.suspend_ms``/``resume_ms``) plus the operation's bus passes, or
    as measured in the window when the job did not time them."""
    from timeslice_orchestrator.advise import Phase, SwitchCost, predict, trace_of
    from timeslice_orchestrator.replay import fold_events, read_window

    since = min(j.go_ms for j in solo.jobs.values())
    until = max(j.done_ms for j in solo.jobs.values())
    events = await read_window(nats_url, since_ms=since, until_ms=until)
    replay = fold_events(events, since_ms=since, until_ms=until)
    traces = []
    for job, res in solo.jobs.items():
        b = res.built
        given = None
        if b is not None and (b.suspend_ms or b.resume_ms):
            given = SwitchCost(
                snapshot_s=b.suspend_ms / 1000 + BUS_PASSES_S,
                restore_s=b.resume_ms / 1000 + BUS_PASSES_S,
                source="given",
                samples=1,
            )
        t = trace_of(replay, job, res.group, given)
        lead = max(0.0, (t.started_ms - res.go_ms) / 1000)
        trail = max(0.0, res.wall_s - lead - t.wall_s)
        phases = (Phase(False, lead), *t.phases, Phase(False, trail))
        traces.append(dataclasses.replace(t, phases=phases, wall_s=res.wall_s))
    p = predict(traces, room=True)
    sources = sorted({"timed by each job" if t.cost.source == "given" else t.cost.source for t in traces})
    return SharedPrediction(p.makespan_s, p.switches, p.duty_cycle, "+".join(sources))
