"""A workload answers a suspend promptly while its main thread is busy in Python (``timeslice_client._prompt``).

CPython gives the GIL back to a thread that released it (a socket read, a torch copy, a sleep) only every
switch interval, 5 ms by default, when another thread runs Python all the while. The workload channel lowers
the interval for the length of a command, so each such step waits about 0.1 ms instead."""

from __future__ import annotations

import select
import sys
import threading
from collections.abc import Iterator

import msgspec
import pytest
from timeslice_agent import Agent, AgentConfig
from timeslice_client import HandlerResult, SuspendMode
from timeslice_client._prompt import DEFAULT_SWITCH_INTERVAL, prompt_threads
from timeslice_client.bus import connect
from timeslice_client.protocol import WorkloadCommand, WorkloadReply, encode, subjects
from timeslice_client.workload import register_workload

from .helpers import running

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


@pytest.fixture
def busy_thread() -> Iterator[None]:
    """Another thread of this process runs Python without pause (a job scoring rewards after it yielded)."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i * i

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)


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
    channel = await register_workload(job, "g-gil", handler, node_id=node, nats_url=nats_url,
                                      switch_interval=interval)
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
