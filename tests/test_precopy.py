"""Pre-copy while idle (issue 27, item 2): after a release nobody waited for, whose state stays on the device, a
workload copies its state to host memory while the job is idle; the next switch's suspend then only frees the
device memory, and the job's next grant makes the copy worthless (dropped, never used, at no cost to that acquire).

First the handler (``TorchOffloadHandler.precopy`` on CPU tensors, both copy paths), then the whole stack: two jobs,
an orchestrator and an agent, with the switch's snapshot taking the copy, and a re-acquire dropping it."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from timeslice_agent import Agent
from timeslice_client import AsyncTimeSliceClient, InvalidRequest, SuspendMode, WorkloadChannel, _torch_copies
from timeslice_client.torch_offload import TorchOffloadHandler

from .helpers import ROOT, eventually, run_text
from .test_agent_flow import stack

OFFLOAD, DISCARD = SuspendMode.OFFLOAD, SuspendMode.DISCARD
ALL: frozenset[str] = frozenset()
NODE = "node-1"


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().clone().contiguous().view(torch.uint8).numpy().tobytes())


class StopsAfter(threading.Event):
    """An event that reads as set from its ``n``-th look on: a cancel that comes in the middle of a copy."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.looks, self.n = 0, n

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks >= self.n or super().is_set()


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of every batched copy call (CPU), in order."""
    seen: list[int] = []
    original = _torch_copies._FOREACH_COPY
    assert original is not None  # torch >= 2.1 here

    def spy(dst: list[Any], src: list[Any]) -> None:
        seen.append(sum(int(s.numel()) for s in src))
        original(dst, src)

    monkeypatch.setattr(_torch_copies, "_FOREACH_COPY", spy)
    return seen


def _state() -> tuple[list[torch.Tensor], int]:
    ts = [torch.randn(50_000), torch.randn(7), torch.arange(1000, dtype=torch.int64)]
    return ts, sum(t.untyped_storage().nbytes() for t in ts)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "per-storage"])
def test_a_precopy_leaves_the_next_suspend_only_freeing(copies: list[int], batched: bool) -> None:
    ts, total = _state()
    handler = TorchOffloadHandler(tensors={"t": ts})
    handler._batched = batched  # the per-storage path is CUDA's; it runs on CPU tensors too
    before = [bits(t) for t in ts]
    assert handler.precopy(ALL).bytes_moved == total
    assert all(t.untyped_storage().nbytes() > 0 for t in ts), "a precopy keeps the state on the device"
    assert [bits(t) for t in ts] == before
    copies.clear()
    r = handler.suspend(OFFLOAD, ALL)
    assert copies == [] and handler.precopied_suspends == 1, "the suspend copied nothing: the precopy had"
    assert r.device_bytes_freed == total and r.bytes_moved == total
    assert all(t.untyped_storage().nbytes() == 0 for t in ts)
    assert handler.resume(OFFLOAD, ALL).bytes_moved == total
    assert [bits(t) for t in ts] == before
    # Used once: the next cycle copies as usual.
    handler.suspend(OFFLOAD, ALL)
    handler.resume(OFFLOAD, ALL)
    assert handler.precopied_suspends == 1 and [bits(t) for t in ts] == before


def test_a_cancelled_precopy_is_never_used_and_the_suspend_copies_the_state_as_it_is(copies: list[int]) -> None:
    ts, total = _state()
    handler = TorchOffloadHandler(tensors={"t": ts})
    stop = threading.Event()
    handler.precopy(ALL, stop)
    stop.set()  # the job was granted again…
    ts[0].add_(1.0)  # …and ran
    after = [bits(t) for t in ts]
    copies.clear()
    handler.suspend(OFFLOAD, ALL)
    assert copies == [total] and handler.precopied_suspends == 0
    handler.resume(OFFLOAD, ALL)
    assert [bits(t) for t in ts] == after


def test_a_precopy_cancelled_midway_stops_and_leaves_no_trace(copies: list[int]) -> None:
    ts, total = _state()
    handler = TorchOffloadHandler(tensors={"t": ts}, chunk_bytes=4096)
    before = [bits(t) for t in ts]
    stop = StopsAfter(5)
    moved = handler.precopy(ALL, stop).bytes_moved
    assert 0 < moved < total, moved
    assert stop.looks == 5, "it stopped at the chunk the cancel came before"
    copies.clear()
    handler.suspend(OFFLOAD, ALL)
    assert sum(copies) == total and handler.precopied_suspends == 0
    handler.resume(OFFLOAD, ALL)
    assert [bits(t) for t in ts] == before


def test_a_storage_that_changed_after_the_precopy_makes_it_worthless(copies: list[int]) -> None:
    live: list[torch.Tensor] = [torch.randn(1000)]
    handler = TorchOffloadHandler(tensors={"kv": lambda: live})
    handler.precopy(ALL)
    live.append(torch.randn(300))  # read at suspend time: the state is not what was copied
    before = [bits(t) for t in live]
    copies.clear()
    handler.suspend(OFFLOAD, ALL)
    assert handler.precopied_suspends == 0 and sum(copies) == 4000 + 1200
    handler.resume(OFFLOAD, ALL)
    assert [bits(t) for t in live] == before


def test_a_discard_after_a_precopy_drops_the_state_and_the_copy() -> None:
    ts, _ = _state()
    handler = TorchOffloadHandler(tensors={"t": ts})
    handler.precopy(ALL)
    handler.suspend(DISCARD, ALL)
    handler.resume(DISCARD, ALL)
    assert handler.precopied_suspends == 0 and all(not t.any() for t in ts), "discarded state comes back zeroed"


def test_releasing_the_host_buffers_drops_a_precopy_made_in_them(copies: list[int]) -> None:
    ts, total = _state()
    handler = TorchOffloadHandler(tensors={"t": ts})
    before = [bits(t) for t in ts]
    handler.precopy(ALL)
    assert handler.release_host_buffers() > 0
    copies.clear()
    handler.suspend(OFFLOAD, ALL)
    assert copies == [total] and handler.precopied_suspends == 0
    handler.resume(OFFLOAD, ALL)
    assert [bits(t) for t in ts] == before


def test_a_channel_refuses_an_unknown_precopy_choice() -> None:
    with pytest.raises(InvalidRequest, match="precopy must be one of auto, always, never"):
        WorkloadChannel(object(), "j", "g", TorchOffloadHandler(torch.zeros(4)), precopy="sometimes")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- through the stack


@pytest.fixture
async def agent(nats_url: str) -> AsyncIterator[Agent]:
    async with stack(nats_url, "beside") as a:
        yield a


async def _trailing(done: Callable[[], bool]) -> None:
    """Wait (bounded) for the outgoing job's snapshot of a switch to have ended. The agent overlaps the incoming
    restore with it when the node has room for both (CPU here has), and the orchestrator grants on that restore
    (grant on restore): the snapshot may still run when the incoming job's acquire returns (CI saw it, loaded)."""
    await eventually(done, what="the outgoing job's snapshot trailing the grant")


