"""The summary figures of a replay: per group and per job, over the window ``[since, until]``."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from ._model import GroupSummary, GroupTimeline, JobLane, JobSummary, OpBar, PhaseSpan, Summary

__all__ = ["clipped", "quantile", "summarize"]


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) with linear interpolation between the order statistics; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def clipped(start: int, end: int | None, since: int, until: int) -> int:
    """Milliseconds of ``[start, end)`` (``end`` None: still open at ``until``) inside ``[since, until]``."""
    stop = until if end is None else min(end, until)
    return max(0, stop - max(start, since))


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _op_figures(ops: Sequence[OpBar]) -> tuple[float | None, float | None]:
    """Median duration (ms) and median throughput (GB/s, over operations that moved bytes, by the time the
    bytes took: see ``OpBar.copy_ms``) of ``ops``."""
    durations = [d for o in ops if o.ok and (d := o.duration_ms) is not None]
    rates = [o.bytes / (d / 1000) / 1e9 for o in ops if o.ok and o.bytes > 0 and (d := o.copy_ms)]
    return _median(durations), _median(rates)


def _group_summary(tl: GroupTimeline, ops: Sequence[OpBar], since: int, until: int) -> GroupSummary:
    window = max(0, until - since)
    held = sum(clipped(h.start_ms, h.end_ms, since, until) for h in tl.holds)
    grants = [h for h in tl.holds if since <= h.start_ms <= until]
    waits = [float(h.waited_ms) for h in grants]
    in_window = [o for o in ops if o.end_ms is not None and since <= o.end_ms <= until]
    snap_ms, snap_gbps = _op_figures([o for o in in_window if o.kind == "snapshot"])
    rest_ms, rest_gbps = _op_figures([o for o in in_window if o.kind == "restore"])
    handoffs = [h for h in tl.handoffs if since <= h.granted_ms <= until]
    return GroupSummary(
        duty_cycle=held / window if window else 0.0,
        switches=sum(1 for s in tl.switches if since <= s.start_ms <= until),
        handoffs=len(handoffs),
        wait_p50_ms=quantile(waits, 0.5),
        wait_p95_ms=quantile(waits, 0.95),
        snapshot_p50_ms=snap_ms,
        restore_p50_ms=rest_ms,
        snapshot_gbps=snap_gbps,
        restore_gbps=rest_gbps,
        faults=sum(1 for f in tl.faults if since <= f.ts_ms <= until),
        lease_expiries=sum(
            1 for h in tl.holds if h.end_ms is not None and since <= h.end_ms <= until and h.end != "released"
        ),
        window_ms=window,
        grants=len(grants),
        handoff_p50_ms=_median([float(h.ms) for h in handoffs]),
        yield_requests=sum(
            1 for h in tl.holds if h.yield_requested_ms is not None and since <= h.yield_requested_ms <= until
        ),
        min_holds_kept=sum(1 for m in tl.min_holds if since <= m.start_ms <= until),
        min_holds_reacquired=sum(1 for m in tl.min_holds if since <= m.start_ms <= until and m.outcome == "reacquired"),
        fair_share_choices=sum(1 for c in tl.fair_shares if since <= c.ts_ms <= until),
        predictions=sum(1 for p in tl.predictions if since <= p.ts_ms <= until),
        predictions_hit=sum(1 for p in tl.predictions if since <= p.ts_ms <= until and p.outcome == "hit"),
    )


def summarize(
    groups: Mapping[str, GroupTimeline],
    lanes: Mapping[tuple[str, str], JobLane],
    phases: Mapping[str, Sequence[PhaseSpan]],
    since: int,
    until: int,
) -> Summary:
    out = Summary(since_ms=since, until_ms=until)
    for g, tl in groups.items():
        ops = [o for lane in lanes.values() if lane.group == g for o in lane.ops]
        out.groups[g] = _group_summary(tl, ops, since, until)

    def job(name: str) -> JobSummary:
        js = out.jobs.get(name)
        if js is None:
            js = out.jobs[name] = JobSummary(held_ms=0.0, waited_ms=0.0)
        return js

    for tl in groups.values():
        for h in tl.holds:
            js = job(h.job)
            js.held_ms += clipped(h.start_ms, h.end_ms, since, until)
            js.grants += since <= h.start_ms <= until
        for w in tl.waits:
            job(w.job).waited_ms += clipped(w.start_ms, w.end_ms, since, until)
    for name, spans in phases.items():
        js = job(name)
        for p in spans:
            js.phase_ms[p.name] = js.phase_ms.get(p.name, 0.0) + clipped(p.start_ms, p.end_ms, since, until)
    out.jobs = dict(sorted(out.jobs.items()))
    return out
