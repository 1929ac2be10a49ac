"""The agent's per-job locks: one job's operations run one at a time, other jobs' do not wait, and no lock
outlives its last holder or waiter (an agent sees job ids come and go for weeks)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from timeslice_agent._job_locks import JobLocks

from .helpers import eventually


class _Held:
    """Job "a" held by one task until ``release`` is set; ``queue`` starts another that waits for it."""

    def __init__(self, locks: JobLocks, tg: asyncio.TaskGroup) -> None:
        self.locks, self.tg = locks, tg
        self.log: list[str] = []
        self.held, self.release = asyncio.Event(), asyncio.Event()
        tg.create_task(self._hold())

    async def _hold(self) -> None:
        async with self.locks.hold("a"):
            self.log.append("first")
            self.held.set()
            await self.release.wait()
            self.log.append("first out")

    async def queue(self, body: Callable[[], None]) -> asyncio.Task[None]:
        async def second() -> None:
            async with self.locks.hold("a"):
                body()

        await self.held.wait()
        task = self.tg.create_task(second())
        await eventually(lambda: self.locks.users("a") == 2, what="the second waits for the lock")
        return task


async def test_one_job_at_a_time_and_nothing_kept() -> None:
    locks = JobLocks()
    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        a = _Held(locks, tg)
        await a.queue(lambda: a.log.append("second"))
        async with locks.hold("b"):  # another job is not held up
            assert len(locks) == 2 and locks.users("b") == 1
        assert a.log == ["first"]
        a.release.set()
    assert a.log == ["first", "first out", "second"]
    assert len(locks) == 0 and locks.users("a") == 0


async def test_a_cancelled_waiter_leaves_nothing_behind() -> None:
    locks = JobLocks()
    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        a = _Held(locks, tg)
        waiter = await a.queue(lambda: pytest.fail("the waiter was cancelled before the lock was free"))
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert locks.users("a") == 1  # the holder's
        a.release.set()
    assert len(locks) == 0


async def test_an_error_inside_frees_the_lock() -> None:
    locks = JobLocks()
    with pytest.raises(ValueError):
        async with locks.hold("a"):
            raise ValueError("boom")
    assert len(locks) == 0
    async with asyncio.timeout(1), locks.hold("a"):  # not left locked
        pass
