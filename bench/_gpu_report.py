"""What ``bench/gpu_check.py`` measured (``Report``, written as JSON) and how it reads (``format_report``),
apart from the check itself so that ``bench/_report.py`` can render a stored run without loading it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["DUPLEX_JOBS_GOAL", "GB", "GOAL", "SWITCH_GOAL_MS", "Report", "format_report"]

GB = 1_000_000_000
GOAL = 0.8  # torch offload vs the same-run pinned copy, each way (issue 7)
SWITCH_GOAL_MS = 5.0  # a switch adds at most this beyond the handler calls (issue 3)
# two jobs' copies overlap at least this much (sequential / concurrent; one process's duplex swap reached 1.75x on
# the H200): reported, not in the verdict, as it measures the hardware (issue 27)
DUPLEX_JOBS_GOAL = 1.6


@dataclass
class Report:
    """Everything measured; ``errors`` lists failed checks, ``skipped`` what could not run and why. The check
    saves it after every section: ``sections`` (asked for, in order), ``done``, ``next_section`` (the one that runs
    next, None once through) and ``complete`` say how far a run got, also one killed mid-way."""

    date: str = ""
    command: str = ""
    plan: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, Any] = field(default_factory=dict)
    offload: list[dict[str, Any]] = field(default_factory=list)
    duplex: dict[str, Any] = field(default_factory=dict)
    cuda: dict[str, Any] = field(default_factory=dict)
    switch: dict[str, Any] = field(default_factory=dict)
    pinned: dict[str, Any] = field(default_factory=dict)
    precopy: dict[str, Any] = field(default_factory=dict)
    duplex_jobs: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    budget_s: float | None = None
    sections: list[str] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    next_section: str | None = None
    complete: bool = False

    def goals(self) -> list[tuple[str, float, bool]]:
        """(what, ratio, met) for torch offload vs the pinned copy baseline, each way and size."""
        out = []
        for r in self.offload:
            for k, base in (("offload", "d2h_gbps"), ("restore", "h2d_gbps")):
                if r.get(f"{k}_gbps") and self.baseline.get(base):
                    ratio = r[f"{k}_gbps"] / self.baseline[base]
                    out.append((f"{k} {r['bytes'] / GB:g} GB", ratio, ratio >= GOAL))
        return out

    def switch_goals(self) -> list[tuple[str, float, bool]]:
        """(what, median overhead in ms, met) for the switch section's sizes."""
        return [
            (f"{r['gib']:g} GiB", r["overhead_ms"], r["overhead_ms"] <= SWITCH_GOAL_MS)
            for r in self.switch.get("sizes", ())
            if r.get("overhead_ms") is not None
        ]

    def duplex_jobs_goal(self) -> tuple[float, bool] | None:
        """(overlap ratio, met) of the duplex_jobs section on a GPU (None on CPU or not run): not in the verdict."""
        d = self.duplex_jobs
        if d.get("device") != "cuda" or not d.get("overlap"):
            return None
        return d["overlap"], d["overlap"] >= DUPLEX_JOBS_GOAL

    def cuda_failure(self) -> str | None:
        """Why the cuda section fails the verdict: the backend refused, or is unavailable, on this GPU machine (the
        section runs only where torch sees CUDA, so either means the agent's cuda backend does not work here)."""
        c = self.cuda
        if not c.get("refused"):
            return None
        what = "unavailable" if c.get("unavailable") else "refused"
        on = self.env.get("device") or "this GPU machine"
        return (
            f"cuda backend {what} on {on}: {c['refused']} (the agent could not checkpoint a job there: fix "
            "that, or leave the section out with --only and say why)"
        )

    def failures(self) -> list[str]:
        """Every reason the run is not ok: errors, the cuda backend, goals not met, sections not run."""
        goals = [f"goal {w} not met" for w, _, met in self.goals() if not met]
        goals += [f"goal switch overhead {w} not met" for w, _, met in self.switch_goals() if not met]
        cuda = self.cuda_failure()
        return [*self.errors, *([cuda] if cuda else []), *goals, *(f"skipped: {s}" for s in self.skipped)]

    def ok(self) -> bool:
        return not self.failures()

    def verdict(self) -> str:
        """NOT RUN (nothing could run), RUNNING (saved mid-way), INCOMPLETE (sections skipped), FAIL or PASS."""
        if self.skipped and not self.done:
            return "NOT RUN"
        if self.next_section is not None and not self.complete:
            return "RUNNING"
        if self.skipped:
            return "INCOMPLETE"
        return "PASS" if self.ok() else "FAIL"

    def as_json(self) -> dict[str, Any]:
        """The report as the check writes it, with its verdict and the reasons it is not ok."""
        return {**asdict(self), "verdict": self.verdict(), "not_ok": self.failures()}


