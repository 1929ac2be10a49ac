"""An unregistration that arrives while an operation on its job runs waits for that operation to end.

A job may send ``UnregisterJob`` for itself at any moment (its credential allows it; ``WorkloadChannel.close``
is only the polite sender, which lets its own suspend finish first). The agent used to unregister at once: the
orchestrator, hearing ``JobUnregistered``, ended the switch's pending snapshot as "job gone" and granted the
next job while the outgoing job's state was still being moved off the device (its handler, or a process-level
backend's copy, still running). Now the unregistration waits for the job's operation and is answered after it:
the snapshot's outcome comes first, and the next grant follows the end of the suspend."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import nats
from timeslice_agent import Agent, AgentConfig
from timeslice_agent._requests import BUSY
from timeslice_client import AsyncTimeSliceClient
from timeslice_client.protocol import (
    AgentReply,
    JobUnregistered,
    OpResult,
    UnregisterJob,
    decode_input,
    encode,
    subjects,
)

from .agent_harness import NODE, Workload, switch_under_way
from .helpers import eventually, running
from .workers import read_stream

GROUP = "g-unreg-op"


async def test_an_unregistration_during_a_snapshot_waits_for_it_and_the_next_grant_follows_the_suspend(
    orchestrator: object, nats_url: str, tmp_path: Path
) -> None:
    agent = Agent(AgentConfig(node_id=NODE, nats_url=nats_url))
    async with running(agent, timeout=30), AsyncTimeSliceClient("observer", GROUP, nats_url) as observer:
        a = Workload(tmp_path, nats_url, GROUP, "a", NODE, handler="slow")
        b = Workload(tmp_path, nats_url, GROUP, "b", NODE)
        nc = await nats.connect(nats_url)
        try:
            await switch_under_way(a, b, observer)  # the switch's snapshot of a runs, blocked in a's handler

            # The job itself (its process, with its own credential) asks to leave while its state is moving.
            asked = asyncio.ensure_future(
                nc.request(
                    subjects.agent_rpc(NODE, "unregister", "a"), encode(UnregisterJob(group=GROUP, job="a")), timeout=30
                )
            )
            try:
                # On the old code b was granted within milliseconds here, mid-suspend. Give it the chance.
                early = await b.wait("granted", timeout=2.0)
            except AssertionError:
                early = None
            assert early is None, f"b was granted at {early} while a's suspend was still running"
            assert not asked.done(), "the unregistration was answered while the job's snapshot still ran"

            a.send("unblock")
            suspended = await a.wait("suspended")
            granted = await b.wait("granted", timeout=30)
            assert granted["t"] >= suspended["t"], (granted, suspended)
            reply = msgspec.json.decode((await asyncio.wait_for(asked, 30)).data, type=AgentReply)
            assert reply.ok, reply

            async def a_gone() -> bool:
                return "a" not in agent.jobs()

            await eventually(a_gone, what="a unregistered")
            stream = await read_stream(nats_url)
            events = [
                (seq, decode_input(data)) for seq, _, subj, data in stream if subj == subjects.agent_event(NODE, GROUP)
            ]
            result_seq = next(seq for seq, ev in events if isinstance(ev, OpResult) and ev.job == "a")
            gone_seq = next(seq for seq, ev in events if isinstance(ev, JobUnregistered) and ev.job == "a")
            assert result_seq < gone_seq, (result_seq, gone_seq)  # the snapshot's outcome is heard first
        finally:
            if "asked" in locals() and not asked.done():
                asked.cancel()
            await nc.close()
            for w in (a, b):
                w.close()


async def test_an_unregistration_that_outwaits_its_bound_is_answered_busy_and_the_job_stays(
    orchestrator: object, nats_url: str, tmp_path: Path
) -> None:
    agent = Agent(AgentConfig(node_id=NODE, nats_url=nats_url, unregister_wait_s=0.5))
    async with running(agent, timeout=30), AsyncTimeSliceClient("observer", GROUP + "-b", nats_url) as observer:
        a = Workload(tmp_path, nats_url, GROUP + "-b", "a", NODE, handler="slow")
        b = Workload(tmp_path, nats_url, GROUP + "-b", "b", NODE)
        nc = await nats.connect(nats_url)
        try:
            await switch_under_way(a, b, observer)
            subject = subjects.agent_rpc(NODE, "unregister", "a")
            data = encode(UnregisterJob(group=GROUP + "-b", job="a"))
            first = asyncio.ensure_future(nc.request(subject, data, timeout=30))
            # A second one while the first waits is answered at once: one wait per job.
            second = msgspec.json.decode((await nc.request(subject, data, timeout=10)).data, type=AgentReply)
            assert (second.ok, second.code) == (False, BUSY), second
            reply = msgspec.json.decode((await asyncio.wait_for(first, 30)).data, type=AgentReply)
            assert (reply.ok, reply.code) == (False, BUSY), reply
            assert "a" in agent.jobs()  # still registered: its snapshot is still under way
            a.send("unblock")
            await a.wait("suspended")
            await b.wait("granted", timeout=30)
        finally:
            await nc.close()
            for w in (a, b):
                w.close()