async def _switch(b: AsyncTimeSliceClient) -> None:
    """b takes the group from a (a's state goes out) and gives it back at once (b's stays loaded)."""
    await b.acquire(timeout=30)
    await b.release()


async def test_the_switch_after_an_idle_precopy_only_frees_and_a_grant_drops_it(nats_url: str, agent: Agent) -> None:
    ta, _ = _state()
    tb, _ = _state()
    ha, hb = TorchOffloadHandler(tensors={"t": ta}), TorchOffloadHandler(tensors={"t": tb})
    async with AsyncTimeSliceClient("a", "gp", nats_url) as a, AsyncTimeSliceClient("b", "gp", nats_url) as b:
        ch = await a.register_workload(ha, node_id=NODE)  # precopy "auto": only once a has been switched out
        await b.register_workload(hb, node_id=NODE, precopy="never")
        await a.acquire(timeout=10)
        r = await a.release()
        assert r.pending_waiters == 0 and r.snapshot_deferred
        assert ch.precopies == 0 and ch.switched_out == 0, "auto: no switch seen yet, so none expected"
        await _switch(b)  # a's state goes out (a full copy) and b's comes in
        await _trailing(lambda: ch.switched_out == 1)
        assert ha.precopied_suspends == 0
        ga = await a.acquire(timeout=30)
        assert ga.context_restored
        before = [bits(t) for t in ta]
        await a.release()  # nobody waits: a's state stays on the device, and is copied out now
        await eventually(lambda: ch.precopies == 1, what="a's idle precopy")
        await _switch(b)
        await _trailing(lambda: ha.precopied_suspends == 1)  # the switch's snapshot only freed a's memory
        ga = await a.acquire(timeout=30)
        assert ga.context_restored and [bits(t) for t in ta] == before
        # A re-acquire before any switch drops the copy: a changes its state, and the next switch (b waiting at a's
        # release, so no new precopy) copies the state as it is, not the copy made before.
        await a.release()
        await eventually(lambda: ch.precopies == 2, what="a's second idle precopy")
        ga = await a.acquire(timeout=30)
        assert not ga.context_restored, "the state never left"
        ta[0].add_(1.0)
        changed = [bits(t) for t in ta]
        waiting = asyncio.create_task(b.acquire(timeout=30))
        await eventually(lambda: a.contended, what="the orchestrator tells a that b waits")
        await a.release()
        await waiting
        await b.release()
        await a.acquire(timeout=30)
        assert ch.precopies == 2 and ha.precopied_suspends == 1, "the stale copy was not used"
        assert [bits(t) for t in ta] == changed
        await a.release()


