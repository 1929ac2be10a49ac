"""The agent's per-job locks: one job's operations run one at a time, other jobs' do not wait, and no lock
outlives its last holder or waiter (an agent sees job ids come and go for weeks)."""

from __future__ import annotations

import asyncio

import pytest
from timeslice_agent._job_locks import JobLocks

from .helpers import eventually


async def _hold(locks: JobLocks, job: str, held: asyncio.Event, release: asyncio.Event, log: list[str]) -> None:
    async with locks.hold(job):
        log.append("first")
        held.set()
        await release.wait()
        log.append("first out")


async def test_one_job_at_a_time_and_nothing_kept() -> None:
    locks = JobLocks()
    log: list[str] = []
    held, release = asyncio.Event(), asyncio.Event()

    async def second() -> None:
        async with locks.hold("a"):
            log.append("second")

    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        tg.create_task(_hold(locks, "a", held, release, log))
        await held.wait()
        tg.create_task(second())
        await eventually(lambda: locks.users("a") == 2, what="the second waits for the lock")
        async with locks.hold("b"):  # another job is not held up
            assert len(locks) == 2 and locks.users("b") == 1
        assert log == ["first"]
        release.set()
    assert log == ["first", "first out", "second"]
    assert len(locks) == 0 and locks.users("a") == 0


async def test_a_cancelled_waiter_leaves_nothing_behind() -> None:
    locks = JobLocks()
    log: list[str] = []
    held, release = asyncio.Event(), asyncio.Event()

    async def waiter() -> None:
        async with locks.hold("a"):
            pytest.fail("the waiter was cancelled before the lock was free")

    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        tg.create_task(_hold(locks, "a", held, release, log))
        await held.wait()
        w = tg.create_task(waiter())
        await eventually(lambda: locks.users("a") == 2, what="the waiter waits for the lock")
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        assert locks.users("a") == 1  # the holder's
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