def _fmt_gbps(x: float | None) -> str:
    return f"{x:6.2f} GB/s" if x else "   n/a"


def format_report(rep: Report) -> list[str]:
    """The human-readable lines of a report (printed at the end; sections also print as they finish)."""
    lines = [f"gpu_check {rep.date}; plan {rep.plan}"]
    e = rep.env
    if e:
        lines.append(
            f"  device {e.get('device')}, driver {e.get('driver')}, torch {e.get('torch')}, "
            f"cuda-python {e.get('cuda_python')}, nvml {e.get('nvml')}, nats-server {e.get('nats_server')}"
        )
        if "agent" in e:
            lines.append(f"  the node agent runs {e['agent']}")
    b = rep.baseline
    if b:
        lines.append(
            f"baseline (plain torch copies, pinned host buffer, {b['bytes'] / GB:g} GB, median of "
            f"{b['reps']}): device->host {_fmt_gbps(b['d2h_gbps'])}, host->device {_fmt_gbps(b['h2d_gbps'])},"
            f" both at once {_fmt_gbps(b.get('duplex_gbps'))} total"
        )
    for r in rep.offload:
        lines.append(
            f"offload {r['bytes'] / GB:g} GB through the stack ({r['cycles']} cycles, medians): "
            f"snapshot {_fmt_gbps(r.get('offload_gbps'))}, restore {_fmt_gbps(r.get('restore_gbps'))}; "
            f"bit-exact {r.get('bit_exact')}, same tensors {r.get('same_tensors')}"
        )
        lines.append(
            f"  device memory of job A: torch allocated {r.get('torch_before', 0) / GB:.2f} -> "
            f"{r.get('torch_suspended', 0) / GB:.2f} -> {r.get('torch_resumed', 0) / GB:.2f} GB; NVML "
            f"{_gb(r.get('nvml_before'))} -> {_gb(r.get('nvml_suspended'))} -> {_gb(r.get('nvml_resumed'))}"
            f" GB; A's release -> A's next grant (two switches) {r.get('round_trip_ms', float('nan')):.0f} ms"
        )
    d = rep.duplex
    if d:
        lines.append(
            f"duplex swap, 2 x {d['bytes'] / GB:g} GB on one GPU: sequential {d['sequential_s'] * 1e3:.0f} ms,"
            f" overlapped {d['overlapped_s'] * 1e3:.0f} ms ({d['speedup']:.2f}x; chosen automatically: "
            f"{d['auto_overlap']}); bit-exact {d['bit_exact']}"
        )
    c = rep.cuda
    if c:
        if c.get("refused"):
            lines.append(f"cuda backend: {'UNAVAILABLE' if c.get('unavailable') else 'REFUSED'}: {c['refused']}")
        else:
            lines.append(
                f"cuda backend on a process holding {c['bytes'] / GB:g} GB: snapshot {c['snapshot_s']:.2f} s "
                f"(freed {_gb(c.get('device_bytes_freed'))} GB by NVML), restore {c['restore_s']:.2f} s; "
                f"NVML {_gb(c.get('nvml_before'))} -> {_gb(c.get('nvml_checkpointed'))} -> "
                f"{_gb(c.get('nvml_restored'))} GB; data intact {c.get('intact')}"
            )
    sw = rep.switch
    if sw:
        floor = sw.get("floor_p50_ms")
        lines.append(
            f"switch through the stack (`{sw['command']}`; the node agent runs {sw['agent']}; {sw['cycles']} "
            f"cycles, medians; same-run floor p50 " + (f"{floor:.2f} ms)" if floor else "not measured)")
        )
        for r in sw.get("sizes", ()):
            lines.append(
                f"  {r['gib']:g} GiB: overhead {r['overhead_ms']:.2f} ms (A->B {r['overhead_ab_ms']:.2f}, "
                f"B->A {r['overhead_ba_ms']:.2f}, max {r['overhead_max_ms']:.2f}; agent-side "
                f"{r['agent_side_ms']:.2f}, orchestrator+bus {r['orchestrator_bus_ms']:.2f}); offload "
                f"{r['offload_vs_copy']:.2f}x, restore {r['restore_vs_copy']:.2f}x the same-run copy"
            )
    pn = rep.pinned
    if pn:
        lines.append(
            f"host buffers of the handler, {pn['bytes'] / GB:g} GB state, {pn['cycles']} cycles (later "
            f"cycles' medians; bit-exact {pn['bit_exact']}):"
        )
        for kind in ("registered", "registered_per_switch", "cached"):
            k = pn.get(kind) or {}
            if k:
                lines.append(
                    f"  {kind:21s} (in use: {k['in_use']}): suspend {_fmt_gbps(k['offload_gbps'])}, resume "
                    f"{_fmt_gbps(k['restore_gbps'])}; first cycle {k['first_offload_s']:.2f} + "
                    f"{k['first_restore_s']:.2f} s; one buffer: allocate {k['alloc_s']:.2f} s, release "
                    f"{k['release_s']:.2f} s; peak pinned {_gb(k['peak_pinned_bytes'])} GB; held after the "
                    f"last resume {_gb(k['host_bytes_after'])} GB (RSS +{_gb(k['rss_growth_after'])} GB)"
                )
    pc = rep.precopy
    if pc:
        lines.append(f"pre-copy while idle (`{pc['command']}`; {pc['gib']:g} GiB, {pc['cycles']} cycles, medians):")
        for order, o in pc["orders"].items():
            lines.append(
                f"  {order}: B's acquire {o['copy_ms']:.1f} ms with the copy at the switch, {o['precopied_ms']:.1f} ms "
                f"after A's idle copy ({o['ratio']:.2f}x; the idle copy took {o['idle_copy_ms']:.1f} ms)"
            )
    dj = rep.duplex_jobs
    if dj:
        lines.append(
            f"duplex across jobs, 2 processes x {dj['bytes'] / GB:.3g} GB on {dj['device']} ({dj['reps']} of "
            f"{dj['reps_asked']} reps, medians; host memory {dj['host_memory']}): alone device->host "
            f"{_fmt_gbps(dj['d2h_gbps'])}, host->device {_fmt_gbps(dj['h2d_gbps'])}; concurrent "
            f"{_fmt_gbps(dj['concurrent_d2h_gbps'])} + {_fmt_gbps(dj['concurrent_h2d_gbps'])}, "
            f"{_fmt_gbps(dj['concurrent_gbps'])} together"
        )
        lines.append(
            f"  sequential {dj['sequential_s'] * 1e3:.1f} ms, concurrent {dj['concurrent_s'] * 1e3:.1f} ms: overlap "
            f"{dj['overlap']:.2f}x (2.0 = full duplex); starts apart {dj['start_skew_ms']:.2f} ms (max "
            f"{dj['start_skew_max_ms']:.2f}); bit-exact B after its resume {dj['b_bit_exact']}, A after a final "
            f"resume {dj['a_bit_exact']}" + (f"; cut: {dj['cut']}" if dj.get("cut") else "")
        )
    for what, ratio, met in rep.goals():
        lines.append(f"goal {what}: {ratio:.0%} of the pinned copy, {'met' if met else 'NOT met'} (>= {GOAL:.0%})")
    for what, ms, met in rep.switch_goals():
        lines.append(
            f"goal switch overhead {what}: {ms:.2f} ms, {'met' if met else 'NOT met'} (<= {SWITCH_GOAL_MS:g} ms)"
        )
    if (dg := rep.duplex_jobs_goal()) is not None:
        lines.append(
            f"goal duplex across jobs: overlap {dg[0]:.2f}x, {'met' if dg[1] else 'NOT met'} (>= "
            f"{DUPLEX_JOBS_GOAL:g}x; a measurement of the hardware, not in the verdict)"
        )
    for s in rep.skipped:
        lines.append(f"skipped: {s}")
    cuda = rep.cuda_failure()
    for err in [*rep.errors, *([cuda] if cuda else [])]:
        lines.append(f"ERROR: {err}")
    if rep.next_section is not None and not rep.complete:
        lines.append(
            f"not complete: saved before section {rep.next_section!r} (done: {', '.join(rep.done) or 'none'})"
            " - a run killed there leaves this"
        )
    budget = f" of a {rep.budget_s:.0f} s budget" if rep.budget_s else ""
    lines.append(f"{rep.verdict()}; wall time {rep.wall_s:.0f} s{budget}")
    return lines


def _gb(x: float | None) -> str:
    return f"{x / GB:.2f}" if x is not None else "n/a"
