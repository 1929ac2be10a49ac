"""Read-your-writes ``status()``: the orchestrator answers a job first and stores the group's record after, so a read
made right after an answer could find the record from before the call. ``status()`` waits (bounded) until the
record reflects the stream sequence of this client's last call, here with the orchestrator's record writes slowed
at their one seam (``RecordStore.store``) so that the lag is certain, not a matter of luck: the async client, the
blocking facade and the gRPC shim; and the bounded wait's end, which returns the freshest record marked ``stale``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from timeslice_client import AcquireTimeout, AsyncTimeSliceClient, GroupState, TimeSliceClient
from timeslice_client.protocol import NOTICE_SEQ_HEADER, Cancel, Granted, decode_notice, subjects
from timeslice_orchestrator._records import RecordStore
from timeslice_orchestrator.core import apply
from timeslice_orchestrator.grpc_shim import STALE_METADATA, OrchestratorGrpcShim
from timeslice_orchestrator.service import Orchestrator

from .agent_harness import queued
from .core_sim import G, Sim
from .grpc_helpers import call, orchestrator_shim
from .grpc_proto_client import OrchestratorClient
from .helpers import eventually

ROUNDS = 5
WRITE_DELAY_S = 0.05  # each record write waits this long first: far longer than a status read takes


@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Every record write of the orchestrator waits ``WRITE_DELAY_S`` before it is sent; while the returned event is
    cleared, writes wait for it as well (the timeout test holds them back)."""
    flowing = asyncio.Event()
    flowing.set()
    store = RecordStore.store

    async def slow_store(self: RecordStore, group: str, rec: Any) -> int:
        await asyncio.sleep(WRITE_DELAY_S)  # the seam: a write behind the answer that is late, on purpose
        await flowing.wait()
        return await store(self, group, rec)

    monkeypatch.setattr(RecordStore, "store", slow_store)
    return flowing


@pytest.fixture
async def slow_orchestrator(slow_writes: asyncio.Event, orchestrator: Orchestrator) -> Orchestrator:
    return orchestrator


async def test_status_after_release_and_grant_reflects_the_call(slow_orchestrator: Orchestrator, nats_url: str) -> None:
    """Round after round: a job's status right after its grant names it the holder, right after its release names
    nobody; with another job waiting, the release hands over and each job's status reflects its own call."""
    async with (
        AsyncTimeSliceClient("a", "g-ryw", nats_url, bind_process=False) as a,
        AsyncTimeSliceClient("b", "g-ryw", nats_url, bind_process=False) as b,
    ):
        for _ in range(ROUNDS):
            g = await a.acquire(timeout=10)
            st = await a.status()
            assert st.holder is not None and (st.holder.job, st.holder.epoch) == ("a", g.epoch), st
            assert not st.stale
            await a.release()
            st = await a.status()
            assert st.holder is None and st.state is GroupState.IDLE_YIELDED and not st.stale, st
        for _ in range(ROUNDS):
            await a.acquire(timeout=10)
            b_waits = asyncio.create_task(b.acquire(timeout=10))
            await eventually(queued(a, "g-ryw", "b"), what="b waits")  # b's write: a reads it once it is stored
            await a.release()
            st = await a.status()
            assert st.holder is None or st.holder.job != "a", st
            gb = await b_waits
            st = await b.status()
            assert st.holder is not None and (st.holder.job, st.holder.epoch) == ("b", gb.epoch), st
            await b.release()
            st = await b.status()
            assert st.holder is None and not st.stale, st


async def test_status_after_an_acquire_timeout_no_longer_shows_the_wait(
    slow_orchestrator: Orchestrator, nats_url: str
) -> None:
    """The wait withdrawn at the client's timeout (a cancel) is reflected too, whether the cancel or the
    orchestrator's own deadline ended it."""
    async with (
        AsyncTimeSliceClient("a", "g-ryw-t", nats_url, bind_process=False) as a,
        AsyncTimeSliceClient("b", "g-ryw-t", nats_url, bind_process=False) as b,
    ):
        await a.acquire(timeout=10)
        for _ in range(ROUNDS):
            with pytest.raises(AcquireTimeout):
                await b.acquire(timeout=0.2)
            st = await b.status()
            assert "b" not in [w.job for w in st.waiters] and st.holder is not None and not st.stale, st
        await a.release()


async def test_status_of_another_group_of_the_job_reflects_its_calls(
    slow_orchestrator: Orchestrator, nats_url: str
) -> None:
    async with AsyncTimeSliceClient("a", "g-ryw-1", nats_url, bind_process=False) as a:
        for _ in range(ROUNDS):
            await a.acquire_all(["g-ryw-1", "g-ryw-2"], timeout=10)
            st = await a.status("g-ryw-2")
            assert st.holder is not None and st.holder.job == "a", st
            await a.release_all()
            st = await a.status("g-ryw-2")
            assert st.holder is None, st


