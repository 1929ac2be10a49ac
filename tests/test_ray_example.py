"""examples/ray_timeslice.py on a local Ray instance: two jobs, each a driver and two Ray actors (rollout, trainer;
three processes, one job id, one hold), share one group through the real stack. Every switch moves both actors' state
(each registered as a part of its job), the final weights are bit-identical to the run without timeslice, the two
jobs' holds never overlap, and each job's scoring (off the accelerators) overlaps the other job's holds: what sharing
gains. Whether that gain outweighs the switches is the machine's: the wall times are printed, not asserted (on a quiet
2-core VM shared took 0.52x back to back; with the suite's other tests on the same cores, 0.72x to 2.75x, every switch
slow). Skipped without ray (the `ray` test extra) or torch."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from typing import Any

import pytest

from .agent_harness import NODE, ROOT, AgentProcess
from .helpers import overlap_s, run_text

# Compares wall-clock runs (shared against solo or predicted): one CI worker runs these modules one after another
# (``--dist loadgroup``), so they never load the 2 cores against each other.
pytestmark = pytest.mark.xdist_group("wall_clock")

pytest.importorskip("torch")
pytest.importorskip("ray")

STEPS = 6
# The reward step's CPU time (the example's default is 0.25 s). Longer here, so that the other job's holds fit in it
# even when CI's two busy cores make every switch slow.
REWARD_S = 0.6


def _example(nats_url: str, *args: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ray-", dir="/tmp") as short:  # Ray's socket paths: 107 bytes at most
        env = dict(os.environ, TIMESLICE_NATS_URL=nats_url, RAY_AUTH_MODE="disabled", RAY_TMPDIR=short)
        return _run(env, *args)


def _run(env: dict[str, str], *args: str) -> dict[str, Any]:
    proc = run_text(
        [
            sys.executable,
            str(ROOT / "examples" / "ray_timeslice.py"),
            "--steps",
            str(STEPS),
            "--reward-s",
            str(REWARD_S),
            "--node-id",
            NODE,
            *args,
        ],
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


async def test_two_ray_jobs_share_a_group_with_every_actor_moved(agent: AgentProcess, nats_url: str) -> None:
    plain = await asyncio.to_thread(_example, nats_url, "--plain")
    shared = await asyncio.to_thread(_example, nats_url)
    back_to_back, together = plain["jobs_wall_s"], shared["jobs_wall_s"]
    (a, run_a), (b, run_b) = shared["jobs"].items()
    # What sharing is for: while one job scores off the accelerators, the other has them.
    hidden = {a: overlap_s(run_a["scores"], run_b["holds"]), b: overlap_s(run_b["scores"], run_a["holds"])}
    print(
        f"ray x2, {STEPS} steps: back to back {back_to_back:.2f} s, shared {together:.2f} s "
        f"= {together / back_to_back:.2f}x; suspends/resumes {[r['suspends_resumes'] for r in shared['jobs'].values()]}"
        "; "
        f"the other job held during scoring: {', '.join(f'{j} {s:.2f} s' for j, s in hidden.items())}"
    )
    for job, run in shared["jobs"].items():
        assert run["digest"] == plain["jobs"][job]["digest"], f"{job}: not the weights of its run without timeslice"
        (rs, rr), (ts, tr) = run["suspends_resumes"]["rollout"], run["suspends_resumes"]["trainer"]
        assert rs >= 1 and rr >= 1, run  # the jobs took turns: each was switched out and back
        assert (rs, rr) == (ts, tr), f"{job}: a switch moved one actor but not the other: {run}"
        assert len(run["holds"]) == 2 * STEPS and len(run["scores"]) == STEPS, run
    assert all(r["suspends_resumes"] == {"rollout": [0, 0], "trainer": [0, 0]} for r in plain["jobs"].values())
    # Never both on the accelerators at once: the two jobs' holds are disjoint.
    assert overlap_s(run_a["holds"], run_b["holds"]) == 0.0, (run_a["holds"], run_b["holds"])
    assert all(s > 0.0 for s in hidden.values()), hidden