async def test_always_precopies_at_the_first_idle_release_and_never_does_not(nats_url: str, agent: Agent) -> None:
    ha, hb = TorchOffloadHandler(torch.randn(1000)), TorchOffloadHandler(torch.randn(1000))
    async with AsyncTimeSliceClient("a", "gq", nats_url) as a, AsyncTimeSliceClient("b", "gq", nats_url) as b:
        cha = await a.register_workload(ha, node_id=NODE, precopy="always")
        chb = await b.register_workload(hb, node_id=NODE, precopy="never")
        await a.acquire(timeout=10)
        await a.release()
        await eventually(lambda: cha.precopies == 1, what="a's precopy")
        await _switch(b)
        await _trailing(lambda: ha.precopied_suspends == 1)
        assert chb.switched_out == 0
        g = await a.acquire(timeout=30)  # b's state goes out now: never precopied
        assert g.context_restored
        await _trailing(lambda: chb.switched_out == 1)
        assert hb.precopied_suspends == 0 and chb.precopies == 0
        await a.release()


@pytest.mark.xdist_group("wall_clock")
def test_the_bench_times_the_switch_with_and_without_the_idle_copy(tmp_path: Path) -> None:
    """``bench/precopy.py --quick`` on CPU: every switch of the precopy variant used the copy (the script checks it),
    and, with the agent in order, B's acquire is faster than with the copy at the switch (the copy of 0.25 GiB leaves
    the critical path)."""
    out = tmp_path / "precopy.json"
    r = run_text([sys.executable, str(ROOT / "bench" / "precopy.py"), "--quick", "--json-out", str(out)], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["cycles"] == 3 and list(data["orders"]) == ["in-order", "room"]
    for order in data["orders"].values():
        v = order["variants"]
        assert v["precopy"]["precopied_suspends"] == 4 and v["copy"]["precopied_suspends"] == 0  # (one warm-up)
    # In order, the copy is on B's critical path unless it was made while A was idle.
    assert data["orders"]["in-order"]["precopy_vs_copy"] < 1.0, data["orders"]
    assert "precopied while A was idle" in r.stdout


class _SlowCopy:
    """A handler whose precopy runs until it is cancelled (at most 30 s)."""

    def __init__(self) -> None:
        self.started, self.stopped = threading.Event(), threading.Event()

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> Any:
        from timeslice_client import HandlerResult

        return HandlerResult()

    resume = suspend

    def precopy(self, tags: frozenset[str], cancelled: threading.Event) -> Any:
        from timeslice_client import HandlerResult

        self.started.set()
        if cancelled.wait(30):
            self.stopped.set()
        return HandlerResult()


async def test_closing_the_client_stops_a_precopy_in_flight_and_waits_for_it(nats_url: str, agent: Agent) -> None:
    h = _SlowCopy()
    a = AsyncTimeSliceClient("a", "gc", nats_url)
    async with a:
        ch = await a.register_workload(h, node_id=NODE, precopy="always")
        await a.acquire(timeout=10)
        await a.release()
        await eventually(h.started.is_set, what="the precopy began")
        async with asyncio.timeout(10):
            await a.close()
    assert h.stopped.is_set(), "the close cancelled the copy and waited for it to stop"
    assert ch.precopies == 0
