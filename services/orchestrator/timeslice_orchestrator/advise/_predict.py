"""Predict the shared run of recorded jobs: simulate them on one group through the core, and read the figures off
the simulated run's log."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .._errors import AdviseError
from ._model import JobOutcome, JobTrace, Prediction
from ._simulate import Log, simulate

__all__ = ["predict"]


def predict(traces: Sequence[JobTrace], *, hop_s: float = 0.001, room: bool = False) -> Prediction:
    """The jobs of ``traces`` started together on one group (see ``_simulate`` for the model): makespan, duty cycle,
    switches and each job's wall time, beside the same jobs back to back. ``hop_s``: one bus pass; ``room``: the node
    fits two contexts at once (a restore runs beside the snapshot it follows, and the core grants on it)."""
    if len({t.job for t in traces}) != len(traces) or len(traces) < 2:
        raise AdviseError("a prediction takes two jobs or more, each once")
    run = simulate(
        {t.job: t.phases for t in traces},
        {t.job: t.cost for t in traces},
        hop_s=hop_s,
        room=room,
        priorities={t.job: t.priority for t in traces},
    )
    outcomes, switches = _outcomes(run.log, traces)
    makespan = max(o.shared_s for o in outcomes)
    held = sum(o.held_s for o in outcomes)
    alone_wall = sum(t.wall_s for t in traces)
    notes = [
        f"switch costs of {t.job}: none measured in the window and none given, so its switches are taken as "
        "free (give --snapshot-s/--restore-s, or read a window where it was switched)"
        for t in traces
        if t.cost.source == "none"
    ]
    return Prediction(
        jobs=outcomes,
        makespan_s=makespan,
        back_to_back_s=alone_wall,
        duty_cycle=held / makespan if makespan > 0 else 0.0,
        alone_duty_cycle=sum(t.held_s for t in traces) / alone_wall if alone_wall > 0 else 0.0,
        switches=len(switches),
        switching_s=sum(switches),
        switch_median_s=statistics.median(switches) if switches else 0.0,
        hop_s=hop_s,
        room=room,
        events=run.events,
        notes=notes,
    )


def _outcomes(log: Log, traces: Sequence[JobTrace]) -> tuple[list[JobOutcome], list[float]]:
    """Each job's figures, and for every grant that followed another job's release the time the group stood idle
    between them (from that release, or the grantee's acquire if later)."""
    outcomes: list[JobOutcome] = []
    grants: list[tuple[float, str, float]] = []  # (grant time, job, its acquire time)
    releases: list[tuple[float, str]] = []
    for t in traces:
        held = waited = 0.0
        asked = end = 0.0
        granted: float | None = None
        for kind, at in log[t.job]:
            if kind == "acquire":
                asked = at
            elif kind == "grant":
                granted = at
                waited += at - asked
                grants.append((at, t.job, asked))
            elif kind == "release" and granted is not None:
                held += at - granted
                releases.append((at, t.job))
                granted = None
            elif kind == "end":
                end = at
        outcomes.append(
            JobOutcome(job=t.job, alone_s=t.wall_s, shared_s=end, held_s=held, waited_s=waited, switched_in=0)
        )
    releases.sort()
    switches: list[float] = []
    switched_in = dict.fromkeys((t.job for t in traces), 0)
    last: tuple[float, str] | None = None
    ri = 0
    for at, job, asked in sorted(grants):
        while ri < len(releases) and releases[ri][0] <= at:
            last = releases[ri]
            ri += 1
        if last is not None and last[1] != job:
            switches.append(at - max(last[0], asked))
            switched_in[job] += 1
    outcomes = [JobOutcome(o.job, o.alone_s, o.shared_s, o.held_s, o.waited_s, switched_in[o.job]) for o in outcomes]
    return outcomes, switches
