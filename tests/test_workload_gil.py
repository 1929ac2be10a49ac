"""A workload answers a suspend promptly while its main thread is busy in Python
(``timeslice_client._switch_interval``).

CPython gives the GIL back to a thread that released it (a socket read, a torch copy, a sleep) only every
switch interval, 5 ms by default, when another thread runs Python all the while. The workload channel lowers
the interval for the length of a command, so each such step waits about 0.1 ms instead."""

from __future__ import annotations

import asyncio
import importlib.util
import select
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
from timeslice_agent import Agent, AgentConfig
from timeslice_client import AsyncTimeSliceClient, HandlerResult, SuspendMode
from timeslice_client._switch_interval import DEFAULT_SWITCH_INTERVAL, prompt_threads
from timeslice_client.bus import connect
from timeslice_client.protocol import WorkloadCommand, WorkloadReply, encode, subjects
from timeslice_client.workload import register_workload
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .helpers import eventually, group_record, running

# It compares a handler's time with and without the lowered interval beside a busy thread: side by side with other
# timed tests the 2 cores' load moves the fast one (142 against 544 ms once in CI, the bound being a quarter).
pytestmark = pytest.mark.xdist_group("wall_clock")

RELEASES = 200  # GIL releases in one handler call


class _Releasing:
    """A handler whose work hands the GIL over ``RELEASES`` times (as a copy per tensor does)."""

    def __init__(self) -> None:
        self.intervals: list[float] = []

    def _work(self) -> HandlerResult:
        self.intervals.append(sys.getswitchinterval())
        for _ in range(RELEASES):
            select.select([], [], [], 0.0002)  # stands in for a 0.2 ms copy: the GIL goes to the busy thread
        return HandlerResult()

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return self._work()

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return self._work()


def _bench_common() -> ModuleType:
    """``bench/_common.py``, whose spinning thread ``bench/busy_suspend.py`` measures beside too."""
    path = Path(__file__).resolve().parents[1] / "bench" / "_common.py"
    spec = importlib.util.spec_from_file_location("_bench_common_for_tests", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def busy_thread() -> Iterator[None]:
    """Another thread of this process runs Python without pause (a job scoring rewards after it yielded)."""
    with _bench_common().python_spinning():
        yield


def test_prompt_threads_lowers_the_interval_and_puts_it_back() -> None:
    before = sys.getswitchinterval()
    with prompt_threads(1e-4):
        assert sys.getswitchinterval() == pytest.approx(1e-4)
        with prompt_threads(1e-3):  # a second command in flight: the lower one stays
            assert sys.getswitchinterval() == pytest.approx(1e-4)
        assert sys.getswitchinterval() == pytest.approx(1e-4)
    assert sys.getswitchinterval() == before
    with prompt_threads(None):
        assert sys.getswitchinterval() == before
    with pytest.raises(ValueError, match="positive"), prompt_threads(0):
        pass
    assert sys.getswitchinterval() == before


def test_prompt_threads_keeps_an_interval_set_meanwhile() -> None:
    before = sys.getswitchinterval()
    try:
        with prompt_threads(1e-4):
            sys.setswitchinterval(0.002)  # somebody else's choice, made while the command ran
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)


async def _suspend_ms(nats_url: str, node: str, job: str, interval: float | None) -> tuple[float, list[float]]:
    """The handler's time (ms, as the channel reports it) and the intervals it saw, with ``interval``."""
    handler = _Releasing()
    channel = await register_workload(
        job, "g-gil", handler, node_id=node, nats_url=nats_url, switch_interval_s=interval
    )
    nc = await connect(nats_url)
    try:
        cmd = WorkloadCommand(op_id=f"{job}-1", action="suspend", epoch=1)
        msg = await nc.request(subjects.workload_rpc(node, job), encode(cmd), timeout=30)
        reply = msgspec.json.decode(msg.data, type=WorkloadReply)
        assert reply.ok, reply.error
        return reply.elapsed_ms, handler.intervals
    finally:
        await nc.close()
        await channel.close()


async def test_a_suspend_beside_a_busy_main_thread_is_not_held_up(nats_url: str, busy_thread: None) -> None:
    before = sys.getswitchinterval()
    async with running(Agent(AgentConfig(node_id="n-gil", nats_url=nats_url))):
        slow, seen_slow = await _suspend_ms(nats_url, "n-gil", "left-alone", None)
        fast, seen_fast = await _suspend_ms(nats_url, "n-gil", "prompt", DEFAULT_SWITCH_INTERVAL)
    assert seen_slow == [before] and seen_fast == [pytest.approx(DEFAULT_SWITCH_INTERVAL)]
    assert sys.getswitchinterval() == before  # put back once the reply left
    # Each time it wants the GIL back it waits out the interval: about 200 x 5 ms left alone.
    print(f"handler time beside a busy thread: {slow:.1f} ms left alone, {fast:.1f} ms prompt")
    assert slow > RELEASES * before * 1000 / 2, (slow, fast)
    assert fast < slow / 4, (slow, fast)


async def test_a_job_that_yields_is_armed_until_its_suspend_is_answered_or_it_acquires(nats_url: str) -> None:
    """Reading the suspend would itself wait up to 5 ms for the GIL beside a busy main thread, so the channel
    lowers the interval from the job's release on: until its next command is answered, or it acquires again."""
    before = sys.getswitchinterval()
    low = pytest.approx(DEFAULT_SWITCH_INTERVAL)
    handler = _Releasing()
    async with (
        running(Orchestrator(OrchestratorConfig(nats_url=nats_url))),
        running(Agent(AgentConfig(node_id="n-arm", nats_url=nats_url))) as agent,
        AsyncTimeSliceClient("a", "g-arm", nats_url) as a,
        AsyncTimeSliceClient("b", "g-arm", nats_url) as b,
        AsyncTimeSliceClient("c", "g-arm", nats_url) as c,
    ):
        await a.register_workload(handler, node_id="n-arm")
        await c.register_workload(_Releasing(), node_id="n-arm", switch_interval_s=None)
        await a.acquire(timeout=10)
        assert sys.getswitchinterval() == before
        await a.release()  # nobody waits: a keeps its context, and its channel stays armed
        assert sys.getswitchinterval() == low
        await a.acquire(timeout=10)
        assert sys.getswitchinterval() == before
        tb = asyncio.create_task(b.acquire(timeout=10))
        await eventually(lambda: _queued(a, "b"))
        await a.release()  # b waits: a's suspend comes, and once it is answered the interval goes back
        await tb
        await eventually(lambda: agent.jobs()["a"].state.value == "SAVED")
        await eventually(lambda: sys.getswitchinterval() == before, what="the interval put back")
        assert handler.intervals == [low]
        await b.release()
        await c.acquire(timeout=10)
        await c.release()  # a job that asked for no interval is not armed
        assert sys.getswitchinterval() == before


async def _queued(c: AsyncTimeSliceClient, job: str) -> bool:
    return job in [w.job for w in (await group_record(c)).queue]
