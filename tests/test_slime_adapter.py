"""The slime integration, through the real stack (a nats-server, the orchestrator, a snapshot agent per node).

Part one, our adapter (``timeslice_client.integrations.slime.TimeSliceCallback``): two jobs run slime's drivers
(``tests/workers/slime_standins.py``: ``train.py`` and ``train_async.py`` of the phase-callback fork, call for call,
on stand-ins of its Ray actors whose numpy state the agents move) on two pools (trainer, sampler) or one (slime's
``--colocate``), at once. Asserted: no deadlock (both finish); every call of an actor ran inside its job's hold of
that pool, and never while the other job worked on the pool; the final state of each job is bit-identical to a
run of the same driver without timeslice; the state was really moved (the other job's turns suspended it, every
byte came back); the holds are the phases' (one acquire per group per phase, nothing held after ``close()``); with two
pools, the trainer's first, calls of both jobs ran at once on different pools (one generates while the other trains;
the wall times are printed, not asserted: what they gain depends on the switches' cost on a busy machine).

Part two, the reference project's slime package (``timeslice_slime``, llm-d-incubation/llm-d-rl-time-slicing): two
processes (``tests/workers/slime_reference_job.py``) run the same synchronous driver with that package's callback,
speaking the reference's gRPC API to our gRPC shim exactly as its client does (one channel per role;
``Acquire(job_id, group_id)`` and ``Yield(job_id, group_id)``, trainer before sampler); where the real packages are
installed (``timeslice`` from ``pkg/client/python``, ``timeslice_slime`` from ``pkg/integrations/slime``) the job
uses them unchanged, else stand-ins that make the same calls on stubs compiled from the proto we ship.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from timeslice_client import InvalidRequest, TimeSliceClient
from timeslice_client.integrations.slime import TimeSliceCallback
from timeslice_orchestrator.grpc_shim import GrpcConfig, OrchestratorGrpcShim
from timeslice_orchestrator.service import Orchestrator

from .grpc_proto_client import OrchestratorClient
from .helpers import running_agents
from .pool_watch import PoolWatch
from .workers import slime_standins as slime

ROOT = Path(__file__).resolve().parents[1]
NODES = {"trainer": "n-slime-trainer", "sampler": "n-slime-sampler"}
STEPS = int(os.environ.get("TIMESLICE_SLIME_STEPS", "6"))
SIZE = int(os.environ.get("TIMESLICE_SLIME_SIZE", "4096"))  # float64s per array: 32 KB each
# Each call's time (s): generation, training, the weight sync. A switch costs tens of ms on the 2-core VM (the
# orchestrator's protocol and the agents'); phases much shorter than that would measure the switch alone.
GEN_S, TRAIN_S, SYNC_S = 0.2, 0.2, 0.02
JOB_TIMEOUT_S = 60.0
# The two pools' groups in both orders: whether the trainer's sorts before the sampler's decides whether a job may
# keep its trainer pool into the weight sync (the holds are taken in sorted order).
POOL_ORDERS = pytest.mark.parametrize(
    ("trainer", "sampler"),
    [("a-trainer", "b-sampler"), ("trainers", "samplers")],
    ids=["trainer-sorts-first", "sampler-sorts-first"],
)


# --------------------------------------------------------------------------- the probe


class Pools(PoolWatch):
    """The watch (tests/pool_watch.py), told each call's group as this framework's pools name it."""

    def work(self, job: str, callback: TimeSliceCallback | None) -> slime.Work:
        if callback is None:
            return self.watched(job, None, None)
        return self.watched(job, lambda pool: callback.groups_of(pool)[0], callback.holds)


@dataclass
class Run:
    job: str
    digest: str
    seconds: float
    start: float = 0.0
    end: float = 0.0
    counts: Any = None
    offload: dict[str, Any] | None = None


Driver = Callable[[slime.Args, slime.Actors, Any], None]


def plain(args: slime.Args, driver: Driver) -> Run:
    """The driver without timeslice: the results to match, and the time it takes alone."""
    actors = slime.Actors(args)
    t0 = time.monotonic()
    driver(args, actors, None)
    return Run("plain", actors.digest(), time.monotonic() - t0)


def shared_job(
    name: str, nats_url: str, trainer: str, sampler: str, args: slime.Args, driver: Driver, pools: Pools
) -> Run:
    with TimeSliceClient(
        name, trainer, nats_url, lease_s=10, acquire_timeout_s=JOB_TIMEOUT_S, bind_process=False
    ) as client:
        callback = TimeSliceCallback(client, trainer_group=trainer, sampler_group=sampler)
        one_node = callback.colocated

        def register(role: str, handler: Any) -> None:
            callback.register(role, handler, node_id=NODES["trainer" if one_node else role])

        actors = slime.Actors(args, on_work=pools.work(name, callback), register=register)
        start = time.time()
        driver(args, actors, callback)  # the driver calls callback.close() after its loop
        end = time.time()
        assert callback.holds.held == () and client.held_groups == (), "close() left a group held"
        with client.on_accelerators(timeout=JOB_TIMEOUT_S, groups=sorted({trainer, sampler})):
            # In a hold: the state may be switched out since close() gave the pools back.
            digest = actors.digest()
            offload = {role: h.counts for role, h in actors.handlers.items()}
        return Run(name, digest, end - start, start, end, callback.counts, offload)


async def handoffs(nats_url: str, group: str, since_ms: int, until_ms: int) -> tuple[int, int, int]:
    """The group's handoffs, faults and invariant violations in the window, as ``timeslice replay`` folds them."""
    from timeslice_orchestrator.replay import fold_events, read_window

    events = await read_window(nats_url, group=group, since_ms=since_ms, until_ms=until_ms)
    replay = fold_events(events, group=group, since_ms=since_ms, until_ms=until_ms)
    g = replay.summary.groups[group]
    return g.handoffs, g.faults, len(replay.violations)


