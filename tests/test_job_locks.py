"""The agent's per-job locks: one job's operations run one at a time, other jobs' do not wait, and no lock
outlives its last holder or waiter (an agent sees job ids come and go for weeks)."""

from __future__ import annotations

import asyncio

import pytest
from timeslice_agent._job_locks import JobLocks


async def test_one_job_at_a_time_and_nothing_kept() -> None:
    locks = JobLocks()
    inside: list[str] = []
    first_in = asyncio.Event()
    let_go = asyncio.Event()

    async def first() -> None:
        async with locks.hold("a"):
            inside.append("first")
            first_in.set()
            await let_go.wait()
            inside.append("first out")

    async def second() -> None:
        async with locks.hold("a"):
            inside.append("second")

    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        tg.create_task(first())
        await first_in.wait()
        t2 = tg.create_task(second())
        async with locks.hold("b"):  # another job is not held up
            assert len(locks) == 2
        await asyncio.sleep(0)
        assert not t2.done() and inside == ["first"]
        let_go.set()
    assert inside == ["first", "first out", "second"]
    assert len(locks) == 0


async def test_a_cancelled_waiter_leaves_nothing_behind() -> None:
    locks = JobLocks()
    held = asyncio.Event()
    release = asyncio.Event()

    async def holder() -> None:
        async with locks.hold("a"):
            held.set()
            await release.wait()

    async def waiter() -> None:
        async with locks.hold("a"):
            pytest.fail("the waiter was cancelled before the lock was free")

    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        tg.create_task(holder())
        await held.wait()
        w = tg.create_task(waiter())
        await asyncio.sleep(0)
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        assert len(locks) == 1  # the holder's
        release.set()
    assert len(locks) == 0


async def test_an_error_inside_frees_the_lock() -> None:
    locks = JobLocks()
    with pytest.raises(ValueError):
        async with locks.hold("a"):
            raise ValueError("boom")
    assert len(locks) == 0
    async with asyncio.timeout(1), locks.hold("a"):  # not left locked
        pass
