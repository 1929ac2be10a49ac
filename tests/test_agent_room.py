"""When the agent lets a restore start beside the snapshots it follows (``_restore_overlap.RestoreOrder``): the rules,
the reservation of memory while overlapped restores run, and the free-memory reading on this host."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from timeslice_agent._host import _kib, host_memory
from timeslice_agent._restore_overlap import RestoreOrder, fits, free_device_bytes, restore_size
from timeslice_agent._running_ops import RunningOps
from timeslice_client.protocol import JobContext, JobState, Restore

GiB = 1 << 30
SNAP = "g:2:snapshot:n1"


def _ctx(
    job: str = "b",
    state: JobState = JobState.SAVED,
    backends: tuple[str, ...] = ("app_channel",),
    freed: int = 4 * GiB,
    moved: int = 4 * GiB,
) -> JobContext:
    return JobContext(
        node="n1", job=job, group="g", state=state, backends=backends, device_bytes_freed=freed, bytes_moved=moved
    )


def _restore(after: tuple[str, ...] = (SNAP,), deadline_s: float = 30.0) -> Restore:
    import time

    return Restore(
        op_id="g:2:restore:n1",
        group="g",
        job="b",
        node="n1",
        epoch=2,
        deadline_ms=int((time.time() + deadline_s) * 1000),
        after=after,
    )


def test_fits_counts_margin_and_reservations() -> None:
    assert fits(4 * GiB, 10 * GiB, 0, GiB, 0.1)
    assert not fits(4 * GiB, 10 * GiB, 5 * GiB, GiB, 0.1)  # 4.4 + 1 + 5 > 10
    assert not fits(4 * GiB, 5 * GiB, 0, GiB, 0.1)  # 4.4 + 1 > 5
    assert not fits(4 * GiB, None, 0, 0, 0.0)  # free memory unknown
    assert not fits(0, 10 * GiB, 0, 0, 0.0)  # size unknown


def test_restore_size_is_what_the_last_snapshot_reported() -> None:
    assert restore_size(_ctx(freed=3, moved=5)) == 5
    assert restore_size(_ctx(freed=7, moved=0)) == 7  # mode discard: nothing moved, memory freed
    assert restore_size(_ctx(freed=0, moved=0)) == 0


@pytest.mark.parametrize(
    ("why", "ctx", "others", "enabled", "running", "free"),
    [
        ("overlap off", _ctx(), (), False, True, 100 * GiB),
        ("its snapshot already answered", _ctx(), (), True, False, 100 * GiB),
        ("not registered here", None, (), True, True, 100 * GiB),
        ("not saved here", _ctx(state=JobState.RUNNING), (), True, True, 100 * GiB),
        ("size unknown", _ctx(freed=0, moved=0), (), True, True, 100 * GiB),
        ("frozen by the agent", _ctx(backends=("app_channel", "freeze")), (), True, True, 100 * GiB),
        (
            "the outgoing job is frozen",
            _ctx(),
            (_ctx("a", JobState.TRANSITIONING, ("freeze",)),),
            True,
            True,
            100 * GiB,
        ),
        ("no room", _ctx(), (), True, True, 5 * GiB),
        ("free memory unknown", _ctx(), (), True, True, None),
    ],
)
def test_no_overlap(
    why: str, ctx: JobContext | None, others: tuple[JobContext, ...], enabled: bool, running: bool, free: int | None
) -> None:
    ops = RunningOps()
    if running:
        ops.start(SNAP)
    order = RestoreOrder(ops, enabled=enabled, free_bytes=lambda: free)
    assert order.may_overlap(_restore(), ctx, others, free) == 0, why


def test_overlap_reserves_its_size_while_it_runs() -> None:
    async def go() -> None:
        ops = RunningOps()
        ops.start(SNAP)
        order = RestoreOrder(ops, free_bytes=lambda: 8 * GiB)
        other = _ctx("a", JobState.TRANSITIONING)
        async with order.turn(_restore(), _ctx(), [other]) as turn:
            assert turn.overlapped and turn.error is None and order.reserved == 4 * GiB
            # a second restore of the same size no longer fits beside the first one: it waits its turn
            waiting = asyncio.Event()
            wait = ops.wait

            async def noted_wait(after: Any, deadline_s: float) -> str | None:
                waiting.set()
                return await wait(after, deadline_s)

            ops.wait = noted_wait  # type: ignore[method-assign]
            second = asyncio.ensure_future(_second(order))
            noted = asyncio.ensure_future(waiting.wait())
            await asyncio.wait({second, noted}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            noted.cancel()
            assert waiting.is_set() and not second.done()  # it waits for the snapshot, not beside it
            ops.answered(SNAP)
            assert await asyncio.wait_for(second, 5) == (False, None)
        assert order.reserved == 0

    async def _second(order: RestoreOrder) -> tuple[bool, str | None]:
        async with order.turn(_restore(), _ctx(), []) as turn:
            return turn.overlapped, turn.error

    asyncio.run(go())


def test_waiting_restore_gets_an_error_when_its_snapshot_outlives_the_deadline() -> None:
    async def go() -> None:
        ops = RunningOps()
        ops.start(SNAP)
        order = RestoreOrder(ops, enabled=False)
        async with order.turn(_restore(deadline_s=0.05), _ctx(), []) as turn:
            assert not turn.overlapped and turn.error is not None and SNAP in turn.error

    asyncio.run(go())


def test_host_memory_reads_both_figures_of_proc_meminfo() -> None:
    from pathlib import Path

    text = Path("/proc/meminfo").read_text()
    kib = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines() if line.split()[1:2]}
    total, available = host_memory()
    assert total == kib["MemTotal"] * 1024
    assert abs(available - kib["MemAvailable"] * 1024) < GiB  # read a moment apart
    assert _kib(b"MemFree: 7 kB\nMemAvailable:   42 kB\n", b"\nMemAvailable:") == 42
    assert _kib(b"MemTotal:  9 kB\n", b"\nMemTotal:") == 9  # the first line too
    assert _kib(b"MemTotal:  9 kB\n", b"\nMemAvailable:") == 0  # absent (old kernels)
    assert _kib(b"MemTotal:\n", b"\nMemTotal:") == 0


def test_free_device_bytes_on_this_host() -> None:
    """No NVML here: the "device" of a CPU job is host memory, so its available memory is the room."""
    from timeslice_agent._nvml import gpu_source

    if gpu_source() is not None:
        pytest.skip("NVML answers here: the room is the GPUs' free memory")
    total, available = host_memory()
    free = free_device_bytes()
    assert free is not None and total > 0
    assert abs(free - available) < GiB  # read a moment apart


@pytest.mark.parametrize("blocks", [False, True])
def test_free_memory_is_read_inline_unless_the_reading_blocks(blocks: bool) -> None:
    """Host memory (``/proc/meminfo``) is read on the agent's loop: a thread hop would cost more than the read,
    on the switch's critical path. NVML, a blocking call, is read in a thread."""
    import threading

    readers: list[int] = []

    def free() -> int:
        readers.append(threading.get_ident())
        return 100 * GiB

    async def go() -> None:
        ops = RunningOps()
        ops.start(SNAP)
        order = RestoreOrder(ops, free_bytes=free, free_bytes_blocks=lambda: blocks)
        async with order.turn(_restore(), _ctx(), []) as turn:
            assert turn.overlapped

    asyncio.run(go())
    assert len(readers) == 1 and (readers[0] != threading.get_ident()) is blocks
