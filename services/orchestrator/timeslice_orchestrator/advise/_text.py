"""A prediction as a person reads it in a terminal."""

from __future__ import annotations

from collections.abc import Sequence

from ._model import JobTrace, Prediction

__all__ = ["render_prediction"]


def render_prediction(p: Prediction, traces: Sequence[JobTrace]) -> str:
    lines = ["recorded runs (each job alone):"]
    w = max(len(t.job) for t in traces)
    for t in traces:
        c = t.cost
        cost = f"switch: snapshot {c.snapshot_s * 1000:.1f} ms, restore {c.restore_s * 1000:.1f} ms ({c.source}" + (
            f", {c.samples} ops)" if c.samples else ")"
        )
        duty = t.held_s / t.wall_s if t.wall_s > 0 else 0.0
        lines.append(
            f"  {t.job:<{w}}  group {t.group}: {t.wall_s:.2f} s, {t.holds} holds, "
            f"{t.held_s:.2f} s held ({duty:.0%}); {cost}" + (f"; asks at class {t.priority}" if t.priority else "")
        )
    lines.append(
        f"predicted: the {len(traces)} jobs sharing one group (started together; "
        f"{'room for two contexts: restores beside snapshots' if p.room else 'snapshot, then restore'}; "
        f"bus pass {p.hop_s * 1000:g} ms):"
    )
    for o in p.jobs:
        lines.append(
            f"  {o.job:<{w}}  {o.shared_s:.2f} s ({o.shared_s / o.alone_s:.2f}x alone), waited "
            f"{o.waited_s:.2f} s, switched in {o.switched_in} times"
            if o.alone_s > 0
            else f"  {o.job:<{w}}  {o.shared_s:.2f} s"
        )
    lines.append(
        f"  makespan {p.makespan_s:.2f} s vs back to back {p.back_to_back_s:.2f} s: "
        f"{p.makespan_s / p.back_to_back_s:.2f}x ({p.speedup:.2f}x faster)"
        if p.back_to_back_s > 0
        else f"  makespan {p.makespan_s:.2f} s"
    )
    lines.append(
        f"  group duty cycle {p.duty_cycle:.0%} (alone {p.alone_duty_cycle:.0%}); {p.switches} switches, "
        f"{p.switching_s:.2f} s idle between holds (median {p.switch_median_s * 1000:.1f} ms)"
    )
    lines.extend(f"note: {n}" for n in p.notes)
    return "\n".join(lines) + "\n"
