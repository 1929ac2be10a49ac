"""``bench/gpu_check.py``'s duplex_jobs section (two job processes' suspend and resume, one after the other and at
the same instant) without a GPU: end to end on CPU tensors, its JSON and report lines, its sizes, its goal kept out of
the verdict, and its budget (not started when it does not fit, fewer reps when the next might not)."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from .helpers import run_text
from .test_gpu_check import _on_cpu, gc  # noqa: F401 - gc: the fixture, bench/gpu_check.py loaded

FIGURES = {
    "d2h_gbps",
    "h2d_gbps",
    "sequential_s",
    "concurrent_s",
    "concurrent_gbps",
    "concurrent_d2h_gbps",
    "concurrent_h2d_gbps",
    "overlap",
    "start_skew_ms",
    "start_skew_max_ms",
    "start_s",
}


@pytest.fixture(scope="module")
def dj(gc: ModuleType) -> ModuleType:  # noqa: F811 - the fixture imported above
    return importlib.import_module("_gpu_duplex_jobs")  # bench/ is on the path once gpu_check is loaded


def test_plan_sizes(gc: ModuleType) -> None:  # noqa: F811
    """8 GB per job (as the one-process duplex swap's 2 x 8 GB), 1 GB with --quick, 8 MB on CPU, or as asked."""
    assert gc.parse_args([]).plan.duplex_jobs_bytes == 8 * gc.GB
    assert gc.parse_args(["--quick"]).plan.duplex_jobs_bytes == gc.GB
    cpu = gc.parse_args(["--device", "cpu", "--only", "duplex_jobs", "--quick"])
    assert cpu.plan.duplex_jobs_bytes == pytest.approx(0.008 * gc.GB, rel=0.01) and cpu.sections == {"duplex_jobs"}
    asked = gc.parse_args(["--duplex-jobs-gb", "4", "--only", "duplex_jobs"]).plan.duplex_jobs_bytes
    assert asked == pytest.approx(4 * gc.GB, rel=1e-3) and asked % (4 * gc.N_TENSORS) == 0
    for bad in (["--duplex-jobs-gb", "0"], ["--device", "cpu", "--only", "duplex_jobs,duplex"]):
        with pytest.raises(SystemExit):
            gc.parse_args(bad)


def test_on_cpu_end_to_end(gc: ModuleType, tmp_path: Path) -> None:  # noqa: F811
    """The section through the check's command line on CPU tensors: two worker processes, its figures in the JSON,
    both states bit-exact, its lines in the report; no goal on CPU. On a GPU its goal shows, outside the verdict."""
    out = tmp_path / "dj.json"
    run = run_text(_on_cpu("duplex_jobs", out, "--quick"), timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    res = json.loads(out.read_text())
    assert res["verdict"] == "PASS" and res["errors"] == res["skipped"] == [] and res["done"] == ["duplex_jobs"]
    assert res["wall_s"] < res["budget_s"]
    d = res["duplex_jobs"]
    assert d["device"] == "cpu" and d["reps"] == d["reps_asked"] == 3 and d["cut"] is None
    assert d["bytes"] == pytest.approx(0.008 * gc.GB, rel=0.01) and d["host_memory"] == "cached"
    assert all(d[k] > 0 for k in FIGURES - {"start_skew_ms", "start_skew_max_ms"}), d
    assert 0 <= d["start_skew_ms"] <= d["start_skew_max_ms"]
    assert len(d["sequential_all_s"]) == len(d["concurrent_all_s"]) == 2 * d["reps"]
    assert d["overlap"] == pytest.approx(d["sequential_s"] / d["concurrent_s"])
    assert d["bit_exact"] is d["a_bit_exact"] is d["b_bit_exact"] is True
    assert "duplex across jobs, 2 processes x 0.008 GB on cpu (3 of 3 reps" in run.stdout
    assert "bit-exact B after its resume True, A after a final resume True" in run.stdout
    assert "goal duplex across jobs" not in run.stdout
    _goal_outside_the_verdict(gc, d)


def _goal_outside_the_verdict(gc: ModuleType, measured: dict[str, Any]) -> None:  # noqa: F811
    for overlap, said in ((1.2, "NOT met"), (1.8, "met")):
        rep = gc.Report(
            date="d",
            duplex_jobs={**measured, "device": "cuda", "overlap": overlap},
            sections=["duplex_jobs"],
            done=["duplex_jobs"],
            complete=True,
        )
        text = "\n".join(gc.format_report(rep))
        assert f"goal duplex across jobs: overlap {overlap:.2f}x, {said} (>= 1.6x; a measurement" in text
        assert rep.ok() and rep.verdict() == "PASS", rep.failures()


def test_not_started_when_the_budget_does_not_fit(gc: ModuleType, dj: ModuleType) -> None:  # noqa: F811
    """With less left than its estimate the section starts no process and says why; the check records it skipped
    (INCOMPLETE)."""
    nbytes = 8 << 20
    budget = gc.Budget(dj.need_s(nbytes) - 1)
    r = dj.duplex_jobs(nbytes, 3, "cpu", budget)
    assert r["bytes"] == nbytes and r["skipped"].startswith(f"it needs about {dj.need_s(nbytes):.0f} s")
    assert "--only duplex_jobs" in r["skipped"] and budget.elapsed() < 5  # no worker was started
    plan = dataclasses.replace(gc.Plan.make(quick=True), duplex_jobs_bytes=nbytes)
    rep = gc.run(plan, {"duplex_jobs"}, "cpu", budget=gc.Budget(dj.need_s(nbytes) - 1))
    (skip,) = rep.skipped
    assert skip.startswith("duplex_jobs: not run, it needs about") and rep.duplex_jobs == {}
    assert rep.verdict() == "INCOMPLETE"


def test_fewer_reps_when_the_next_might_not_fit(gc: ModuleType, dj: ModuleType) -> None:  # noqa: F811
    """On a budget whose clock runs fast, the section stops its reps while the final switch and checks still fit,
    says so, and its figures and checks are whole."""
    tick = itertools.count(0.0, 0.25)  # every look at the budget's clock: a quarter second later
    budget = gc.Budget(dj.need_s(8 << 20) + 10, clock=lambda: next(tick))
    r = dj.duplex_jobs(8 << 20, 50, "cpu", budget)
    assert 1 <= r["reps"] < 50 and r["cut"].startswith(f"{r['reps']} of 50 reps: the next might not fit")
    assert budget.left() > 0 and r["bit_exact"] is True
    assert len(r["sequential_all_s"]) == 2 * r["reps"] and r["overlap"] > 0
