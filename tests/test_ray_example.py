"""examples/ray_timeslice.py on a local Ray instance: two jobs, each a driver and two Ray actors (rollout, trainer;
three processes, one job id, one hold), share one group through the real stack. Every switch moves both actors' state
(each registered as a part of its job), the final weights are bit-identical to the run without timeslice, and
sharing takes less wall time than the two jobs back to back. Skipped without ray (the `ray` test extra) or torch."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from typing import Any

import pytest

from .agent_harness import NODE, ROOT, AgentProcess
from .helpers import run_text

# Compares wall-clock runs (shared against solo or predicted): one CI worker runs these modules one after another
# (``--dist loadgroup``), so they never load the 2 cores against each other.
pytestmark = pytest.mark.xdist_group("wall_clock")

pytest.importorskip("torch")
pytest.importorskip("ray")

STEPS = 6
# The reward step's CPU time (the example's default is 0.25 s). Longer here, so that what sharing saves (the other job
# runs meanwhile) stays clear of what switching costs on CI's two busy cores: one run there had every switch so slow
# (11 per job instead of 6) that sharing at 0.25 s took 1.18x back to back.
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
    print(
        f"ray x2, {STEPS} steps: back to back {back_to_back:.2f} s, shared {together:.2f} s "
        f"= {together / back_to_back:.2f}x; suspends/resumes {[r['suspends_resumes'] for r in shared['jobs'].values()]}"
    )
    for job, run in shared["jobs"].items():
        assert run["digest"] == plain["jobs"][job]["digest"], f"{job}: not the weights of its run without timeslice"
        (rs, rr), (ts, tr) = run["suspends_resumes"]["rollout"], run["suspends_resumes"]["trainer"]
        assert rs >= 1 and rr >= 1, run  # the jobs took turns: each was switched out and back
        assert (rs, rr) == (ts, tr), f"{job}: a switch moved one actor but not the other: {run}"
    assert all(r["suspends_resumes"] == {"rollout": [0, 0], "trainer": [0, 0]} for r in plain["jobs"].values())
    assert together < back_to_back, (together, back_to_back)
