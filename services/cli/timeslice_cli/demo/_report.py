"""The demo's report: wall time shared vs back to back, the lock's figures (from ``timeslice replay``
folding the run's window of the stream), the offloads the jobs saw, and the bit-identity check of
every job's final weights against its solo run."""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._runner import JobResult, RunResult

__all__ = ["DemoReport", "Identity", "JobFigures", "LockFigures", "lock_figures", "weights_identical"]

GOAL_RATIO = 0.8  # shared wall time must be below this share of back to back (the target)


@dataclass(frozen=True, slots=True)
class LockFigures:
    """One run's group, as the replay rebuilds it from the stream (``None``: nothing to measure)."""

    group: str
    window_ms: int
    duty_cycle: float
    grants: int
    switches: int
    handoffs: int
    handoff_p50_ms: float | None
    wait_p50_ms: float | None
    wait_p95_ms: float | None
    snapshot_p50_ms: float | None
    restore_p50_ms: float | None
    snapshot_gbps: float | None
    restore_gbps: float | None
    faults: int
    violations: int
    fault_reasons: list[str] = field(default_factory=list)  # "job: reason", as the stream recorded them


async def lock_figures(nats_url: str, jobs: list[JobResult], html: Path | None = None) -> LockFigures:
    """Fold the window of the stream in which ``jobs`` (one group) ran through the orchestrator's core
    (``timeslice replay``); write the HTML timeline of it to ``html`` when given."""
    from timeslice_orchestrator.replay import fold_events, read_window, write_html

    group = jobs[0].group
    since, until = min(j.go_ms for j in jobs), max(j.done_ms for j in jobs)
    events = await read_window(nats_url, group=group, since_ms=since, until_ms=until)
    replay = fold_events(events, group=group, since_ms=since, until_ms=until)
    if html is not None:
        await asyncio.to_thread(write_html, replay, html)
    g = replay.summary.groups[group]
    return LockFigures(
        group,
        g.window_ms,
        g.duty_cycle,
        g.grants,
        g.switches,
        g.handoffs,
        g.handoff_p50_ms,
        g.wait_p50_ms,
        g.wait_p95_ms,
        g.snapshot_p50_ms,
        g.restore_p50_ms,
        g.snapshot_gbps,
        g.restore_gbps,
        g.faults,
        len(replay.violations),
        [f"{f.job}: {f.reason}" for f in replay.groups[group].faults],
    )


def weights_identical(a: Path, b: Path) -> bool:
    """Both files hold the same arrays (names, dtypes, shapes) with the same bytes."""
    with np.load(a) as fa, np.load(b) as fb:
        if sorted(fa.files) != sorted(fb.files):
            return False
        for name in fa.files:
            x, y = fa[name], fb[name]
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return False
    return True


@dataclass(frozen=True, slots=True)
class Identity:
    job: str
    solo_sha256: str
    shared_sha256: str
    identical: bool  # compared array by array, byte for byte (the hashes agree too when this holds)


@dataclass(frozen=True, slots=True)
class JobFigures:
    """What one job saw in one run."""

    job: str
    run: str
    loop_s: float
    final_reward: float
    suspends: int
    resumes: int
    suspend_p50_ms: float | None  # the job's own handler time, per call
    resume_p50_ms: float | None
    bytes_per_offload: int  # the most one suspend moved (0: never suspended)
    backend: str  # the model the job ran
    torch_importable: bool  # whether the job's interpreter could import torch at all


def job_figures(run: RunResult) -> list[JobFigures]:
    out = []
    for job, r in run.jobs.items():
        assert r.done is not None and r.built is not None
        sus = [o.elapsed_ms for o in r.offloads if o.action == "suspend"]
        res = [o.elapsed_ms for o in r.offloads if o.action == "resume"]
        moved = [o.bytes_moved for o in r.offloads if o.action == "suspend"]
        out.append(
            JobFigures(
                job,
                run.label,
                r.done.loop_s,
                r.done.final_reward,
                r.done.suspends,
                r.done.resumes,
                statistics.median(sus) if sus else None,
                statistics.median(res) if res else None,
                max(moved, default=0),
                r.built.backend,
                r.built.torch_available,
            )
        )
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def _gbps(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} GB/s"


