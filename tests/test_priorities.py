"""Priority classes with ageing (``Acquire.priority``, ``_next_waiter``): who the group passes to next, in the pure
core and through the real stack. The state machine (``test_core_properties.py``) checks every choice against a model
of the same rule; these pin the rule's cases and its starvation bound."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from timeslice_client import AsyncTimeSliceClient, InvalidRequest
from timeslice_client.protocol import MAX_PRIORITY, Acquire, Granted, decode_input
from timeslice_orchestrator.core import LIMITS

from .core_sim import Sim, notices
from .helpers import group_record

AGEING = LIMITS.priority_ageing_ms
# Long windows, so minutes of waiting need no renewals here (the state machine covers renewals).
PATIENT: dict[str, Any] = dict(lease_ms=3_600_000, timeout_ms=3_600_000, waiter_ttl_ms=600_000, confirm_ms=600_000)


def granted_after_release(sim: Sim, holder: str, dt: int = 0) -> str:
    (g,) = notices(sim.release(holder, dt=dt), Granted)
    sim.renew(g.job)  # confirmed, as its client does
    return g.job


def test_a_higher_class_goes_first_and_one_class_is_first_come_first_served() -> None:
    sim = Sim()
    sim.acquire("x", **PATIENT)
    sim.acquire("low", dt=10, priority=0, **PATIENT)
    sim.acquire("mid", dt=10, priority=5, **PATIENT)
    sim.acquire("high", dt=10, priority=9, **PATIENT)
    sim.acquire("mid2", dt=10, priority=5, **PATIENT)
    order = [granted_after_release(sim, "x", dt=10)]
    for _ in range(3):
        order.append(granted_after_release(sim, order[-1], dt=10))
    assert order == ["high", "mid", "mid2", "low"]  # mid before mid2: same class, asked first
    # The queue keeps the order they asked in; `timeslice status` shows it so, with each class.
    sim2 = Sim()
    sim2.acquire("x", **PATIENT)
    for job in ("a", "b", "c"):
        sim2.acquire(job, dt=10, **PATIENT)
    assert [granted_after_release(sim2, j, dt=10) for j in ("x", "a", "b")] == ["a", "b", "c"]


def test_a_waiter_ages_past_newer_higher_classes() -> None:
    sim = Sim()
    sim.acquire("x", **PATIENT)
    sim.acquire("old", priority=0, **PATIENT)
    # 8 ageing periods later a class-9 job asks: it still goes first (8 < 9).
    sim.acquire("new", dt=8 * AGEING, priority=9, **PATIENT)
    assert granted_after_release(sim, "x", dt=1) == "new"
    # Another class-9 job asks; by the next pass the old waiter has waited 9 periods: a tie on class, and it asked
    # first.
    sim.acquire("newer", dt=AGEING, priority=9, **PATIENT)
    assert granted_after_release(sim, "new", dt=1) == "old"


def test_no_starvation_under_a_stream_of_higher_classes() -> None:
    """A class-0 waiter among jobs of class 9 that ask again as soon as they release: it is passed the group within
    MAX_PRIORITY ageing periods (plus one hold), however many of them keep asking."""
    sim = Sim()
    hot = [f"hot{i}" for i in range(3)]
    sim.acquire(hot[0], priority=9, **PATIENT)
    sim.acquire("meek", dt=1, priority=0, **PATIENT)
    for j in hot[1:]:
        sim.acquire(j, dt=1, priority=9, **PATIENT)
    holder, started, hold_ms = hot[0], sim.now, 20_000
    while holder != "meek":
        assert sim.now - started <= (MAX_PRIORITY + 1) * AGEING + hold_ms, "the class-0 waiter starves"
        released, holder = holder, granted_after_release(sim, holder, dt=hold_ms)
        sim.acquire(released, dt=1, priority=9, **PATIENT)  # it wants the group again at once (queued behind)
    assert sim.now - started >= MAX_PRIORITY * AGEING - hold_ms  # it did wait for the higher classes first


def test_a_waiter_asking_again_keeps_its_place_and_takes_its_new_class() -> None:
    sim = Sim()
    sim.acquire("x", **PATIENT)
    sim.acquire("a", priority=0, **PATIENT)
    sim.acquire("b", dt=5, priority=3, **PATIENT)
    sim.acquire("a", dt=5, priority=3, **PATIENT)  # its second acquire, at class 3: a tie, and it asked first
    assert [w.priority for w in sim.rec.queue] == [3, 3] and sim.rec.queue[0].job == "a"
    assert granted_after_release(sim, "x", dt=1) == "a"


def test_a_class_out_of_range_is_refused_on_the_wire_and_by_the_client() -> None:
    good = msgspec.json.encode(Acquire(group="g", job="a", request_id="r", priority=MAX_PRIORITY))
    assert decode_input(good).priority == MAX_PRIORITY  # type: ignore[union-attr]
    bad = good.replace(f'"priority":{MAX_PRIORITY}'.encode(), b'"priority":10')
    with pytest.raises(msgspec.ValidationError):
        decode_input(bad)
    with pytest.raises(InvalidRequest, match="priority"):
        AsyncTimeSliceClient("a", "g", "nats://127.0.0.1:4222", priority=MAX_PRIORITY + 1)


async def test_through_the_stack_a_later_higher_class_waiter_is_granted_first(
    orchestrator: object, nats_url: str
) -> None:
    async with (
        AsyncTimeSliceClient("holder", "g-prio", nats_url) as holder,
        AsyncTimeSliceClient("batch", "g-prio", nats_url) as batch,
        AsyncTimeSliceClient("urgent", "g-prio", nats_url, priority=7) as urgent,
    ):
        await holder.acquire(timeout=10)
        batch_wait = asyncio.create_task(batch.acquire(timeout=30))
        for _ in range(200):  # batch queues first (bounded poll of the record)
            rec = await group_record(holder)
            if [w.job for w in rec.queue] == ["batch"]:
                break
            await asyncio.sleep(0.01)
        urgent_wait = asyncio.create_task(urgent.acquire(timeout=30))
        for _ in range(200):
            rec = await group_record(holder)
            if [(w.job, w.priority) for w in rec.queue] == [("batch", 0), ("urgent", 7)]:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail(f"both never queued: {rec.queue}")
        await holder.release()
        await asyncio.wait_for(urgent_wait, 10)  # the later, higher class first
        assert not batch_wait.done()
        await urgent.release()
        await asyncio.wait_for(batch_wait, 10)
        await batch.release()


def test_status_shows_each_waiters_class_in_the_order_they_asked() -> None:
    from timeslice_cli._status import _queue

    sim = Sim()
    sim.acquire("x", **PATIENT)
    sim.acquire("a", dt=1_000, **PATIENT)
    sim.acquire("b", dt=1_000, priority=4, **PATIENT)
    line = _queue(sim.rec, sim.now)
    assert line.index("a ") < line.index("b ") and "(class 4)" in line and line.count("class") == 1, line