async def two_jobs(
    nats_url: str, trainer: str, sampler: str, args: slime.Args, driver: Driver
) -> tuple[dict[str, Run], dict[str, Run], Pools, dict[str, tuple[int, int, int]]]:
    seeds = {"slime-a": 1, "slime-b": 2}
    # Off the event loop: the orchestrator serves from it (a blocked loop would let its leadership lapse).
    solo = {j: await asyncio.to_thread(plain, replace(args, seed=s), driver) for j, s in seeds.items()}
    pools = Pools()
    nodes = [NODES["trainer"]] if trainer == sampler else list(NODES.values())
    async with running_agents(nats_url, nodes):
        since = int(time.time() * 1000)
        runs = await asyncio.wait_for(
            asyncio.gather(
                *(
                    asyncio.to_thread(shared_job, j, nats_url, trainer, sampler, replace(args, seed=s), driver, pools)
                    for j, s in seeds.items()
                )
            ),
            2 * JOB_TIMEOUT_S,
        )
        until = int(time.time() * 1000)
        moved = {g: await handoffs(nats_url, g, since, until) for g in sorted({trainer, sampler})}
    return solo, {r.job: r for r in runs}, pools, moved


def figures(what: str, solo: dict[str, Run], shared: dict[str, Run], moved: dict[str, tuple[int, int, int]]) -> float:
    back_to_back = sum(r.seconds for r in solo.values())
    wall = max(r.end for r in shared.values()) - min(r.start for r in shared.values())
    offs = [o for r in shared.values() for o in (r.offload or {}).values()]
    suspends = sum(o.suspends for o in offs)
    print(
        f"\n{what}: back to back {back_to_back:.2f} s (plain, no timeslice), shared {wall:.2f} s = "
        f"{wall / back_to_back:.2f}x; handoffs {dict((g, m[0]) for g, m in moved.items())}; "
        f"{max(o.last_suspend_bytes for o in offs) / 1e3:.0f} kB per switch of a pool; suspends {suspends}, mean "
        f"{sum(o.suspend_ms for o in offs) / max(1, suspends):.1f} ms, resume mean "
        f"{sum(o.resume_ms for o in offs) / max(1, sum(o.resumes for o in offs)):.1f} ms; waited "
        + ", ".join(f"{r.counts.waited_ms / 1000:.2f} s" for r in shared.values())
    )
    return wall / back_to_back


def check(solo: dict[str, Run], shared: dict[str, Run], pools: Pools, moved: dict[str, tuple[int, int, int]]) -> None:
    assert pools.violations == [], pools.violations[:10]
    for job, run in shared.items():
        assert run.digest == solo[job].digest, f"{job}: the shared run's state differs from the plain run's"
        for role, off in (run.offload or {}).items():
            # The other job's turns switched this job's state out, and every byte came back.
            assert off.suspends == off.resumes >= 1 and off.bytes_in == off.bytes_out > 0, (job, role, off)
    assert solo["slime-a"].digest != solo["slime-b"].digest  # two different jobs: the check can tell them apart
    for group, (n, faults, violations) in moved.items():
        assert n >= 2 and faults == 0 and violations == 0, (group, moved)