@dataclass(slots=True)
class DemoReport:
    backend: str
    backend_why: str
    jobs: int
    steps: int
    reward_latency_ms: float
    workdir: str
    solo: list[JobFigures]
    back_to_back_s: float
    shared: list[JobFigures] = field(default_factory=list)
    shared_s: float | None = None
    shared_lock: LockFigures | None = None
    solo_lock: list[LockFigures] = field(default_factory=list)
    identity: list[Identity] = field(default_factory=list)
    html: str | None = None
    predicted_shared_s: float | None = None  # ``timeslice advise``'s prediction from the solo runs (demo/_predict.py)
    predicted_switch_costs: str = ""  # where its switch costs came from: measured, given, none
    prediction_error: str | None = None  # why there is no prediction

    @property
    def prediction_ratio(self) -> float | None:
        """Predicted over measured shared wall time."""
        if self.predicted_shared_s is None or not self.shared_s:
            return None
        return self.predicted_shared_s / self.shared_s

    @property
    def ratio(self) -> float | None:
        return None if self.shared_s is None or self.back_to_back_s <= 0 else self.shared_s / self.back_to_back_s

    @property
    def identical(self) -> bool:
        return all(i.identical for i in self.identity)

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "ratio": self.ratio,
            "all_identical": self.identical,
            "prediction_ratio": self.prediction_ratio,
        }

    def render(self) -> str:
        moved = max((f.bytes_per_offload for f in self.shared), default=0)
        size = f", {moved / 1e6:.1f} MB of weights + optimizer state moved per switch" if moved else ""
        lines = [
            "",
            f"timeslice demo: {self.jobs} GRPO jobs x {self.steps} steps, {self.backend} model "
            f"({self.backend_why}){size}",
            f"  reward phase = CPU verifier + {self.reward_latency_ms:.0f} ms modelled remote reward-service latency",
            "",
            "wall time (from go to the final checkpoint; process start-up not counted)",
        ]
        for f in self.solo:
            lines.append(f"  solo    {f.job:<8} {f.loop_s:7.2f} s   final reward {f.final_reward:.3f}")
        lines.append(f"  back to back      {self.back_to_back_s:7.2f} s")
        if self.shared_s is not None and self.ratio is not None:
            verdict = "meets" if self.ratio < GOAL_RATIO else "MISSES"
            lines.append(
                f"  shared            {self.shared_s:7.2f} s   = {self.ratio:.2f} x back to back "
                f"({verdict} the < {GOAL_RATIO} goal)"
            )
        if self.predicted_shared_s is not None:
            vs = f" = {self.prediction_ratio:.2f} x measured" if self.prediction_ratio is not None else ""
            lines.append(
                f"  predicted shared  {self.predicted_shared_s:7.2f} s{vs} (timeslice advise, from the solo "
                f"runs; switch costs: {self.predicted_switch_costs})"
            )
        elif self.prediction_error:
            lines.append(f"  no prediction: {self.prediction_error}")
        if self.shared_lock is not None:
            g = self.shared_lock
            solo_duty = [s.duty_cycle for s in self.solo_lock]
            solo_txt = f" (solo: {statistics.mean(solo_duty):.0%} held)" if solo_duty else ""
            lines += [
                "",
                f"accelerator lock (group {g.group}, from the stream via timeslice replay)",
                f"  duty cycle {g.duty_cycle:.0%} held{solo_txt}; {g.grants} grants, {g.switches} switches, "
                f"{g.handoffs} handoffs (p50 {_ms(g.handoff_p50_ms)} release → next grant)",
                f"  waits p50 {_ms(g.wait_p50_ms)}, p95 {_ms(g.wait_p95_ms)}; faults {g.faults}; "
                f"invariant violations {g.violations}",
                *(f"    fault: {r}" for r in g.fault_reasons),
                f"  snapshot p50 {_ms(g.snapshot_p50_ms)} at {_gbps(g.snapshot_gbps)}, "
                f"restore p50 {_ms(g.restore_p50_ms)} at {_gbps(g.restore_gbps)} (agent-measured)",
            ]
        elif self.solo_lock:
            lines += ["", "accelerator lock, each job alone (from the stream via timeslice replay)"]
            for f, g in zip(self.solo, self.solo_lock, strict=True):
                lines.append(
                    f"  {f.job:<8} duty cycle {g.duty_cycle:.0%} held, {g.grants} grants, {g.switches} switches"
                )
        if self.shared:
            lines.append("  state moved, as each job saw it (its handler's own time per call):")
            for f in self.shared:
                lines.append(
                    f"    {f.job:<8} out {f.suspends:>3}x (p50 {_ms(f.suspend_p50_ms)}), "
                    f"in {f.resumes:>3}x (p50 {_ms(f.resume_p50_ms)}), "
                    f"{f.bytes_per_offload / 1e6:.1f} MB each"
                )
        if self.identity:
            lines += ["", "final weights + optimizer state, shared run vs solo run"]
            for i in self.identity:
                verdict = "bit-identical" if i.identical else "DIFFERENT"
                lines.append(f"  {i.job:<8} {verdict}  sha256 {i.shared_sha256[:16]}… (solo {i.solo_sha256[:16]}…)")
        lines.append("")
        if self.html:
            lines.append(f"timeline: {self.html}")
        lines.append(f"work directory (weights, job logs): {self.workdir}")
        return "\n".join(lines) + "\n"
