"""The orchestrator's watch of the agents (``timeslice_orchestrator._agents_watch``) on a real nats-server: a node is
lost only when its key is gone *and* its agent does not answer; an agent that answers without a key is asked again
until it stops answering or its key is back; and at start, with no key at all in the bucket, the nodes the records
name are asked too (before, an empty bucket reported nobody lost)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from timeslice_client._internal.bus_layout import Buckets, ensure_bus
from timeslice_client.bus import connect
from timeslice_client.protocol import AgentLost, GroupRecord, subjects
from timeslice_orchestrator._agents_watch import AgentLiveness, watch_agents
from timeslice_orchestrator.core import new_record

from .helpers import eventually, subscribed

PROBE_S = 0.3


def _record(group: str, node: str) -> GroupRecord:
    return msgspec.structs.replace(new_record(group), placements={"j": (node,)})


@contextlib.asynccontextmanager
async def _watching(
    nc: NATS, buckets: Buckets, records: dict[str, GroupRecord], counts: AgentLiveness
) -> AsyncIterator[asyncio.Event]:
    """``watch_agents`` running until the block ends; yields its ``known`` event."""
    stop, known = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        watch_agents(
            buckets.agents,
            nc.jetstream(),
            nc,
            lambda: records,
            stop,
            known,
            probe_s=PROBE_S,
            recheck_s=PROBE_S,
            start_grace_s=PROBE_S,
            counts=counts,
        )
    )
    try:
        yield known
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def _answering(nc: NATS, node: str) -> tuple[Subscription, list[str]]:
    """A stand-in for ``node``'s agent: answers its status request (as the real agent does, with its job list).
    Returns its subscription and the requests it answered."""
    asked: list[str] = []

    async def answer(msg: Msg) -> None:
        asked.append(msg.subject)
        await msg.respond(b"[]")

    return await subscribed(nc, subjects.agent_rpc(node, "status"), answer), asked


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[tuple[NATS, Buckets, list[AgentLost]]]:
    nc = await connect(nats_url)
    lost: list[AgentLost] = []

    async def on_lost(msg: Msg) -> None:
        lost.append(msgspec.json.decode(msg.data, type=AgentLost))

    await nc.subscribe("ts.v1.ctl.*.agent_lost", cb=on_lost)
    try:
        yield nc, await ensure_bus(nc.jetstream()), lost
    finally:
        await nc.close()


async def test_with_no_key_at_all_the_nodes_the_records_name_are_asked_and_lost_when_silent(
    bus: tuple[NATS, Buckets, list[AgentLost]],
) -> None:
    nc, buckets, lost = bus
    records = {"g": _record("g", "silent"), "h": _record("h", "alive")}
    _, asked = await _answering(nc, "alive")
    counts = AgentLiveness()
    async with _watching(nc, buckets, records, counts) as known:
        await asyncio.wait_for(known.wait(), timeout=10)
        assert [(ev.group, ev.node) for ev in await eventually(lambda: lost, what="AgentLost")] == [("g", "silent")]
        assert (counts.lost, counts.answered_without_key) == (1, 1) and asked


async def test_a_key_gone_is_a_loss_only_once_the_agent_stops_answering(
    bus: tuple[NATS, Buckets, list[AgentLost]],
) -> None:
    nc, buckets, lost = bus
    records = {"g": _record("g", "n8")}
    await buckets.agents.put("n8", b"{}")
    agent, asked = await _answering(nc, "n8")
    counts = AgentLiveness()
    async with _watching(nc, buckets, records, counts) as known:
        await asyncio.wait_for(known.wait(), timeout=10)
        assert asked == []  # its key is there: nobody asks
        await buckets.agents.delete("n8")
        await eventually(lambda: len(asked) >= 3, timeout=10, what="the agent asked, then asked again twice")
        assert not lost and (counts.answered_without_key, counts.lost) == (1, 0)
        await agent.unsubscribe()
        await eventually(lambda: lost, timeout=10, what="lost at the next probe")
        assert [(ev.group, ev.node) for ev in lost] == [("g", "n8")] and counts.lost == 1
