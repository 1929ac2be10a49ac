"""Several groups at once through the real stack (timeslice issue 28, item 1): ``acquire_all``, ``release_all`` and
``on_accelerators(groups=...)``, against a real nats-server and the orchestrator (in this test's loop; the blocking
client's tests: as a real process).

A disaggregated RL job holds a trainer pool and a sampler pool, and its weight sync needs both at once. Two such
jobs listing the pools in opposite orders must never deadlock; a call that fails must leave nothing held or queued;
a job that holds one pool and asks for one that sorts before it is refused at once (docs/multi-pool.md)."""

from __future__ import annotations

import asyncio
import collections
import re
import threading
from pathlib import Path

import pytest
from timeslice_agent import Agent, AgentConfig
from timeslice_client import (
    AcquireAllFailed,
    AcquireAllTimeout,
    AcquireTimeout,
    AsyncTimeSliceClient,
    GroupRecord,
    InvalidRequest,
    LockOrderError,
    TimeSliceClient,
)
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .agent_harness import Recorder
from .helpers import eventually, eventually_sync, group_record, group_record_sync, running

ROUNDS = 12  # rounds of the opposite-order race (each round both jobs start together)
BOTH = ("sampler", "trainer")  # the order every job takes them in: sorted ids


def _job_free(rec: GroupRecord, job: str) -> bool:
    """The record shows ``job`` neither holding nor waiting for the group (nor being switched in)."""
    to = rec.switch.to.job if rec.switch is not None and rec.switch.to is not None else None
    return (rec.holder is None or rec.holder.job != job) and job not in {w.job for w in rec.queue} and to != job


# --------------------------------------------------------------------------- the deadlock the issue describes


async def _race(a: AsyncTimeSliceClient, b: AsyncTimeSliceClient, orders: dict[str, list[str]]) -> list[str]:
    """Both jobs, ``ROUNDS`` times: start together, take both pools (each listing them in its own order), check no
    one else is inside, give them back. Returns who got in, in order."""
    barrier = asyncio.Barrier(2)
    inside: collections.Counter[str] = collections.Counter()
    got: list[str] = []

    async def job(c: AsyncTimeSliceClient) -> None:
        for _ in range(ROUNDS):
            await asyncio.wait_for(barrier.wait(), 30)
            grants = await c.acquire_all(orders[c.job_id], timeout=10)
            assert list(grants) == list(BOTH) and c.held_groups == BOTH
            for g in BOTH:
                inside[g] += 1
            assert max(inside.values()) == 1, f"two jobs inside at once: {inside}"
            got.append(c.job_id)
            await c.status("trainer")  # a round trip: the other job's acquires run meanwhile (and must not get in)
            for g in BOTH:
                inside[g] -= 1
            released = await c.release_all()
            assert list(released) == ["trainer", "sampler"] and c.held_groups == ()
            assert [r.epoch for r in released.values()] == [grants["trainer"].epoch, grants["sampler"].epoch]

    async with asyncio.timeout(120):
        await asyncio.gather(job(a), job(b))
    return got


@pytest.mark.usefixtures("orchestrator")
async def test_two_jobs_taking_both_pools_in_opposite_orders_never_deadlock(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "trainer", nats_url) as a, AsyncTimeSliceClient("b", "sampler", nats_url) as b:
        got = await _race(a, b, {"a": ["trainer", "sampler"], "b": ["sampler", "trainer"]})
    assert sorted(got) == ["a"] * ROUNDS + ["b"] * ROUNDS


# --------------------------------------------------------------------------- what a failure leaves


