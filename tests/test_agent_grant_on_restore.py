"""Grant on restore through the real stack: a nats-server, the orchestrator (in this test's event loop), node agents
as real processes and workload processes holding real state (``tests/workers/workload_worker.py``).

The outgoing job's suspend blocks (``--handler slow``) until the test lets it go. On a node whose agent has room
for both contexts (the default), the incoming job's restore runs beside that suspend and the job is granted on it,
while the outgoing snapshot still runs; the record shows that snapshot trailing the grant until it ends. On a node
whose agent runs with ``--no-overlap-restores`` the order stays snapshot, restore, grant. ``timeslice check`` and
the invariant checker accept both streams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from timeslice_client import AsyncTimeSliceClient, GroupRecord
from timeslice_client.protocol import OpKind, OpResult, OpStarted, decode_input, subjects

from .agent_harness import START, AgentProcess, Workload, queued, timeslice
from .helpers import eventually, group_record
from .workers import read_stream

pytestmark = pytest.mark.usefixtures("orchestrator")

ROOM, NO_ROOM = "n-room", "n-in-order"


@pytest.fixture
async def agents(nats_url: str, tmp_path: Path) -> AsyncIterator[dict[str, AgentProcess]]:
    """One agent with the room rule (the default), one started with ``--no-overlap-restores``."""
    room = AgentProcess(nats_url, ROOM, tmp_path / "agent-room.log")
    in_order = AgentProcess(nats_url, NO_ROOM, tmp_path / "agent-in-order.log")
    in_order.args = ("--no-overlap-restores",)
    try:
        for a in (room, in_order):
            a.start()
        for a in (room, in_order):
            await a.wait_ready()
        yield {ROOM: room, NO_ROOM: in_order}
    finally:
        room.stop()
        in_order.stop()


@pytest.fixture
def workloads() -> Iterator[list[Workload]]:
    started: list[Workload] = []
    yield started
    for w in started:
        w.close()


@pytest.fixture
async def observer(nats_url: str) -> AsyncIterator[AsyncTimeSliceClient]:
    async with AsyncTimeSliceClient("observer", "observer", nats_url) as c:
        yield c


async def _holding(obs: AsyncTimeSliceClient, group: str, job: str) -> GroupRecord | None:
    rec = await group_record(obs, group)
    return rec if rec.holder is not None and rec.holder.job == job else None


async def _outgoing_saved(obs: AsyncTimeSliceClient, group: str) -> GroupRecord | None:
    rec = await group_record(obs, group)
    return rec if rec.trailing is None and rec.holder is not None and "a" in rec.saved else None


async def _switch_to_b(
    tmp: Path, url: str, node: str, group: str, observer: AsyncTimeSliceClient, started: list[Workload]
) -> tuple[Workload, Workload]:
    """b runs first (so that its context is saved, with its size), then a; b waits and a releases: a's suspend
    blocks (it began at the release: early suspend), the switch's restore of b goes out with a's snapshot."""
    a = Workload(tmp, url, group, "a", node, handler="slow", mb=4, slow_s=60)
    b = Workload(tmp, url, group, "b", node, handler="numpy", mb=1)
    started += [a, b]
    await a.wait("ready", timeout=START)
    await b.wait("ready", timeout=START)
    b.send("acquire")
    await b.wait("worked")
    a.send("acquire")
    await eventually(queued(observer, group, "a"), what="a queued behind b")
    b.send("release")
    await a.wait("worked")
    b.send("acquire")
    await eventually(queued(observer, group, "b"), what="b queued behind a")
    a.send("release")
    await a.wait("suspend_start")  # and it blocks
    return a, b


async def _ops(url: str, node: str, group: str) -> tuple[list[tuple[int, Any]], list[tuple[int, OpStarted]]]:
    stream = await read_stream(url)
    results = [
        (seq, ev)
        for seq, _, subj, data in stream
        if subj == subjects.agent_event(node, group) and isinstance(ev := decode_input(data), OpResult)
    ]
    started = [
        (seq, op)
        for seq, _, subj, data in stream
        if subj == subjects.agent_op(node) and (op := msgspec.json.decode(data, type=OpStarted)).group == group
    ]
    return results, started


async def test_the_incoming_job_is_granted_on_its_restore_beside_the_running_snapshot_only_with_room(
    agents: dict[str, AgentProcess],
    workloads: list[Workload],
    observer: AsyncTimeSliceClient,
    nats_url: str,
    tmp_path: Path,
) -> None:
    # Room for both contexts: b is granted on its restore while a's suspend still blocks.
    g = "beside"
    a, b = await _switch_to_b(tmp_path, nats_url, ROOM, g, observer, workloads)
    granted = await b.wait("granted", n=2, timeout=20)  # before a's suspend may end
    assert granted["context_restored"] is True and not a.events("suspended")
    rec = await eventually(lambda: _holding(observer, g, "b"), what="the record of b's grant")
    assert rec.switch is None and rec.trailing is not None, rec
    assert [(op.job, op.node, op.kind) for op in rec.trailing.ops] == [("a", ROOM, OpKind.SNAPSHOT)]
    ctx = await agents[ROOM].jobs()
    assert (ctx["a"]["state"], ctx["b"]["state"]) == ("TRANSITIONING", "RUNNING"), ctx
    a.send("unblock")
    suspended = await a.wait("suspended")
    assert suspended["t"] > granted["t"]
    rec = await eventually(lambda: _outgoing_saved(observer, g), what="a's trailing snapshot ended")
    assert rec.holder is not None and rec.holder.job == "b" and not rec.faulted, rec
    results, started = await _ops(nats_url, ROOM, g)
    restore = next(r for _, r in results if r.kind is OpKind.RESTORE and r.job == "b" and r.epoch == rec.epoch)
    assert restore.ok and restore.overlapped
    assert next(op for _, op in started if op.op_id == restore.op_id).overlapped

    # No room (--no-overlap-restores): b's restore runs only after a's snapshot, and b is granted only then.
    g = "in-order"
    a, b = await _switch_to_b(tmp_path, nats_url, NO_ROOM, g, observer, workloads)
    await agents[NO_ROOM].wait_states({"a": "TRANSITIONING", "b": "SAVED"})
    rec = await group_record(observer, g)
    assert rec.holder is None and rec.switch is not None and not b.events("resume_start"), rec
    a.send("unblock")
    suspended = await a.wait("suspended")
    granted = await b.wait("granted", n=2, timeout=20)
    resumed = await b.wait("resume_start", n=1)
    assert resumed["t"] >= suspended["t"] and granted["t"] >= suspended["t"], (suspended, resumed, granted)
    rec = await eventually(lambda: _holding(observer, g, "b"), what="the record of b's grant")
    assert rec.trailing is None, rec
    results, started = await _ops(nats_url, NO_ROOM, g)
    snapshot_end = next(seq for seq, r in results if r.kind is OpKind.SNAPSHOT and r.epoch == rec.epoch)
    restore_start = next(seq for seq, op in started if op.kind is OpKind.RESTORE and op.epoch == rec.epoch)
    restore = next(r for _, r in results if r.kind is OpKind.RESTORE and r.epoch == rec.epoch)
    assert restore_start > snapshot_end and not restore.overlapped

    rc, out = await timeslice(nats_url, "check")  # both switches pass the stream checks and the fold's
    assert rc == 0 and "no violation" in out, out