# --------------------------------------------------------------------------- part one: our adapter


@pytest.mark.usefixtures("orchestrator")
@POOL_ORDERS
async def test_two_slime_jobs_share_the_trainer_and_sampler_pools(nats_url: str, trainer: str, sampler: str) -> None:
    """The synchronous driver on two pools: B generates while A trains, the weight sync takes both. When the
    trainer's group sorts first, the trainer pool is kept from training into the weight sync; else it is given
    back and both are taken again in order (and the other job may train in between)."""
    steps = max(STEPS, 8)  # the overlap's gain grows with the rollouts; at 8 it is well clear of the goal
    args = slime.Args(
        num_rollout=steps, size=SIZE, gen_s=GEN_S, train_s=TRAIN_S, sync_s=SYNC_S, eval_interval=2, save_interval=2
    )
    solo, shared, pools, moved = await two_jobs(nats_url, trainer, sampler, args, slime.train)
    check(solo, shared, pools, moved)
    kept = trainer < sampler
    for job, run in shared.items():
        c = run.counts
        evals = steps // 2
        # init (both), then per step generate, train, weight sync (both), eval every second step: one acquire
        # and one release per group per phase, but for the trainer pool kept from training into the sync
        assert c.phases == 1 + 3 * steps + evals, (job, c)
        assert c.acquires == c.releases == 2 + (3 if kept else 4) * steps + evals, (job, c)
        assert c.reorders == 0, (job, c)
        # every call in its phase: the weight sync (on both pools) once at init and once a step
        assert pools.calls[job, "update_weights"] == 2 * (steps + 1) and pools.calls[job, "save_model"] == evals
    figures(f"slime x2, two pools {trainer}/{sampler}, {steps} steps", solo, shared, moved)
    beside = pools.beside_s()
    print(f"the two jobs worked at once on different pools for {beside:.2f} s")
    if kept:  # B's generation overlaps A's training
        assert beside > 0.0, pools.spans


@pytest.mark.usefixtures("orchestrator")
async def test_two_slime_jobs_share_one_pool_colocated(nats_url: str) -> None:
    """slime's ``--colocate``: every phase on the one group, which changes hands once a rollout (turn="rollout")."""
    args = slime.Args(
        num_rollout=STEPS, size=SIZE, gen_s=GEN_S, train_s=TRAIN_S, sync_s=SYNC_S, colocate=True, offload_rollout=True
    )
    solo, shared, pools, moved = await two_jobs(nats_url, "gpus-0", "gpus-0", args, slime.train)
    check(solo, shared, pools, moved)
    for job, run in shared.items():
        c = run.counts
        # init, and per step generate, offload, train, onload (weights), weight sync, onload (kv)
        assert c.phases == 1 + 6 * STEPS, (job, c)
        # one hold for init, one per rollout (kept from phase to phase, given back as the next rollout begins)
        assert c.acquires == c.releases == 1 + STEPS, (job, c)
    # once a rollout (and once more for the reads after close()), not at every phase
    assert moved["gpus-0"][0] <= 2 * (STEPS + 2), moved
    figures(f"slime x2, one pool (--colocate), {STEPS} steps", solo, shared, moved)


@pytest.mark.usefixtures("orchestrator")
@POOL_ORDERS
async def test_two_slime_async_jobs_pipeline_without_deadlock(nats_url: str, trainer: str, sampler: str) -> None:
    """``train_async.py``: the next generation is dispatched (its sampler hold taken) while the job trains. With
    the sampler pool sorting first, taking it while holding the trainer pool would break the order: the trainer
    pool is given back and both are taken in order (a reorder); with the trainer sorting first, never."""
    args = slime.Args(
        num_rollout=STEPS, size=SIZE, gen_s=GEN_S, train_s=TRAIN_S, sync_s=SYNC_S, update_weights_interval=2
    )
    solo, shared, pools, moved = await two_jobs(nats_url, trainer, sampler, args, slime.train_async)
    check(solo, shared, pools, moved)
    for job, run in shared.items():
        expected = STEPS - 1 if sampler < trainer else 0  # every dispatch made while training
        assert run.counts.reorders == expected, (job, run.counts)
    figures(f"slime x2 async, {trainer}/{sampler}, {STEPS} steps", solo, shared, moved)