async def test_the_blocking_facade_reads_its_writes(slow_orchestrator: Orchestrator, nats_url: str) -> None:
    def rounds() -> None:
        with TimeSliceClient("s", "g-ryw-sync", nats_url, bind_process=False) as s:
            for _ in range(ROUNDS):
                with s.on_accelerators(timeout=10) as g:
                    st = s.status()
                    assert st.holder is not None and (st.holder.job, st.holder.epoch) == ("s", g.epoch), st
                st = s.status()
                assert st.holder is None and st.state is GroupState.IDLE_YIELDED, st

    await asyncio.to_thread(rounds)


@pytest.fixture
async def shim(nats_url: str, slow_orchestrator: Orchestrator) -> AsyncIterator[OrchestratorGrpcShim]:
    async with orchestrator_shim(nats_url) as s:
        yield s


@pytest.fixture
def grpc_client(shim: OrchestratorGrpcShim) -> Iterator[OrchestratorClient]:
    with OrchestratorClient(f"127.0.0.1:{shim.port}", group_id="g-ryw-grpc") as c:
        yield c


async def test_get_group_status_reflects_the_callers_acquire_and_yield(grpc_client: OrchestratorClient) -> None:
    c = grpc_client
    for _ in range(ROUNDS):
        assert (await call(c.acquire, "job-a", timeout=10)).success
        st = (await call(c.get_status)).group
        assert st.locking_job == "job-a", st
        assert (await call(c.release, "job-a")).success
        st = (await call(c.get_status)).group
        assert st.locking_job == "" and st.active_job == "job-a", st


async def test_a_record_that_never_catches_up_is_returned_stale_within_the_wait(
    slow_writes: asyncio.Event, slow_orchestrator: Orchestrator, nats_url: str
) -> None:
    """Writes held back: the read gives up after ``wait_s`` and returns the freshest record, marked ``stale``; once
    they flow again, the next read is current."""
    async with AsyncTimeSliceClient("a", "g-ryw-stale", nats_url, bind_process=False) as a:
        await a.acquire(timeout=10)
        await a.release()
        assert not (await a.status()).stale
        slow_writes.clear()
        try:
            await a.acquire(timeout=10)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            st = await a.status(wait_s=0.3)
            assert 0.3 <= loop.time() - t0 < 2.0
            assert st.stale and st.holder is None, st  # the record from before the grant
        finally:
            slow_writes.set()
        st = await a.status()
        assert not st.stale and st.holder is not None and st.holder.job == "a", st
        await a.release()


async def test_get_group_status_says_stale_in_its_trailing_metadata(
    slow_writes: asyncio.Event, slow_orchestrator: Orchestrator, nats_url: str
) -> None:
    async with orchestrator_shim(nats_url, request_timeout_s=0.3) as shim:
        with OrchestratorClient(f"127.0.0.1:{shim.port}", group_id="g-ryw-grpc-stale") as c:
            assert (await call(c.acquire, "job-a", timeout=10)).success
            assert (await call(c.release, "job-a")).success
            req = c.pb.GetGroupStatusRequest(group_id=c.group_id)
            _, done = await call(c.stub.GetGroupStatus.with_call, req, timeout=10)
            assert STALE_METADATA not in dict(done.trailing_metadata())
            slow_writes.clear()
            try:
                assert (await call(c.acquire, "job-a", timeout=10)).success  # answered; its record held back
                reply, done = await call(c.stub.GetGroupStatus.with_call, req, timeout=10)
                assert dict(done.trailing_metadata()).get(STALE_METADATA) == "true"
                assert reply.group.locking_job == "", reply  # the freshest record: from before the acquire
            finally:
                slow_writes.set()
            assert (await call(c.get_status)).group.locking_job == "job-a"
            assert (await call(c.release, "job-a")).success


async def test_a_notice_carries_the_sequence_of_the_input_that_decided_it(
    orchestrator: Orchestrator, nats_url: str
) -> None:
    """The grant's header names the stream sequence of the acquire that decided it; its record reflects that."""
    async with AsyncTimeSliceClient("a", "g-ryw-h", nats_url, bind_process=False) as a:
        assert a._nc is not None
        sub = await a._nc.subscribe(subjects.notice("g-ryw-h", "a"))
        await a.acquire(timeout=10)
        msg = await sub.next_msg(timeout=5)
        assert isinstance(decode_notice(msg.data), Granted) and msg.headers is not None
        seq = int(msg.headers[NOTICE_SEQ_HEADER])
        assert a._read_floor == seq
        rec = await a.status()
        assert rec.holder is not None and not rec.stale
        await sub.unsubscribe()
        await a.release()


def test_a_cancel_of_a_wait_that_had_ended_is_still_recorded() -> None:
    """Nothing changes, but the record moves to the cancel's sequence: a client that withdrew a wait the orchestrator
    had already ended waits for its cancel's record in status(), and would otherwise wait in vain."""
    sim = Sim()
    sim.acquire("a")
    rec = sim.rec
    new, actions = apply(rec, Cancel(group=G, job="b", request_id="gone", reason="timeout"), sim.now, sim.seq + 1)
    assert actions == [] and new.last_seq == sim.seq + 1
    assert new.holder == rec.holder and new.queue == rec.queue and new.state is rec.state
