"""Claims over a real nats-server: the re-acquire after a release that nobody waited for is published with the
stream's sequence check and granted by the stream alone (``Acquire.claim_epoch``); the orchestrator and the
invariant checker agree with it afterwards. A request of another job in between makes it an ordinary wait."""

from __future__ import annotations

import asyncio

import msgspec
from timeslice_client import AsyncTimeSliceClient, GroupState
from timeslice_client.bus import connect
from timeslice_client.protocol import Acquire, Granted, decode_input, decode_notice, subjects
from timeslice_orchestrator.invariants import StreamChecker
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .agent_harness import queued
from .helpers import eventually, group_record, running
from .workers import read_stream


def _orchestrator(url: str) -> Orchestrator:
    return Orchestrator(OrchestratorConfig(nats_url=url))


async def _acquires(url: str, group: str, job: str) -> list[Acquire]:
    stream = await read_stream(url)
    return [
        ev
        for _, _, subj, data in stream
        if subj == subjects.job(group, job, "acquire") and isinstance(ev := decode_input(data), Acquire)
    ]


async def _checked(url: str, stream: list[tuple[int, int, str, bytes]] | None = None) -> StreamChecker:
    checker = StreamChecker()
    checker.feed_all(stream if stream is not None else await read_stream(url))
    return checker


async def test_reacquire_after_an_unwaited_release_is_granted_by_the_stream_alone(nats_url: str) -> None:
    async with AsyncTimeSliceClient("job-a", "gc1", nats_url) as a:
        async with running(_orchestrator(nats_url)):
            g1 = await a.acquire(timeout=10)
            r = await a.release()
            assert (g1.epoch, r.pending_waiters) == (1, 0)
        # The orchestrator is gone: the claim needs only the stream.
        g2 = await a.acquire(timeout=10)
        assert (g2.epoch, g2.waited_ms, g2.context_restored) == (2, 0, False) and a.holding
        (claim,) = [x for x in await _acquires(nats_url, "gc1", "job-a") if x.claim_epoch is not None]
        assert claim.claim_epoch == 2
        async with running(_orchestrator(nats_url)):
            # On its return the orchestrator applies the claim from the stream: the grant it publishes is
            # the one the client took, and the client's renewals and release at that epoch are accepted.
            rec = await eventually(lambda: _held_by(a, "job-a", 2))
            assert rec.state is GroupState.LOCKED
            r2 = await a.release()
            assert (r2.epoch, r2.pending_waiters) == (2, 0)
        stream = await read_stream(nats_url)
        checker = await _checked(nats_url, stream)
        assert checker.stats["gc1"].grants == 2 and checker.unpublished_grants() == []
        grants = [
            n
            for _, _, subj, data in stream
            if subj == subjects.notice("gc1", "job-a") and isinstance(n := decode_notice(data), Granted)
        ]
        assert [(n.epoch, n.request_id) for n in grants][-1] == (2, claim.request_id)


async def _held_by(c: AsyncTimeSliceClient, job: str, epoch: int):  # type: ignore[no-untyped-def]
    rec = await group_record(c)
    return rec if rec.holder is not None and (rec.holder.job, rec.holder.epoch) == (job, epoch) else None


async def test_a_claim_superseded_by_another_jobs_request_waits_its_turn(nats_url: str) -> None:
    async with running(_orchestrator(nats_url)):
        a = await AsyncTimeSliceClient("a", "gc2", nats_url).connect()
        b = await AsyncTimeSliceClient("b", "gc2", nats_url).connect()
        try:
            await a.acquire(timeout=10)
            assert (await a.release()).pending_waiters == 0  # a may claim now ...
            gb = await b.acquire(timeout=10)  # ... but b's request comes first
            assert gb.epoch == 2
            ta = asyncio.create_task(a.acquire(timeout=10))
            await eventually(queued(a, "gc2", "a"))  # the stream refused the claim: a waits
            assert not ta.done()
            await b.release()
            ga = await ta
            assert ga.epoch == 3
            await a.release()
        finally:
            await a.close()
            await b.close()
    assert [x.claim_epoch for x in await _acquires(nats_url, "gc2", "a")] == [None, None]  # refused, not stored
    await _checked(nats_url)


async def test_no_claim_after_a_phase_event_or_when_turned_off(nats_url: str) -> None:
    async with (
        running(_orchestrator(nats_url)),
        AsyncTimeSliceClient("a", "gc3", nats_url) as a,
        AsyncTimeSliceClient("b", "gc4", nats_url, fast_reacquire=False) as b,
    ):
        # this nats-server (>= 2.11) can check a claim (a's stream is asked at its first release); b turned them off
        assert a._claims is None and b._claims is False
        await a.acquire(timeout=10)
        await a.release()
        assert a._claims is True  # a single-replica stream checks a claim exactly
        async with a.phase("score"):  # a job input after the release: the stream would refuse a claim
            pass
        assert (await a.acquire(timeout=10)).epoch == 2
        await a.release()
        assert (await a.acquire(timeout=10)).epoch == 3  # a claim again
        await a.release()
        for _ in range(2):
            await b.acquire(timeout=10)
            await b.release()
    assert [x.claim_epoch for x in await _acquires(nats_url, "gc3", "a")] == [None, None, 3]
    assert [x.claim_epoch for x in await _acquires(nats_url, "gc4", "b")] == [None, None]
    await _checked(nats_url)


async def test_a_stored_claim_whose_pubacks_were_lost_ends_as_the_same_grant(nats_url: str) -> None:
    """The stream checks the sequence before duplicates, so a claim retried after a lost PubAck is refused;
    the plain acquire after it finds the job holding at the claimed epoch and gets that grant back."""
    async with running(_orchestrator(nats_url)), AsyncTimeSliceClient("a", "gc5", nats_url) as a:
        await a.acquire(timeout=10)
        await a.release()
        claim = a._claim
        assert claim is not None
        # What the lost first attempt left in the stream: the claim itself.
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            ev = Acquire(
                group="gc5",
                job="a",
                request_id="lost-attempt",
                lease_ms=a.lease_ms,
                timeout_ms=0,
                waiter_ttl_ms=a.waiter_ttl_ms,
                confirm_ms=a.confirm_ms,
                claim_epoch=claim.epoch,
            )
            await js.publish(
                subjects.job("gc5", "a", "acquire"),
                msgspec.json.encode(ev),
                headers={
                    "Nats-Expected-Last-Subject-Sequence": str(claim.after_seq),
                    "Nats-Expected-Last-Subject-Sequence-Subject": subjects.job_inputs("gc5"),
                },
            )
        finally:
            await nc.close()
        g = await a.acquire(timeout=10)  # the client's own claim is refused now: it asks plainly
        assert g.epoch == claim.epoch
        await a.release()
    await _checked(nats_url)