async def test_the_callback_refuses_what_slime_would_not_do(orchestrator: Orchestrator, nats_url: str) -> None:
    with TimeSliceClient("slime-x", "trainers", nats_url, bind_process=False) as client:
        cb = TimeSliceCallback(client, sampler_group="samplers")
        with pytest.raises(InvalidRequest, match="phase-callback roles"):
            await asyncio.to_thread(cb.on_phase_begin, "generate", "rollout")
        with pytest.raises(InvalidRequest, match="ended but was not begun"):
            await asyncio.to_thread(cb.on_phase_end, "train", "trainer")
        await asyncio.to_thread(cb.on_phase_begin, "weight_sync", "both")
        assert cb.holds.held == ("samplers", "trainers") == client.held_groups
        await asyncio.to_thread(cb.close)
        assert client.held_groups == ()
        with pytest.raises(InvalidRequest, match="after close"):
            await asyncio.to_thread(cb.on_phase_begin, "train", "trainer")


def test_the_callback_made_by_slime_reads_the_environment() -> None:
    """slime's ``load_phase_callback`` makes the class with no arguments: the environment says what to hold."""
    code = (
        "import os, sys; from timeslice_client.integrations.slime import TimeSliceCallback as C\n"
        "try:\n    C()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
        "os.environ.update(TIMESLICE_JOB_ID='j', TIMESLICE_TRAINER_GROUP='t')\n"
        "try:\n    C()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
        "os.environ.update(TIMESLICE_GROUP='g', TIMESLICE_NATS_URL='nats://127.0.0.1:1')\n"
        "c = C(); print('groups', c.groups, c.colocated, c.client.job_id); c.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_") or k == "TIMESLICE_AGENT_SOCKET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert r.returncode == 0, r.stderr
    first, second, third = r.stdout.strip().splitlines()
    assert first.startswith("InvalidRequest") and "$TIMESLICE_JOB_ID" in first and "--phase-callback-path" in first
    assert second.startswith("InvalidRequest") and "$TIMESLICE_SAMPLER_GROUP" in second
    # TIMESLICE_GROUP fills the role not named: trainer 't', sampler 'g'
    assert third == "groups {'trainer': ('t',), 'sampler': ('g',), 'both': ('g', 't')} False j", third


