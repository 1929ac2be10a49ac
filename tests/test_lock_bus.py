"""The lock end to end over a real nats-server: the async and sync clients against the orchestrator."""

from __future__ import annotations

import asyncio

import pytest
from timeslice_client import (
    AcquireTimeout,
    AsyncTimeSliceClient,
    GroupState,
    InvalidId,
    NotHolder,
    StaleEpoch,
    Unavailable,
)
from timeslice_client._refusals import refusal_error
from timeslice_client.bus import connect, kv_keys
from timeslice_client.protocol import Refused, Release, decode_notice, encode, subjects
from timeslice_orchestrator.service import Orchestrator

from .helpers import eventually, group_record

pytestmark = pytest.mark.usefixtures("orchestrator")


async def test_acquire_release_and_zero_cost_reacquire(nats_url: str) -> None:
    async with AsyncTimeSliceClient("job-a", "g1", nats_url) as a:
        g = await a.acquire(timeout=10)
        assert (g.epoch, g.context_restored, g.waited_ms) == (1, False, 0)
        r = await a.release()
        assert r.pending_waiters == 0 and r.snapshot_deferred is True
        st = await eventually(lambda: _state(a, "g1", GroupState.IDLE_YIELDED))
        assert st.active_job == "job-a" and st.holder is None
        g2 = await a.acquire(timeout=10)
        assert g2.epoch == 2 and g2.context_restored is False
        await a.release()


async def _state(c: AsyncTimeSliceClient, group: str, state: GroupState):  # type: ignore[no-untyped-def]
    rec = await group_record(c, group)
    return rec if rec.state == state else None


async def test_handoff_fifo_and_status(nats_url: str) -> None:
    a = await AsyncTimeSliceClient("a", "g2", nats_url).connect()
    b = await AsyncTimeSliceClient("b", "g2", nats_url).connect()
    c = await AsyncTimeSliceClient("c", "g2", nats_url).connect()
    try:
        ga = await a.acquire(timeout=10)
        tb = asyncio.create_task(b.acquire(timeout=10))
        await eventually(lambda: _queue_is(a, ["b"]))
        tc = asyncio.create_task(c.acquire(timeout=10))
        rec = await eventually(lambda: _queue_is(a, ["b", "c"]))
        assert rec.holder is not None and rec.holder.job == "a" and rec.holder.epoch == ga.epoch
        assert rec.state == GroupState.LOCKED
        r = await a.release()
        assert r.pending_waiters == 2 and r.snapshot_deferred is False
        gb = await tb
        assert gb.epoch == ga.epoch + 1 and gb.waited_ms >= 0
        assert not tc.done()
        await b.release()
        gc = await tc
        assert gc.epoch == gb.epoch + 1
        await c.release()
        assert await a.list_groups() == ["g2"]
    finally:
        for x in (a, b, c):
            await x.close()


async def _queue_is(c: AsyncTimeSliceClient, jobs: list[str]):  # type: ignore[no-untyped-def]
    rec = await group_record(c)
    return rec if [w.job for w in rec.queue] == jobs else None


async def test_holder_reacquire_returns_same_grant(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "g3", nats_url) as a:
        g1 = await a.acquire(timeout=10)
        g2 = await a.acquire(timeout=10)
        assert g2.epoch == g1.epoch and g2.waited_ms == 0
        await a.release()


async def test_release_by_non_holder_and_stale_epoch_refused(nats_url: str, orchestrator: Orchestrator) -> None:
    async with AsyncTimeSliceClient("a", "g4", nats_url) as a, AsyncTimeSliceClient("b", "g4", nats_url) as b:
        g = await a.acquire(timeout=10)
        with pytest.raises(NotHolder) as info:
            await b.release()
        assert info.value.holder == "a"
        # A raw release with a wrong epoch, as a confused or stale client would send it.
        nc = await connect(nats_url)
        try:
            sub = await nc.subscribe(subjects.notice("g4", "a"))
            await nc.flush()
            js = nc.jetstream()
            await js.publish(
                subjects.job("g4", "a", "release"),
                encode(Release(group="g4", job="a", request_id="stale-1", epoch=g.epoch + 7)),
            )
            notice = decode_notice((await sub.next_msg(timeout=5)).data)
            assert isinstance(notice, Refused) and notice.code == "STALE_EPOCH" and notice.epoch == g.epoch
            err = refusal_error(notice, a.epoch)
            assert isinstance(err, StaleEpoch) and err.holder == "a"
        finally:
            await nc.close()
        await a.release()
        with pytest.raises(NotHolder):
            await a.release()


async def test_bad_ids_rejected_before_the_bus() -> None:
    for bad in ("", "a.b", "a b", "*", ">", "x" * 65, "-lead"):
        with pytest.raises(InvalidId):
            AsyncTimeSliceClient(bad, "g")
        with pytest.raises(InvalidId):
            AsyncTimeSliceClient("j", bad)


