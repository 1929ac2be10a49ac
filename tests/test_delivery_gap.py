"""A delivery of the orchestrator's durable consumer that never arrives (a clustered consumer's leader failing over
with it in flight) is read from the stream and applied in order, in place, instead of the whole term starting over
from the ack floor through a bus that may still be electing (``_catch_up.fill_gap``)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.msg import Msg
from timeslice_client import AsyncTimeSliceClient
from timeslice_client.bus import connect
from timeslice_client.protocol import Acquire, encode, subjects
from timeslice_orchestrator._catch_up import fill_gap
from timeslice_orchestrator._delivery import seq_and_time
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .helpers import running


def _lose_one(orch: Orchestrator, subject_part: str) -> asyncio.Event:
    """Make the orchestrator's delivery callback lose the first live delivery of an input on ``subject_part`` (as
    one in flight when a clustered consumer's leader goes: never seen, never acknowledged); set once it did."""
    real, lost = orch._on_msg, asyncio.Event()

    async def on_msg(msg: Msg) -> None:  # nats-py takes only a coroutine function
        if not lost.is_set() and subject_part in msg.subject:
            lost.set()
            return
        await real(msg)

    orch._on_msg = on_msg  # type: ignore[method-assign]  # bound by the durable's subscription when the term begins
    return lost


async def test_a_lost_delivery_is_filled_from_the_stream_without_a_new_term(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="timeslice.orchestrator")
    orch = Orchestrator(OrchestratorConfig(nats_url=nats_url))
    lost = _lose_one(orch, ".b.acquire")
    async with (
        running(orch),
        AsyncTimeSliceClient("a", "gap", nats_url) as a,
        AsyncTimeSliceClient("b", "gap", nats_url, fast_reacquire=False) as b,
    ):
        await a.acquire(timeout=10)
        waiting = asyncio.create_task(b.acquire(timeout=20))
        await asyncio.wait_for(lost.wait(), 10)
        # b's acquire is lost; a's release comes next, one delivery later: the gap is seen then, and b's acquire is
        # applied before the release, so the release grants b at once (not after the durable's 30 s ack wait)
        await a.release()
        grant = await asyncio.wait_for(waiting, 10)
        assert grant.job_id == "b"
        await b.release()
    said = [r.getMessage() for r in caplog.records]
    assert any("filled a gap of deliveries" in m for m in said), said
    assert not any("term ends" in m for m in said), said


async def test_fill_gap_passes_the_inputs_between_two_sequences_in_order_as_deliveries(nats_url: str) -> None:
    from timeslice_client._internal.bus_layout import ensure_bus

    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_bus(js)
        seqs = []
        for i in range(5):
            ack = await js.publish(
                subjects.job("g", f"j{i}", "acquire"), encode(Acquire(group="g", job=f"j{i}", request_id=f"r{i}"))
            )
            seqs.append(ack.seq)
            await nc.publish(subjects.notice("g", f"j{i}"), b"{}")  # stored too, not an input: passed over
        await nc.flush()
        got: list[tuple[str, int]] = []

        async def collect(msg: Msg) -> None:
            seq, ts_ms = seq_and_time(msg.reply)
            assert ts_ms > 0
            got.append((msg.subject, seq))

        assert await fill_gap(js, nc, seqs[0], seqs[4], collect)
        assert got == [(subjects.job("g", f"j{i}", "acquire"), seqs[i]) for i in (1, 2, 3)]
        got.clear()
        assert not await fill_gap(js, nc, 0, 10_000, collect, max_span=100)  # too wide: the caller catches up
        assert got == []
    finally:
        await nc.close()


async def test_a_malformed_input_read_to_fill_a_gap_is_refused_like_a_delivered_one(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What a gap is filled with comes from the bus as much as a delivery does: garbage there is rejected (counted,
    logged) and the orchestrator goes on, in the same term."""
    caplog.set_level(logging.INFO, logger="timeslice.orchestrator")
    orch = Orchestrator(OrchestratorConfig(nats_url=nats_url))
    lost = _lose_one(orch, ".b.acquire")
    async with running(orch), AsyncTimeSliceClient("a", "gap2", nats_url) as a:
        await a.acquire(timeout=10)
        nc = await connect(nats_url)
        try:
            await nc.jetstream().publish(subjects.job("gap2", "b", "acquire"), b'{"type": "acquire", "group": 7}')
        finally:
            await nc.close()
        await asyncio.wait_for(lost.wait(), 10)
        before = orch.events_rejected
        await a.release()  # delivered after the lost one: the gap is filled, its garbage refused
        async with AsyncTimeSliceClient("c", "gap2", nats_url) as c:
            await c.acquire(timeout=10)
            await c.release()
        assert orch.events_rejected == before + 1
    said = [r.getMessage() for r in caplog.records]
    assert any("filled a gap of deliveries" in m for m in said), said
    assert not any("term ends" in m for m in said), said
