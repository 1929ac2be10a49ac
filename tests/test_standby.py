"""Two orchestrators on one bus: one leads, the other stands by (leader election through KV ``leader``), and the
leadership term fences every record write (KV ``groups`` key ``_term``), so a deposed or paused leader can store
nothing and a second orchestrator started by mistake is a standby, never a zombie.

Before this, a second orchestrator was not detected: the newcomer took the durable consumer while the first kept
running, and with one of two killed and restarted during continuous handoffs every run showed duplicate epochs and
epoch order breaks, and one in three an overlapping hold."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from pathlib import Path

import pytest
from timeslice_client import AsyncTimeSliceClient, GroupState, TimeSliceClient
from timeslice_client.bus import connect
from timeslice_orchestrator._leadership import holder_pid, read_leader
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .agent_harness import timeslice
from .conftest import OrchestratorProcess
from .helpers import eventually, eventually_sync, running, strike_point
from .workers import check_exclusive_holds, fold_checked, holds, looping_worker, read_stream


async def _leader_pid(nats_url: str) -> int | None:
    nc = await connect(nats_url)
    try:
        return holder_pid(await read_leader(nc.jetstream()))
    finally:
        await nc.close()


async def test_a_second_orchestrator_stands_by_and_takes_over_at_once_on_shutdown(nats_url: str) -> None:
    first = Orchestrator(OrchestratorConfig(nats_url=nats_url, instance_id="first"))
    second = Orchestrator(OrchestratorConfig(nats_url=nats_url, instance_id="second"))
    async with running(first):
        task = asyncio.get_running_loop().create_task(second.run())
        try:
            await eventually(second.connected.is_set, what="the second one is connected")
            async with AsyncTimeSliceClient("a", "sb1", nats_url) as a, AsyncTimeSliceClient("b", "sb1", nats_url) as b:
                ga = await a.acquire(timeout=10)
                wait = asyncio.create_task(b.acquire(timeout=10))
                await a.release()
                gb = await wait
                assert gb.epoch == ga.epoch + 1
                assert first.ready.is_set() and not second.ready.is_set(), "exactly one leads"
                assert first.metrics.leading == 1 and second.metrics.leading == 0
                # b holds; the leader stops: it stores what it decided, resigns, and the standby takes over at once.
                t0 = time.monotonic()
                first.shutdown()
                await asyncio.wait_for(second.ready.wait(), 5)
                took = time.monotonic() - t0
                print(f"\nhandover on shutdown: {took * 1000:.0f} ms")
                assert took < 1.0  # 0.3 s is the benchmark's goal (bench/failover.py); this is a shared machine
                rc, out = await timeslice(nats_url, "status")
                assert rc == 0 and "leader: second (term" in out, out
                wait = asyncio.create_task(a.acquire(timeout=10))
                await b.release()
                ga2 = await wait
                assert ga2.epoch == gb.epoch + 1, "the new leader goes on from the stored records"
                await a.release()
        finally:
            second.shutdown()
            await asyncio.wait_for(task, 20)


JOBS = {"s1": "sync", "s2": "async", "s3": "async"}
ROUNDS = 150
KILLS = 6


@pytest.mark.slow
def test_two_orchestrators_killed_paused_and_stopped_during_handoffs_never_break_the_lock(
    tmp_path: Path, nats_url: str
) -> None:
    """Two orchestrator processes; jobs hand a group around; the leader is SIGKILLed (and started again as a
    standby) several times, SIGSTOPped past its lease and resumed once, and SIGTERMed once. Afterwards: every
    round of every job was granted once, holds never overlapped, epochs rise one by one, the stream folds through
    the core without a violation, and the paused leader is alive and standing by, not a zombie."""
    seed = int(os.environ.get("TIMESLICE_STANDBY_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    procs = [OrchestratorProcess(nats_url, tmp_path / f"orchestrator-{i}.log") for i in range(2)]
    group = "standby"
    total = ROUNDS * len(JOBS)
    workers = [
        looping_worker(tmp_path, nats_url, group, job, client=kind, rounds=ROUNDS, hold_ms=rng.choice([0, 1, 2]))
        for job, kind in JOBS.items()
    ]
    faults: list[str] = []
    paused: OrchestratorProcess | None = None
    resumes: list[float] = []  # seconds from a fault to the next grant

    def progress() -> int:
        return sum(len(w.events("granted")) for w in workers)

    def finished() -> bool:
        return all(w.proc.poll() is not None for w in workers)

    def context() -> str:
        return f"seed={seed} faults={faults} " + " | ".join(w.describe() for w in workers)

    def leader() -> OrchestratorProcess:
        def live() -> OrchestratorProcess | None:  # the key may still name a killed leader until its TTL ends
            pid = asyncio.run(_leader_pid(nats_url))
            return next((p for p in procs if p.proc is not None and p.proc.pid == pid), None)

        return eventually_sync(live, timeout=20, what="a live leader")

    def resumed(at: int, t0: float) -> None:
        eventually_sync(lambda: progress() > at or finished(), timeout=30, what=f"grants resume ({context()})")
        resumes.append(round(time.monotonic() - t0, 3))

    try:
        procs[0].start()
        procs[0].wait_ready()
        procs[1].start()  # by mistake or for availability: a standby
        eventually_sync(lambda: all(w.last("ready") for w in workers), timeout=30, what="workers connected")
        for w in workers:
            w.usr1()
        plan = ["kill"] * KILLS + ["stop", "term"]
        rng.shuffle(plan)
        width = total // (len(plan) + 2)
        for i, fault in enumerate(plan):
            target = (i + 1) * width
            if not strike_point(lambda t=target: progress() >= t, finished, rng, f"handoffs go on ({context()})"):
                break
            p = leader()
            at, t0 = progress(), time.monotonic()
            assert p.proc is not None
            if fault == "kill":
                p.kill()
                resumed(at, t0)
                p.start()  # back as a standby
            elif fault == "term":
                p.stop()  # SIGTERM: hands over at once
                resumed(at, t0)
                p.start()
            else:
                os.kill(p.proc.pid, signal.SIGSTOP)
                try:
                    resumed(at, t0)  # the other one took over while this one is paused
                    other = next(q for q in procs if q is not p)
                    eventually_sync(
                        lambda o=other: asyncio.run(_leader_pid(nats_url)) == o.proc.pid,  # type: ignore
                        timeout=20,
                        what="the standby leads",
                    )
                finally:
                    os.kill(p.proc.pid, signal.SIGCONT)
                paused = p
            faults.append(fault)
        for w in workers:
            assert w.wait(120) == 0, context()
            assert not w.errors(), context()
        assert all(p.proc is not None and p.proc.poll() is None for p in procs), "an orchestrator died on its own"
        hs = holds(workers)
        assert len(hs) == total, context()
        check_exclusive_holds(hs)
        assert [h.epoch for h in hs] == list(range(1, total + 1)), f"epochs repeated or skipped: {context()}"
        with TimeSliceClient("observer", "observer", nats_url) as obs:
            eventually_sync(lambda: obs.status(group).state is GroupState.IDLE_YIELDED, timeout=20, what="idle")
        stream = asyncio.run(read_stream(nats_url))
        checker = fold_checked(stream, context)
        st = checker.stats[group]
        assert st.grants == st.fold_grants == st.max_epoch == total, context()
        # The paused leader came back as a standby: alive, not leading, and it said why it stopped.
        if paused is not None:
            assert paused.proc is not None and paused.proc.poll() is None
            assert "term ends" in paused.log_path.read_text(), "the resumed leader did not notice it was deposed"
        print(f"\nstandby test: seed={seed} handoffs={total} faults={faults} resume_s={resumes}")
    finally:
        for w in workers:
            w.close()
        for p in procs:
            with contextlib.suppress(Exception):
                if p.proc is not None and p.proc.poll() is None:
                    os.kill(p.proc.pid, signal.SIGCONT)
                p.stop()


async def test_the_standby_serves_the_grpc_api_too(nats_url: str) -> None:
    """The gRPC API forwards to the bus, so a standby's serves calls as well as the leader's: every replica is
    ready behind a load balancer (deploy/k8s), and a call that lands on the standby is decided by the leader."""
    from timeslice_orchestrator.grpc_shim import GrpcConfig, OrchestratorGrpcShim, run_beside

    from .grpc_proto_client import OrchestratorClient

    leader = Orchestrator(OrchestratorConfig(nats_url=nats_url, instance_id="leader"))
    standby = Orchestrator(OrchestratorConfig(nats_url=nats_url, instance_id="standby"))
    shim = OrchestratorGrpcShim(GrpcConfig(host="127.0.0.1", port=0), nats_url=nats_url)
    async with running(leader):
        task = asyncio.get_running_loop().create_task(run_beside(standby, shim))
        try:
            await asyncio.wait_for(shim.started.wait(), 20)
            assert standby.connected.is_set() and not standby.ready.is_set(), "it serves gRPC as a standby"
            with OrchestratorClient(f"127.0.0.1:{shim.port}", group_id="sb-grpc") as c:
                granted = await asyncio.to_thread(c.acquire, "job-g", "sb-grpc", 20)
                assert granted is not None
                rec = await eventually(lambda: _held(nats_url, "sb-grpc", "job-g"), what="the leader granted it")
                assert rec
        finally:
            standby.shutdown()
            await asyncio.wait_for(task, 20)


async def _held(nats_url: str, group: str, job: str) -> bool:
    async with AsyncTimeSliceClient("observer", group, nats_url) as obs:
        rec = await obs.status()
        return rec.holder is not None and rec.holder.job == job
