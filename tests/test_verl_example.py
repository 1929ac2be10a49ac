"""The veRL example (``examples/verl_timeslice.py``: ``RayPPOTrainer.fit``'s loop with the holds of
``timeslice_client.integrations.verl.VerlHolds`` in place), through the real stack (a nats-server, the
orchestrator, a snapshot agent per node), on the example's stand-ins of veRL's worker groups (veRL's method names,
in ``fit``'s order; numpy state that the agents move).

Two jobs at once, on one pool (the hybrid engine) or two (actor and rollout). Asserted: no deadlock (both finish);
every worker call ran inside its job's hold of that call's pool and never beside the other job's call there; each
job's final state is bit-identical to the same loop without timeslice; the state was really moved (switched out by
the other job's turns, every byte back); the holds are the phases' (one acquire per pool per phase, the weight
sync keeping the actor pool when its id sorts first); and with two pools the jobs overlap (one generates while the
other updates: calls of both ran at once on different pools). The wall times are printed, not asserted: shared took
0.80x back to back run alone (2026-12-07), 0.91x in a suite run on the same two busy cores, where the switches cost
more. Plus: the example runs as a script, through a stack, to the state it reaches with ``--plain``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from timeslice_cli.demo._stack import embedded_stack
from timeslice_client import InvalidRequest, TimeSliceClient
from timeslice_client.integrations.verl import VerlHolds

from .helpers import example_line, running_agents
from .pool_watch import PoolWatch

ROOT = Path(__file__).resolve().parents[1]
STEPS = int(os.environ.get("TIMESLICE_VERL_STEPS", "5"))
NODES = {"actor": "n-verl-actor", "rollout": "n-verl-rollout"}
JOB_TIMEOUT_S = 60.0


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("verl_timeslice_example", ROOT / "examples" / "verl_timeslice.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


ex = load_example()


class Pools(PoolWatch):
    """The watch (tests/pool_watch.py), told each call's group as this framework's pools name it."""

    def work(self, job: str, holds: VerlHolds | None) -> Any:
        if holds is None:
            return self.watched(job, None, None)
        return self.watched(
            job,
            lambda pool: {"actor": holds.actor_pool, "rollout": holds.rollout_pool, "reward": holds.reward_pool}[pool],
            holds.holds,
        )


@dataclass
class Run:
    digest: str
    start: float
    end: float
    counts: Any = None
    offload: dict[str, Any] | None = None


def plain(seed: int, colocated: bool) -> Run:
    trainer = ex.build(seed=seed, steps=STEPS, colocated=colocated)
    start = time.time()
    ex.fit(trainer, ex.Unshared())
    return Run(trainer.digest(), start, time.time())


def shared_job(name: str, nats_url: str, actor: str, rollout: str, seed: int, pools: Pools) -> Run:
    with TimeSliceClient(
        name, actor, nats_url, lease_s=10, acquire_timeout_s=JOB_TIMEOUT_S, bind_process=False
    ) as client:
        holds = VerlHolds(client, actor_pool=actor, rollout_pool=rollout)
        trainer = ex.build(seed=seed, steps=STEPS, colocated=holds.colocated, on_work=pools.work(name, holds))
        nodes = {"actor": NODES["actor"], "rollout": NODES["actor" if holds.colocated else "rollout"]}
        handlers = ex.register(client, holds, trainer, nodes)
        start = time.time()
        try:
            ex.fit(trainer, holds)
        finally:
            holds.close()
        end = time.time()
        assert client.held_groups == (), "close() left a group held"
        with client.on_accelerators(timeout=JOB_TIMEOUT_S, groups=sorted({actor, rollout})):
            return Run(trainer.digest(), start, end, holds.counts, {p: h.counts for p, h in handlers.items()})


async def two_jobs(nats_url: str, actor: str, rollout: str) -> tuple[dict[str, Run], dict[str, Run], Pools]:
    seeds = {"verl-a": 1, "verl-b": 2}
    colocated = actor == rollout
    # Off the event loop: the orchestrator serves from it (a blocked loop would let its leadership lapse).
    solo = {job: await asyncio.to_thread(plain, seed, colocated) for job, seed in seeds.items()}
    pools = Pools()
    async with running_agents(nats_url, [NODES["actor"]] if colocated else list(NODES.values())):
        runs = await asyncio.wait_for(
            asyncio.gather(
                *(
                    asyncio.to_thread(shared_job, job, nats_url, actor, rollout, seed, pools)
                    for job, seed in seeds.items()
                )
            ),
            2 * JOB_TIMEOUT_S,
        )
    shared = dict(zip(seeds, runs, strict=True))
    assert pools.violations == [], pools.violations[:10]
    for job, run in shared.items():
        assert run.digest == solo[job].digest, f"{job}: the shared run's state differs from the plain run's"
        for pool, off in (run.offload or {}).items():
            assert off.suspends == off.resumes >= 1 and off.bytes_in == off.bytes_out > 0, (job, pool, off)
    assert solo["verl-a"].digest != solo["verl-b"].digest
    return solo, shared, pools


def ratio(what: str, solo: dict[str, Run], shared: dict[str, Run]) -> float:
    back_to_back = sum(r.end - r.start for r in solo.values())
    wall = max(r.end for r in shared.values()) - min(r.start for r in shared.values())
    offs = [o for r in shared.values() for o in (r.offload or {}).values()]
    print(
        f"\n{what}: back to back {back_to_back:.2f} s (plain), shared {wall:.2f} s = {wall / back_to_back:.2f}x; "
        f"{max(o.last_suspend_bytes for o in offs) / 1e3:.0f} kB per switch; suspends "
        f"{sum(o.suspends for o in offs)}; waited "
        + ", ".join(f"{r.counts.waited_ms / 1000:.2f} s" for r in shared.values())
    )
    return wall / back_to_back


@pytest.mark.usefixtures("orchestrator")
async def test_two_verl_jobs_share_one_pool_hybrid_engine(nats_url: str) -> None:
    """One pool: the group changes hands at the reward (a CPU phase), kept from the rollout into the reward model."""
    solo, shared, pools = await two_jobs(nats_url, "gpus-0", "gpus-0")
    for job, run in shared.items():
        c = run.counts
        # per step: rollout (generate_sequences, with the weights loaded into the engine), the reward model (the
        # rollout's hold kept for it), update
        assert c.phases == 3 * STEPS and c.acquires == c.releases == 2 * STEPS and c.reorders == 0, (job, c)
        assert pools.calls[job, "load_weights_into_engine"] == pools.calls[job, "update_actor"] == STEPS
        assert pools.calls[job, "sync_rollout_weights"] == 0  # the hybrid engine syncs inside generate_sequences
    ratio(f"veRL x2, one pool, {STEPS} steps", solo, shared)


@pytest.mark.usefixtures("orchestrator")
@pytest.mark.parametrize(
    ("actor", "rollout"),
    [("actor-pool", "rollout-pool"), ("pool-b-actor", "pool-a-rollout")],
    ids=["actor-sorts-first", "rollout-sorts-first"],
)
async def test_two_verl_jobs_share_the_actor_and_rollout_pools(nats_url: str, actor: str, rollout: str) -> None:
    """Two pools: one job generates while the other updates; the weight sync (inside the update) takes both."""
    solo, shared, pools = await two_jobs(nats_url, actor, rollout)
    kept = actor < rollout
    for job, run in shared.items():
        c = run.counts
        # the first sync (both), then per step rollout, reward model, update, weight sync (nested in the update)
        assert c.phases == 1 + 4 * STEPS, (job, c)
        # one acquire per pool per phase; the nested sync adds the rollout pool (and, when the rollout pool sorts
        # first, gives the actor pool back and takes both again: a reorder, one more acquire)
        assert c.acquires == c.releases == 2 + (4 if kept else 5) * STEPS, (job, c)
        assert c.reorders == (0 if kept else STEPS), (job, c)
        assert pools.calls[job, "sync_rollout_weights"] == 2 * (STEPS + 1)  # the actor's and the rollout's side
    ratio(f"veRL x2, two pools {actor}/{rollout}, {STEPS} steps", solo, shared)
    beside = pools.beside_s()
    print(f"the two jobs worked at once on different pools for {beside:.2f} s")
    if kept:  # the rollout of one overlaps the update of the other
        assert beside > 0.0, pools.spans


def test_the_holds_map_the_phases_to_the_pools_and_refuse_an_unknown_one() -> None:
    client = TimeSliceClient("verl-x", "gpus-0", "nats://127.0.0.1:1", bind_process=False)  # never connects
    try:
        holds = VerlHolds(client, rollout_pool="rollouts")
        assert not holds.colocated and holds.pools("weight_sync") == ("gpus-0", "rollouts")
        assert holds.pools("rollout") == holds.pools("validate") == ("rollouts",)
        assert holds.pools("update") == holds.pools("reward_model") == holds.pools("save") == ("gpus-0",)
        with pytest.raises(InvalidRequest, match="the phases are"), holds.phase("generate"):
            pytest.fail("entered an unknown phase")
    finally:
        client.close()


async def test_the_example_runs_through_the_stack_as_it_runs_without_it(tmp_path: Path) -> None:
    """``examples/verl_timeslice.py`` as the docs run it: with timeslice its final state is that of ``--plain``."""
    async with embedded_stack(tmp_path / "stack", "n-verl-example") as stack:
        env = dict(
            os.environ,
            TIMESLICE_NATS_URL=stack.nats_url,
            TIMESLICE_NODE_ID="n-verl-example",
            PYTHONPATH=os.pathsep.join(sys.path),
        )

        run = functools.partial(example_line, "verl_timeslice.py", "ppo-example", env=env, timeout=JOB_TIMEOUT_S)
        shared, alone = await asyncio.gather(run(), run("--plain"))
    assert "moved out 0x" in shared and "6 holds" in shared, shared  # alone in its group: nothing moved
    assert shared.split("state sha256 ")[1] == alone.split("state sha256 ")[1], (shared, alone)
