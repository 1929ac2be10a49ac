"""``timeslice demo`` end to end (short runs: the figures are in docs/benchmarks.md, not asserted here):
real nats-server, orchestrator and agent, real job processes training for 3 steps, solo back to back and
then shared. Asserted: the report and the HTML timeline are produced, every switch moved the jobs' state
out and back, and each job's final weights in the shared run are bit-identical to its solo run, with
torch and with numpy in interpreters where torch cannot be imported. Plus the demo's pure parts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from timeslice_cli.demo import _messages as m
from timeslice_cli.demo._progress import Progress
from timeslice_cli.demo._report import weights_identical
from timeslice_cli.demo._task import Batch, SortTask, edit_distance

from .helpers import run_text

# Compares wall-clock runs (shared against solo or predicted): one CI worker runs these modules one after another
# (``--dist loadgroup``), so they never load the 2 cores against each other.
pytestmark = pytest.mark.xdist_group("wall_clock")

ROOT = Path(__file__).resolve().parents[1]
# Short and small: 3 steps of a narrow model with a short modelled reward latency.
SHORT = ["--jobs", "2", "--steps", "3", "--hidden", "256", "--reward-latency-ms", "50"]


def run_demo(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    workdir, report = tmp_path / "demo", tmp_path / "report.json"
    proc = run_text(
        [sys.executable, "-m", "timeslice_cli", "demo", *SHORT, "--workdir", str(workdir), "-o", str(report), *extra],
        timeout=150,
        env=env,
    )
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(report.read_text()), proc.stdout


def check_report(rep: dict[str, Any], out: str, backend: str) -> None:
    assert rep["backend"] == backend
    assert [f["job"] for f in rep["solo"]] == ["job-1", "job-2"]
    assert all(f["backend"] == backend for f in rep["solo"] + rep["shared"])
    assert rep["back_to_back_s"] > 0 and rep["shared_s"] > 0 and rep["ratio"] is not None
    # Each job's weights after sharing the accelerator are those of its solo run, bit for bit.
    assert [i["job"] for i in rep["identity"]] == ["job-1", "job-2"]
    assert all(i["identical"] and i["solo_sha256"] == i["shared_sha256"] for i in rep["identity"]), rep["identity"]
    assert rep["all_identical"] is True
    # Solo: nobody waited, so the state never moved; shared: every job was moved out and back in.
    assert all(f["suspends"] == 0 and f["resumes"] == 0 for f in rep["solo"])
    for f in rep["shared"]:
        assert f["resumes"] >= 1 and f["suspends"] >= f["resumes"] and f["bytes_per_offload"] > 0, f
    lock = rep["shared_lock"]
    assert lock["group"] == "demo-shared" and lock["handoffs"] >= 2 and lock["violations"] == 0
    assert lock["faults"] == 0, lock["fault_reasons"]
    assert lock["snapshot_p50_ms"] is not None and lock["restore_p50_ms"] is not None
    assert 0 < lock["duty_cycle"] <= 1
    assert len(rep["solo_lock"]) == 2
    # timeslice advise predicted the shared run from the solo runs, before it ran (its accuracy: test_advise_demo.py)
    assert rep["predicted_shared_s"] > 0 and rep["predicted_switch_costs"] == "timed by each job", rep
    assert "predicted shared" in out
    html = Path(rep["html"])
    assert html.is_file() and "<html" in html.read_text(errors="replace")[:2000].lower()
    assert "bit-identical" in out and "back to back" in out and f"timeline: {html}" in out


def test_demo_torch_short_run(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    rep, out = run_demo(tmp_path, "--torch")
    check_report(rep, out, "torch")
    assert all(f["torch_importable"] for f in rep["shared"])


def test_demo_numpy_runs_where_torch_cannot_be_imported(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    # Every interpreter of the demo (runner, agent, jobs) starts with torch made unimportable.
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    rep, out = run_demo(tmp_path, env=env)  # no --numpy: the demo must notice torch is missing
    check_report(rep, out, "numpy")
    assert "torch is not installed" in rep["backend_why"]
    assert not any(f["torch_importable"] for f in rep["solo"] + rep["shared"])


# --------------------------------------------------------------------------- the pure parts


def test_verifier_scores_by_edit_distance_to_the_sorted_prompt() -> None:
    assert edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert edit_distance([3, 1, 2], [1, 2, 3]) == 2
    assert edit_distance([], [4, 4]) == 2
    task = SortTask(length=3, prompts=1, group=2)
    prompts = np.array([[3, 1, 2], [3, 1, 2]])
    rewards = task.verify(Batch(prompts, np.array([[1, 2, 3], [3, 1, 2]])))
    assert rewards.tolist() == [2.0, 1.0 - 2 / 3]
    adv = task.advantages(rewards)
    assert adv[0] > 0 > adv[1] and abs(float(adv.sum())) < 1e-5


def test_sampling_is_a_function_of_probabilities_and_uniforms() -> None:
    probs = np.array([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=np.float32)
    assert SortTask.sample(probs, np.array([0.25, 0.99])).tolist() == [0, 2]
    assert SortTask.sample(probs, np.array([0.75, 0.0])).tolist() == [1, 2]
    assert SortTask.sample(probs, np.array([0.999999, 0.5])).tolist() == [1, 2]  # never a token of probability 0


def test_weights_identical_notices_a_single_flipped_bit(tmp_path: Path) -> None:
    w = {"weights/0": np.linspace(-1, 1, 64, dtype=np.float32), "optimizer/0.exp_avg": np.ones(8, np.float32)}
    np.savez(tmp_path / "a.npz", **w)  # type: ignore[arg-type]
    np.savez(tmp_path / "b.npz", **w)  # type: ignore[arg-type]
    flipped = w["weights/0"].copy()
    flipped.view(np.uint32)[17] ^= 1
    np.savez(tmp_path / "c.npz", **{**w, "weights/0": flipped})  # type: ignore[arg-type]
    np.savez(tmp_path / "d.npz", **{"weights/0": w["weights/0"]})  # type: ignore[arg-type]
    assert weights_identical(tmp_path / "a.npz", tmp_path / "b.npz")
    assert not weights_identical(tmp_path / "a.npz", tmp_path / "c.npz")
    assert not weights_identical(tmp_path / "a.npz", tmp_path / "d.npz")


def test_job_messages_round_trip_and_progress_prints_without_a_terminal(tmp_path: Path) -> None:
    msgs: list[m.JobMessage] = [
        m.Built("job-1", "numpy", False, 42),
        m.Ready("job-1"),
        m.PhaseChange("job-1", 1, "generation", holding=True),
        m.Offload("job-1", "suspend", 1024, 1.5),
        m.StepDone("job-1", 1, 0.5, -0.1, 12.0, 300.0),
        m.Done("job-1", 1, 0.3, "w.npz", "ab" * 32, 1, 0, 0.5),
    ]
    assert [m.decode(m.encode(x)) for x in msgs] == msgs
    with (tmp_path / "progress.txt").open("w+") as f:
        p = Progress(f, live=False)
        p.start("shared", ["job-1"], steps=1)
        p.update("solo", m.StepDone("job-1", 1, 0.9, 0.0, 0.0, 1.0))  # another run's job of the same name
        for x in msgs:
            p.update("shared", x)
        p.finish()
        f.seek(0)
        text = f.read()
    assert "job-1" in text and "step   1/1" in text and "reward 0.500" in text and "moved out/in 1/0" in text
