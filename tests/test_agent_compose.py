"""``_backend_chain.until_exited``: an operation runs in the calling task (so its first request leaves with the
caller's writes) and ends as soon as the job's processes are gone, without swallowing other cancellations."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from timeslice_agent._backend_chain import until_exited


@pytest.fixture
def proc() -> Iterator[subprocess.Popen[bytes]]:
    """A process that lives until killed (the test kills it, or this fixture does)."""
    p = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def test_work_runs_in_the_calling_task_and_at_once() -> None:
    """Before the caller yields, ``work`` has run up to its first suspension, in the caller's task."""

    async def go() -> None:
        caller = asyncio.current_task()
        steps: list[str] = []
        gate = asyncio.Event()

        async def work() -> str:
            assert asyncio.current_task() is caller
            steps.append("started")
            await gate.wait()
            return "done"

        async def other() -> None:
            steps.append("other")  # scheduled before work starts: runs only once the caller yields
            gate.set()

        asyncio.get_running_loop().call_soon(lambda: steps.append("callback"))
        pending = asyncio.ensure_future(other())
        assert await until_exited(work(), [os.getpid()], 0.05) == "done"  # this process: alive throughout
        await pending
        assert steps[0] == "started", steps

    asyncio.run(go())


def test_returns_none_once_the_processes_exited(proc: subprocess.Popen[bytes]) -> None:
    async def go() -> None:
        never = asyncio.Event()
        task = asyncio.ensure_future(until_exited(never.wait(), [proc.pid], 0.02))
        await asyncio.sleep(0.05)  # a sampling window: still running while the process lives
        assert not task.done()
        proc.kill()
        proc.wait()
        assert await asyncio.wait_for(task, 5) is None

    asyncio.run(go())


def test_other_cancellations_go_through(proc: subprocess.Popen[bytes]) -> None:
    async def go() -> None:
        started = asyncio.Event()

        async def work() -> None:
            started.set()
            await asyncio.Event().wait()

        task = asyncio.ensure_future(until_exited(work(), [proc.pid], 0.02))
        await started.wait()  # cancelled inside until_exited, not before it began
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


def test_without_pids_it_is_just_the_work() -> None:
    async def work() -> int:
        return 7

    assert asyncio.run(until_exited(work(), [], 0.01)) == 7