def test_import_timeslice_client_does_not_import_the_slime_integration() -> None:
    code = (
        "import sys, timeslice_client; "
        "print(sorted(m for m in sys.modules if m.startswith('timeslice_client.integrations')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


# --------------------------------------------------------------------------- part two: the reference's package


@pytest.fixture
async def shim(nats_url: str, orchestrator: Orchestrator) -> AsyncIterator[OrchestratorGrpcShim]:
    s = OrchestratorGrpcShim(
        GrpcConfig(host="127.0.0.1", port=0, lease_s=10, liveness_interval_s=0.2), nats_url=nats_url
    )
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


REF_STEPS = 3
REF_ARGS = {"steps": REF_STEPS, "size": 4096, "gen_s": 0.1, "train_s": 0.1, "sync_s": 0.02}
LOCK_LINE = re.compile(r"^\[timeslice\] job=(\S+) (ACQUIRE|RELEASE) role=(trainer|sampler) group=(\S+)")


def lock_lines(stdout: str) -> list[tuple[str, str]]:
    """The (ACQUIRE/RELEASE, role) lines the reference package prints for each call it makes."""
    return [(m[2], m[3]) for line in stdout.splitlines() if (m := LOCK_LINE.match(line))]


def sync_driver_calls(steps: int) -> list[tuple[str, str]]:
    """The calls of the reference package for the synchronous driver without evals: init (both: trainer first),
    then per step generate (sampler), train (trainer), weight sync (both); each phase's end releases what it took,
    sampler first."""
    both = [("ACQUIRE", "trainer"), ("ACQUIRE", "sampler"), ("RELEASE", "sampler"), ("RELEASE", "trainer")]
    step = [("ACQUIRE", "sampler"), ("RELEASE", "sampler"), ("ACQUIRE", "trainer"), ("RELEASE", "trainer"), *both]
    return both + step * steps


def overlaps(work: dict[str, list[list[Any]]], pool: str) -> list[str]:
    """Intervals of one pool during which both jobs' actors worked on it."""
    spans = sorted((t0, t1, job) for job, w in work.items() for p, _, t0, t1 in w if p == pool)
    bad = []
    for (a0, a1, ja), (b0, b1, jb) in itertools.pairwise(spans):
        if ja != jb and b0 < a1:
            bad.append(f"{pool}: {ja} [{a0:.3f}, {a1:.3f}] and {jb} [{b0:.3f}, {b1:.3f}]")
    return bad


@pytest.mark.parametrize("service", ["accelerator_orchestrator", "timeslice_orchestrator"])
async def test_the_reference_slime_package_works_unchanged_over_our_grpc_api(
    tmp_path: Path, nats_url: str, shim: OrchestratorGrpcShim, service: str
) -> None:
    """Two slime jobs with the reference's ``timeslice_slime`` callback, each its own process with the reference's
    environment, share the trainers and samplers pools through our gRPC shim: both finish, their actors never
    worked on a pool at once, each made exactly the reference's calls, and each reached the state it reaches
    without timeslice. ``service``: the reference client's stub (the older name it binds, or the renamed one)."""
    groups = {"trainer": "trainers", "sampler": "samplers"}
    seeds = {"ref-a": 1, "ref-b": 2}
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TIMESLICE_") or k in ("TIMESLICE_AGENT_SOCKET", "TIMESLICE_REFERENCE_PATH")
    }
    base.update(
        PYTHONPATH=os.pathsep.join(sys.path),
        TIMESLICE_ORCH_ADDR=f"127.0.0.1:{shim.port}",
        TIMESLICE_TRAINER_GROUP=groups["trainer"],
        TIMESLICE_SAMPLER_GROUP=groups["sampler"],
        TIMESLICE_REFERENCE_SERVICE=service,
    )
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in REF_ARGS.items()]
    since = int(time.time() * 1000)
    procs = {}
    for job, seed in seeds.items():
        procs[job] = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.workers.slime_reference_job",
            "--out",
            str(tmp_path / f"{job}.json"),
            f"--seed={seed}",
            *extra,
            cwd=ROOT,
            env=dict(base, TIMESLICE_JOB_ID=job),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    try:
        outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs.values())), JOB_TIMEOUT_S)
    finally:
        for p in procs.values():
            if p.returncode is None:
                p.kill()
                await p.wait()
    until = int(time.time() * 1000)
    stdout = {}
    for (job, p), (out, err) in zip(procs.items(), outs, strict=True):
        assert p.returncode == 0, f"{job} exited {p.returncode}:\n{err.decode(errors='replace')[-3000:]}"
        stdout[job] = out.decode()
    results = {job: json.loads((tmp_path / f"{job}.json").read_text()) for job in seeds}
    used = results["ref-a"]["used"]
    print(f"\nreference slime package over {service}: {used}; callback {results['ref-a']['callback']}")
    if os.environ.get("TIMESLICE_REFERENCE_REQUIRED"):
        assert used["timeslice"] == used["timeslice_slime"] == "real", used

    for job, seed in seeds.items():
        calls = lock_lines(stdout[job])
        if used["timeslice_slime"] == "stand-in":
            assert calls == sync_driver_calls(REF_STEPS), (job, calls)
        held: set[str] = set()
        for op, role in calls:  # whatever its version: trainer first, never twice, nothing left held
            if op == "ACQUIRE":
                assert role not in held and not (role == "trainer" and "sampler" in held), (job, calls)
                held.add(role)
            else:
                held.discard(role)
        assert held == set() and len(calls) >= 4 * (REF_STEPS + 1), (job, calls)
        args = slime.Args(num_rollout=REF_STEPS, seed=seed, size=REF_ARGS["size"], gen_s=0.0, train_s=0.0, sync_s=0.0)
        alone = await asyncio.to_thread(plain, args, slime.train)
        assert results[job]["digest"] == alone.digest, f"{job}: state differs from plain"
    work = {job: r["work"] for job, r in results.items()}
    assert overlaps(work, "trainer") == [] and overlaps(work, "sampler") == []
    for group in groups.values():
        n, faults, violations = await handoffs(nats_url, group, since, until)
        assert n >= 1 and faults == 0 and violations == 0, (group, n, faults, violations)
    with OrchestratorClient(f"127.0.0.1:{shim.port}") as c:
        for group in groups.values():  # nothing held, nobody waiting: every hold was given back
            g = (await asyncio.to_thread(c.get_status, group)).group
            assert g.locking_job == "" and g.waiter_queue_depth == 0, g