async def test_malformed_messages_refused_and_orchestrator_survives(nats_url: str, orchestrator: Orchestrator) -> None:
    nc = await connect(nats_url)
    try:
        sub = await nc.subscribe(subjects.notice("g5", "j"))
        await nc.flush()
        js = nc.jetstream()
        await js.publish(subjects.job("g5", "j", "acquire"), b"{not json")
        n = decode_notice((await sub.next_msg(timeout=5)).data)
        assert isinstance(n, Refused) and n.code == "INVALID" and "malformed" in n.message
        await js.publish(
            subjects.job("g5", "j", "acquire"), b'{"type":"acquire","group":"g5","job":"j","request_id":"r","bogus":1}'
        )
        n = decode_notice((await sub.next_msg(timeout=5)).data)
        assert isinstance(n, Refused) and "bogus" in n.message
        # payload and subject disagree
        await js.publish(
            subjects.job("g5", "j", "acquire"), b'{"type":"acquire","group":"other","job":"j","request_id":"r"}'
        )
        n = decode_notice((await sub.next_msg(timeout=5)).data)
        assert isinstance(n, Refused) and n.code == "INVALID"
        # a lease outside the allowed range
        await js.publish(
            subjects.job("g5", "j", "acquire"),
            b'{"type":"acquire","group":"g5","job":"j","request_id":"r2","lease_ms":5}',
        )
        n = decode_notice((await sub.next_msg(timeout=5)).data)
        assert isinstance(n, Refused) and n.code == "INVALID" and "lease_ms" in n.message
        assert orchestrator.events_rejected >= 3
    finally:
        await nc.close()
    async with AsyncTimeSliceClient("j", "g5", nats_url) as c:
        g = await c.acquire(timeout=10)
        assert g.epoch == 1
        await c.release()


async def test_acquire_timeout_withdraws_the_waiter(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "g6", nats_url) as a, AsyncTimeSliceClient("b", "g6", nats_url) as b:
        await a.acquire(timeout=10)
        with pytest.raises(AcquireTimeout) as info:
            await b.acquire(timeout=0.3)
        assert info.value.holder == "a"
        await eventually(lambda: _queue_is(a, []))
        r = await a.release()
        assert r.pending_waiters == 0
        rec = await eventually(lambda: _state(a, "g6", GroupState.IDLE_YIELDED))
        assert rec.holder is None and rec.active_job == "a"


async def test_cancelled_acquire_leaves_the_queue(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "g7", nats_url) as a, AsyncTimeSliceClient("b", "g7", nats_url) as b:
        await a.acquire(timeout=10)
        t = asyncio.create_task(b.acquire(timeout=30))
        await eventually(lambda: _queue_is(a, ["b"]))
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await eventually(lambda: _queue_is(a, []))
        await a.release()


async def test_on_accelerators_with_and_decorator_never_masks(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "g8", nats_url) as a:
        async with a.on_accelerators(timeout=10) as grant:
            assert a.holding and grant.epoch == 1
        assert not a.holding

        @a.on_accelerators(timeout=10)
        async def step(x: int) -> int:
            assert a.holding
            return x * 2

        assert await step(21) == 42

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with a.on_accelerators(timeout=10):
                raise Boom
        assert not a.holding
        await eventually(lambda: _state(a, "g8", GroupState.IDLE_YIELDED))


async def test_phase_events_reach_the_stream(nats_url: str) -> None:
    nc = await connect(nats_url)
    try:
        sub = await nc.subscribe(subjects.job("g9", "a", "phase"))
        await nc.flush()
        async with AsyncTimeSliceClient("a", "g9", nats_url) as a, a.on_accelerators(timeout=10), a.phase("train"):
            pass
        first = (await sub.next_msg(timeout=5)).data
        second = (await sub.next_msg(timeout=5)).data
        assert b'"edge":"start"' in first and b'"name":"train"' in first
        assert b'"edge":"end"' in second
    finally:
        await nc.close()


async def test_kv_keys_lists_every_key_every_time(nats_url: str) -> None:
    """``bus.kv_keys`` (used instead of nats-py's ``KeyValue.keys()``, which can return a short list when its
    watcher announces the end too early): every key, every time; deleted keys listed (their marker stays);
    ``under`` keeps one dotted prefix; a missing bucket is ``Unavailable``."""
    nc = await connect(nats_url)
    try:
        kv = await nc.jetstream().create_key_value(bucket="kvkeys", history=1)
        for key in ("n1.a", "n1.b", "n2.c"):
            await kv.put(key, b"{}")
        await kv.delete("n1.b")
        for _ in range(300):
            assert await kv_keys(nc, "kvkeys") == ["n1.a", "n1.b", "n2.c"]
        assert await kv_keys(nc, "kvkeys", under="n1") == ["n1.a", "n1.b"]
        assert await kv_keys(nc, "kvkeys", under="n3") == []
        with pytest.raises(Unavailable, match=r"'nope'.*stream not found"):
            await kv_keys(nc, "nope")
    finally:
        await nc.close()
