"""The trace profiles modelled on the reference project's published veRL runs (``bench/profiles/verl_*.json``) and the
multi-pool simulation that replays them (``bench/_trace_pools.py``): they load, a job alone reproduces the published
solo figures, two jobs sharing switch and never hold one pool at once, and the cost models give the stated times.

All in simulated time but the last two, through the real stack (2 steps at time / 2000: a few seconds each).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from _trace_model import ONE_POOL, Log, Profile, load_profile, pool_schedule, schedule  # noqa: E402
from _trace_pool_md import pool_markdown  # noqa: E402
from _trace_pool_real import run_real_pools  # noqa: E402
from _trace_pool_report import run_pool_profile  # noqa: E402
from _trace_pools import PoolRun, exclusive, holds, run_figures, simulate_pools  # noqa: E402

NEW = ("verl_sync_disagg", "verl_async_disagg")
HOP_S = 0.0006
# A job alone against the published figures: duty within 1.5 points, the solo duration within 2% (the +-5% spread
# of the phases, drawn per job, moves them a little).
DUTY_TOL = 0.015
DURATION_TOL = 0.02


def _run(prof: Profile, jobs: int, cost: str = "published", policy: Any = "fifo") -> PoolRun:
    assert prof.published is not None
    n = prof.published.steps_per_job
    scheds = {f"j{i}": pool_schedule(prof, n, i) for i in range(jobs)}
    return simulate_pools(scheds, prof.costs[cost].pools, HOP_S, policy, staleness=prof.staleness)


def _duty(fig: dict[str, Any], pool: str) -> float:
    return float(fig["mean_duty"] if pool == "mean" else fig["pools"][pool]["duty_cycle"])


@pytest.mark.parametrize("name", NEW)
def test_the_modelled_profiles_load_and_say_they_are_modelled(name: str) -> None:
    prof = load_profile(name)
    assert prof.name == name
    assert "Modelled on the published figures, not recorded" in prof.description
    assert prof.published is not None and prof.published.steps_per_job > 0
    assert set(prof.costs) == {"published", "pcie"}
    assert prof.pools and "trainer" in prof.pools
    for model in prof.costs.values():
        assert set(model.pools) == set(prof.pools)


def test_the_existing_profiles_load_unchanged() -> None:
    for name in ("grpo_sync", "async_longcot"):
        prof = load_profile(name)
        assert prof.pools == () and prof.published is None and prof.costs == {} and prof.staleness == 0
        # the same draws as schedule(): pool_schedule only adds the pools (one, for a one-group profile)
        assert schedule(prof, 3, 1) == [
            [(n, pools != (), s) for n, pools, s, paced in step if not paced] for step in pool_schedule(prof, 3, 1)
        ]
        assert {p for step in pool_schedule(prof, 3, 1) for _, pools, _, _ in step for p in pools} == {ONE_POOL}


@pytest.mark.parametrize("name", NEW)
def test_a_job_alone_reproduces_the_published_solo_figures(name: str) -> None:
    prof = load_profile(name)
    pub = prof.published
    assert pub is not None
    for seed in (0, 1):
        run = simulate_pools(
            {f"j{seed}": pool_schedule(prof, pub.steps_per_job, seed)},
            prof.costs["published"].pools,
            HOP_S,
            staleness=prof.staleness,
        )
        fig = run_figures(run, pub.steps_per_job)
        assert fig["switches"] == 0  # alone: its context stays loaded, re-acquires never switch
        assert abs(_duty(fig, pub.duty_pool) - pub.duty_solo) <= DUTY_TOL, (name, seed, fig["mean_duty"])
        if pub.solo_s is not None:
            assert abs(fig["makespan_s"] / pub.solo_s - 1) <= DURATION_TOL, (name, seed, fig["makespan_s"])


def _order_kept(log_by_pool: dict[str, Log]) -> bool:
    """A job asked for a pool only while every pool it held sorted before it (docs/multi-pool.md)."""
    rank = {"release": 0, "end": 0, "acquire": 1, "grant": 2}  # at one instant a job releases before it asks
    events = sorted(
        (t, rank[kind], pool, job, kind)
        for pool, log in log_by_pool.items()
        for job, ev in log.items()
        for kind, t in ev
    )
    held: dict[str, set[str]] = {}
    for _, _, pool, job, kind in events:
        mine = held.setdefault(job, set())
        if kind == "acquire" and any(p > pool for p in mine):
            return False
        if kind == "grant":
            mine.add(pool)
        elif kind == "release":
            mine.discard(pool)
    return True


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("cost", ["published", "pcie"])
@pytest.mark.parametrize("policy", ["fifo", "room", "precopy", "room_precopy", "priority", "quantum", "min_hold"])
def test_two_jobs_sharing_switch_and_never_hold_one_pool_at_once(name: str, cost: str, policy: Any) -> None:
    prof = load_profile(name)
    pub = prof.published
    assert pub is not None
    run = _run(prof, 2, cost, policy)
    fig = run_figures(run, pub.steps_per_job)
    assert exclusive(run)
    assert _order_kept(run.logs)
    assert fig["switches"] > 0 and fig["switches"] == sum(f["switches"] for f in fig["pools"].values())
    assert abs(fig["switches"] - pub.swaps) <= 0.5 * pub.swaps  # about as often as the published run
    for pool, f in fig["pools"].items():
        assert 0 < f["duty_cycle"] <= 1, pool
        assert len(holds(run.logs[pool])) == 2  # both jobs held it
    # every job ran every step: its holds of the pools its phases name, all of them
    for job in ("j0", "j1"):
        assert job in run.ends
    crit = fig["critical_path_s"]
    assert crit["total"] == pytest.approx(crit["snapshot"] + crit["restore"] + crit["lock_bus"], abs=1e-6)
    assert crit["lock_bus"] >= 0 and crit["snapshot"] >= 0 and crit["restore"] >= 0


@pytest.mark.parametrize("name", NEW)
def test_the_phase_policies_publish_the_jobs_phase_starts_and_keep_every_rule(name: str) -> None:
    """``predict_phase``: the jobs' phase starts reach each pool's core (more events than ``predict``'s run), which
    keeps one holder per pool and the order rule, and every job ends."""
    prof = load_profile(name)
    plain, phased = _run(prof, 2, policy="predict"), _run(prof, 2, policy="predict_phase")
    both = _run(prof, 2, policy="room_predict_phase")
    assert phased.events > plain.events
    for run in (phased, both):
        assert exclusive(run) and _order_kept(run.logs) and set(run.ends) == {"j0", "j1"}


@pytest.mark.parametrize("name", NEW)
def test_the_switch_on_the_critical_path_with_and_without_room(name: str) -> None:
    prof = load_profile(name)
    pub = prof.published
    assert pub is not None
    costs = prof.costs["published"].pools
    fifo = run_figures(_run(prof, 2, "published", "fifo"), pub.steps_per_job)
    room = run_figures(_run(prof, 2, "published", "room"), pub.steps_per_job)
    restore = max(c.restore for c in costs.values())
    snapshot = max(c.snapshot for c in costs.values())
    # FIFO today: a release nobody waited for leaves the context loaded, so the next job pays the whole snapshot
    assert fifo["critical_path_median_s"]["snapshot"] == pytest.approx(snapshot, abs=1e-6)
    # grant on restore: the snapshot leaves the critical path (but for the bus passes of the restore's answer, when
    # the incoming context had nothing to restore); the median switch is the restore and the bus
    assert room["critical_path_median_s"]["snapshot"] <= 0.010
    assert room["critical_path_s"]["snapshot"] <= room["switches"] * 3 * HOP_S
    assert room["critical_path_median_s"]["total"] <= restore + 0.010
    assert room["makespan_s"] <= 0.97 * fifo["makespan_s"]


@pytest.mark.parametrize("name", NEW)
def test_a_precopy_shortens_only_the_switches_after_an_idle_release(name: str) -> None:
    """Pre-copy in the simulation: a switch after a release nobody waited for (the context left loaded) pays what is
    left of the idle copy instead of the snapshot (never more); every restore takes its full time."""
    prof = load_profile(name)
    pub = prof.published
    assert pub is not None
    fifo_run, pre_run = _run(prof, 2, "published", "fifo"), _run(prof, 2, "published", "precopy")
    fifo, pre = run_figures(fifo_run, pub.steps_per_job), run_figures(pre_run, pub.steps_per_job)
    assert pre["critical_path_s"]["snapshot"] <= fifo["critical_path_s"]["snapshot"] + 1e-6
    assert pre["makespan_s"] <= fifo["makespan_s"] + 1e-6
    snapshot = max(c.snapshot for c in prof.costs["published"].pools.values())
    spans = [o.end - o.start for o in pre_run.ops if o.kind == "snapshot"]
    assert all(s <= snapshot + 1e-9 for s in spans)
    # every restore its full time: the copy out is all that moved
    costs = prof.costs["published"].pools
    assert all(o.end - o.start == pytest.approx(costs[o.pool].restore) for o in pre_run.ops if o.kind == "restore")


def test_the_cost_models_give_the_stated_times() -> None:
    sync, asyn = load_profile("verl_sync_disagg"), load_profile("verl_async_disagg")
    for pool in ("sampler", "trainer"):
        c = sync.costs["published"].pools[pool]
        assert (c.snapshot, c.restore) == (21.3, 2.5)
    c = asyn.costs["published"].pools["trainer"]
    assert (c.snapshot, c.restore) == (21.2, 9.2)
    # PCIe floor: bytes / 55 GB/s each way; 16 B/param on a trainer, the bf16 weights on a sampler
    expected = [
        (sync, "trainer", 494e6 * 16 / 55e9),  # 0.144 s
        (sync, "sampler", 494e6 * 2 / 55e9),  # 0.018 s
        (asyn, "trainer", 1.777e9 * 16 / 55e9),  # 0.517 s
    ]
    for prof, pool, seconds in expected:
        c = prof.costs["pcie"].pools[pool]
        assert c.gb_per_s == 55.0
        assert c.snapshot == pytest.approx(seconds, rel=1e-9) and c.restore == pytest.approx(seconds, rel=1e-9)


def test_a_paced_job_waits_for_its_producer_and_the_producer_for_staleness() -> None:
    prof = load_profile("verl_async_disagg")
    n = 20
    sched = {"j0": [[("wait", (), 10.0, True), ("train", ("trainer",), 1.0, False)] for _ in range(n)]}
    run = simulate_pools(sched, {}, 0.0, staleness=prof.staleness)
    grants = [t for k, t in run.logs["trainer"]["j0"] if k == "grant"]
    assert grants == pytest.approx([10.0 * (i + 1) for i in range(n)])  # one input every 10 s from the start
    slow = {"j0": [[("wait", (), 1.0, True), ("train", ("trainer",), 10.0, False)] for _ in range(n)]}
    run = simulate_pools(slow, {}, 0.0, staleness=2)
    grants = [t for k, t in run.logs["trainer"]["j0"] if k == "grant"]
    assert grants == pytest.approx([1.0 + 10.0 * i for i in range(n)])  # the trainer paces, no wait after the first


def test_the_report_block_for_a_pool_profile() -> None:
    out = run_pool_profile("verl_sync_disagg", ["published", "pcie"], ["fifo", "room"], HOP_S, 120.0, None)
    assert out["pools"] == ["sampler", "trainer"]
    assert set(out["sim"]["runs"]) == {"published", "pcie"}
    block = out["sim"]["runs"]["published"]["room"]
    assert block["shared"]["makespan_vs_fifo"] < 1.0
    vp = block["vs_published"]
    assert vp["solo_s"]["published"] == 137 * 60 and vp["swaps"]["published"] == 42
    assert len(block["alone"]) == 2 and block["shared"]["jobs"] == 2


def test_the_markdown_section_renders_the_published_comparison() -> None:
    block = run_pool_profile("verl_async_disagg", ["published"], ["fifo", "room"], HOP_S, 120.0, None)
    lines = pool_markdown({"command": "python bench/trace_replay.py", "pool_profiles": {"verl_async_disagg": block}})
    text = "\n".join(lines)
    assert "### verl_async_disagg" in text and "not recorded" in text
    assert "| 2 sharing, room |" in text and "27 swaps" in text
    assert pool_markdown({"profiles": {}}) == []


async def test_the_real_stack_replays_a_multi_pool_profile() -> None:
    """The quickest real run: 2 steps of the sync profile, time / 2000, FIFO (the agents restore after the snapshot)."""
    out = await run_real_pools(["verl_sync_disagg"], ["published"], ["fifo"], 2, 2000.0)
    block = out["verl_sync_disagg"]["published"]["fifo"]
    shared = block["shared"]
    assert [a["switches"] for a in block["alone"]] == [0, 0]
    assert shared["jobs"] == 2 and shared["switches"] > 0
    assert block["handler_s"]["suspend"] > 0  # the agents really asked the jobs to move their state
    # the snapshot is on the critical path (FIFO), as modelled: 21.3 s; the stack's overhead is on top of it
    assert shared["critical_path_median_s"]["snapshot"] >= 0.9 * 21.3
    assert block["exclusive"]  # by the jobs' own logs, no two held one pool at once
    for pool in ("sampler", "trainer"):
        assert 0 < shared["pools"][pool]["duty_cycle"] <= 1
    assert sum(block["ahead"].values()) == 0  # no predictive restore: no release names a job expected next


async def test_the_real_stack_replays_with_the_predictive_restore_set_as_an_operator_sets_it() -> None:
    """``predict`` through the stack: each pool's group gets ``SetPolicy(predict=True)`` on its control subject before
    the jobs start (``timeslice set-policy``'s request), so the orchestrator plans restores: releases of the shared
    run name the job expected next (``Released.ahead``), which they never do with the policy off."""
    out = await run_real_pools(["verl_sync_disagg"], ["published"], ["predict"], 2, 2000.0)
    block = out["verl_sync_disagg"]["published"]["predict"]
    assert block["shared"]["jobs"] == 2 and block["shared"]["switches"] > 0
    assert sum(block["ahead"].values()) > 0, block["ahead"]
    assert block["exclusive"]