@pytest.mark.usefixtures("orchestrator")
async def test_a_timeout_on_the_second_group_releases_the_first_and_withdraws_the_wait(nats_url: str) -> None:
    async with (
        AsyncTimeSliceClient("a", "trainer", nats_url) as a,
        AsyncTimeSliceClient("c", "trainer", nats_url) as c,
        AsyncTimeSliceClient("d", "sampler", nats_url) as d,
    ):
        await c.acquire(timeout=10)  # the trainer pool is busy
        with pytest.raises(AcquireAllTimeout) as info:
            await a.acquire_all(["trainer", "sampler"], timeout=1.0)  # sampler first (sorted), then trainer
        e = info.value
        assert isinstance(e, AcquireTimeout) and isinstance(e, TimeoutError) and isinstance(e, AcquireAllFailed)
        assert (e.job_id, e.groups, e.group_id, e.released, e.kept) == ("a", BOTH, "trainer", ("sampler",), ())
        assert e.timeout_s == 1.0 and isinstance(e.error, AcquireTimeout) and e.__cause__ is e.error
        assert "'trainer'" in str(e) and "released what the call took ('sampler')" in str(e)
        assert a.held_groups == () and not a.holding
        # the records: a neither holds nor waits for either pool
        for g in BOTH:
            await eventually(lambda g=g: _job_free_of(a, g, "a"), what=f"{g}'s record shows nothing of a")
        # nothing of a is queued: c's release finds nobody waiting, and the sampler pool is free at once
        assert (await c.release()).pending_waiters == 0
        assert (await d.acquire(timeout=2)).epoch >= 1


async def _job_free_of(c: AsyncTimeSliceClient, group: str, job: str) -> bool:
    return _job_free(await group_record(c, group), job)


@pytest.mark.usefixtures("orchestrator")
async def test_a_cancelled_acquire_all_leaves_nothing_held_or_queued(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "sampler", nats_url) as a, AsyncTimeSliceClient("c", "trainer", nats_url) as c:
        await c.acquire(timeout=10)
        call = asyncio.ensure_future(a.acquire_all(BOTH, timeout=30))
        await eventually(lambda: _waits(c, "trainer", "a"), what="a holds the sampler pool, waits for the trainer")
        assert a.held_groups == ("sampler",)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert a.held_groups == ()
        for g in BOTH:
            await eventually(lambda g=g: _job_free_of(c, g, "a"), what=f"{g}'s record shows nothing of a")
        assert (await c.release()).pending_waiters == 0


@pytest.mark.usefixtures("orchestrator")
async def test_a_refusal_at_the_second_group_releases_the_first(nats_url: str) -> None:
    """A refusal (here: a lease the orchestrator takes as out of range, said by the group's own error) is an
    ``AcquireAllFailed`` carrying that error, raised after the first group went back."""
    async with AsyncTimeSliceClient("a", "sampler", nats_url) as a:
        sibling = await a._groups.member("trainer")
        sibling.lease_ms = 10 * 24 * 3600 * 1000  # over the orchestrator's bound: refused as invalid
        with pytest.raises(AcquireAllFailed) as info:
            await a.acquire_all(BOTH, timeout=10)
        e = info.value
        assert not isinstance(e, AcquireTimeout)
        assert (e.group_id, e.released) == ("trainer", ("sampler",)) and isinstance(e.error, InvalidRequest)
        assert a.held_groups == ()
        await eventually(lambda: _job_free_of(a, "sampler", "a"), what="the sampler pool went back")


@pytest.mark.usefixtures("orchestrator")
async def test_a_job_waits_for_one_group_at_a_time(nats_url: str) -> None:
    """Acquires of one client take turns: while its acquire_all waits for the trainer pool, another call of the same
    job waits for its turn (within its own timeout) instead of waiting for a second group at the same time."""
    async with AsyncTimeSliceClient("a", "sampler", nats_url) as a, AsyncTimeSliceClient("c", "trainer", nats_url) as c:
        await c.acquire(timeout=10)
        call = asyncio.ensure_future(a.acquire_all(BOTH, timeout=30))
        await eventually(lambda: _waits(c, "trainer", "a"), what="a waits for the trainer pool")
        with pytest.raises(AcquireAllTimeout) as info:
            await a.acquire_all(["zeta"], timeout=0.3)
        assert (info.value.group_id, info.value.released) == ("zeta", ())
        rec = await group_record(c, "zeta")
        assert rec.epoch == 0 and not rec.queue, "the job waited for a second group at once"
        await c.release()
        assert list(await call) == list(BOTH)
        assert list(await a.release_all()) == ["trainer", "sampler"]


async def _waits(c: AsyncTimeSliceClient, group: str, job: str) -> bool:
    return job in {w.job for w in (await group_record(c, group)).queue}


# --------------------------------------------------------------------------- the order rule


@pytest.mark.usefixtures("orchestrator")
async def test_a_job_holding_a_pool_that_sorts_after_is_refused_at_once(nats_url: str) -> None:
    """The issue's deadlock: a job holds the trainer pool and asks for the sampler pool (which sorts before it).
    Refused before anything is sent, keeping what it holds; the order that sorts after is fine."""
    async with AsyncTimeSliceClient("a", "trainer", nats_url) as a, AsyncTimeSliceClient("s", "sampler", nats_url) as s:
        g = await a.acquire(timeout=10)
        for call in (lambda: a.acquire_all(["sampler"], timeout=10), lambda: a.acquire_all(BOTH, timeout=10)):
            with pytest.raises(LockOrderError) as info:
                await call()
            assert (info.value.job_id, info.value.group_id, info.value.held) == ("a", "sampler", ("trainer",))
            assert "acquire_all(['sampler', 'trainer'])" in str(info.value) and "Release 'trainer'" in str(info.value)
        assert a.holding and a.epoch == g.epoch and a.held_groups == ("trainer",)
        rec = await group_record(s, "sampler")
        assert rec.epoch == 0 and not rec.queue, "a refused ask reached the orchestrator"
        # held groups in the list are kept as they are (no wait): the call takes the rest
        grants = await a.acquire_all(["trainer"], timeout=10)
        assert grants["trainer"].epoch == g.epoch
        await a.release()
        # the other way round is the order: sampler held, then trainer
        async with AsyncTimeSliceClient("b", "sampler", nats_url) as b:
            await b.acquire(timeout=10)
            grants = await b.acquire_all(BOTH, timeout=10)
            assert list(grants) == list(BOTH) and b.held_groups == BOTH
            # ... and the client's own acquire() of a group below one it holds is refused too
            await b.release()
            with pytest.raises(LockOrderError):
                await b.acquire(timeout=10)
            assert b.held_groups == ("trainer",)
            assert list(await b.release_all()) == ["trainer"]


@pytest.mark.usefixtures("orchestrator")
async def test_bounds_and_mistakes_are_refused_before_anything_is_sent(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "g0", nats_url) as a:
        with pytest.raises(InvalidRequest, match="list of ids"):
            await a.acquire_all("g0")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="1 to 16"):
            await a.acquire_all([])
        with pytest.raises(InvalidRequest, match="1 to 16"):
            await a.acquire_all([f"g{i}" for i in range(17)])
        assert a.held_groups == () and await a.release_all() == {}
        grants = await a.acquire_all(["g0", "g0"], timeout=10)  # once each
        assert list(grants) == ["g0"] and a.holding


# --------------------------------------------------------------------------- scopes


@pytest.mark.usefixtures("orchestrator")
async def test_scopes_of_several_groups_nest_per_group(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "sampler", nats_url) as a, AsyncTimeSliceClient("t", "trainer", nats_url) as t:

        @a.on_accelerators(timeout=10, groups=["trainer", "sampler"])
        async def weight_sync() -> tuple[str, ...]:
            return a.held_groups

        async with a.on_accelerators(timeout=10) as own:  # the sampler pool alone
            assert a.held_groups == ("sampler",)
            async with a.on_accelerators(timeout=10, groups=BOTH) as grants:
                assert grants["sampler"] == own and a.held_groups == BOTH
                assert await weight_sync() == BOTH  # nested: a no-op of the outer scopes
                assert a.held_groups == BOTH
            assert a.held_groups == ("sampler",), "the inner scope did not give back only what it took"
        assert a.held_groups == ()
        assert await weight_sync() == BOTH and a.held_groups == ()
        # a scope holding the trainer pool cannot open one that also needs the sampler pool (it sorts before)
        async with t.on_accelerators(timeout=10):
            with pytest.raises(LockOrderError):
                async with t.on_accelerators(timeout=10, groups=BOTH):
                    pytest.fail("entered against the order")
            assert t.held_groups == ("trainer",)
        assert t.held_groups == ()


# --------------------------------------------------------------------------- workloads of another group


async def test_a_workload_of_another_group_is_switched_with_that_group(nats_url: str) -> None:
    """``register_workload(group_id=...)``: the sampler's state (a handler on the sampler node) is suspended when
    another job takes the sampler pool, through the sibling client's channel, and resumed at the next grant."""
    log: list[str] = []
    nodes = {"trainer": "node-t", "sampler": "node-s"}
    async with (
        running(Orchestrator(OrchestratorConfig(nats_url=nats_url))),
        running(Agent(AgentConfig(node_id="node-t", nats_url=nats_url))),
        running(Agent(AgentConfig(node_id="node-s", nats_url=nats_url))),
        AsyncTimeSliceClient("a", "trainer", nats_url, node_id="node-t", bind_process=False) as a,
        AsyncTimeSliceClient("b", "sampler", nats_url, node_id="node-s", bind_process=False) as b,
    ):
        await a.register_workload(Recorder("a-trainer", log), node_id=nodes["trainer"])
        await a.register_workload(Recorder("a-sampler", log), node_id=nodes["sampler"], group_id="sampler")
        await b.register_workload(Recorder("b", log), node_id=nodes["sampler"])
        await a.acquire_all(BOTH, timeout=10)
        await a.release_all()
        await b.acquire(timeout=20)  # the sampler pool switches from a to b
        await eventually(lambda: "a-sampler:suspend" in log, what="a's sampler state suspended")
        assert "a-trainer:suspend" not in log, "the trainer pool did not switch"
        await b.release()
        await a.acquire_all(BOTH, timeout=20)
        assert log.count("a-sampler:resume") >= 1 and log.index("a-sampler:suspend") < len(log) - 1
        await a.release_all()


# --------------------------------------------------------------------------- the blocking client


@pytest.mark.usefixtures("orchestrator_process")
def test_blocking_clients_in_opposite_orders_never_deadlock(nats_url: str) -> None:
    inside: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    barrier = threading.Barrier(2, timeout=30)
    errors: list[BaseException] = []

    def job(name: str, order: list[str]) -> None:
        try:
            with TimeSliceClient(name, order[0], nats_url) as c:
                for _ in range(ROUNDS):
                    barrier.wait()
                    with c.on_accelerators(timeout=10, groups=order) as grants:
                        assert list(grants) == list(BOTH) and c.held_groups == BOTH
                        with lock:
                            inside.update(BOTH)
                            assert max(inside.values()) == 1, f"two jobs inside at once: {inside}"
                            inside.subtract(BOTH)
                    assert c.held_groups == ()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [
        threading.Thread(target=job, args=("a", ["trainer", "sampler"])),
        threading.Thread(target=job, args=("b", ["sampler", "trainer"])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not [t for t in threads if t.is_alive()], "a job never finished"
    assert not errors, errors


@pytest.mark.usefixtures("orchestrator_process")
def test_blocking_acquire_all_timeout_releases_the_first(nats_url: str) -> None:
    with TimeSliceClient("a", "sampler", nats_url) as a, TimeSliceClient("c", "trainer", nats_url) as c:
        c.acquire(timeout=10)
        with pytest.raises(AcquireAllTimeout) as info:
            a.acquire_all(["trainer", "sampler"], timeout=1.0)
        assert (info.value.group_id, info.value.released) == ("trainer", ("sampler",))
        assert a.held_groups == ()
        for g in BOTH:
            eventually_sync(
                lambda g=g: _job_free(group_record_sync(a, g), "a"), what=f"{g}'s record shows nothing of a"
            )
        assert c.release().pending_waiters == 0
        assert list(a.acquire_all(["trainer"], timeout=10)) == ["trainer"]
        with pytest.raises(LockOrderError):  # the blocking client keeps the order too: sampler sorts before trainer
            a.acquire(timeout=10)
        assert a.held_groups == ("trainer",) and not a.holding
        assert list(a.release_all()) == ["trainer"] and a.held_groups == ()


# --------------------------------------------------------------------------- the docs' example


@pytest.mark.usefixtures("orchestrator_process")
def test_the_docs_example_runs_as_written(nats_url: str) -> None:
    """docs/multi-pool.md's trainer/sampler example, run as written against a real stack."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "multi-pool.md").read_text()
    (code,) = re.findall(r"```python\n# example: disaggregated job\n(.*?)```", doc, re.S)
    scope: dict[str, object] = {"NATS_URL": nats_url}
    exec(compile(code, "docs/multi-pool.md", "exec"), scope)
    assert scope["synced"] == 3 and scope["served"] == scope["policy"] == {"version": 3}
