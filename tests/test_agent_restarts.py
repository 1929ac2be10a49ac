"""A node agent restarted, or its liveness key gone, while the jobs it serves go on: the agent as a real process
(``tests/agent_harness.py``), workload processes with real state, the orchestrator in this test's event loop.

What each test checks:

* a restarted agent does not run again a command from before its restart that is older than its jobs' stored
  epochs (its durable consumer starts again at its ack floor, which lags); an operation it does run again (its job
  still TRANSITIONING in KV) is answered again in the stream, so no snapshot reads as started and never ended;
* an agent whose key in KV ``agents`` goes away while it still answers is not lost (its next switches move state
  as ever); if it dies before its key is back, the orchestrator's next probe finds it lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import urllib.request
from typing import Any

import msgspec
import pytest
from nats.js.errors import KeyNotFoundError
from prometheus_client import generate_latest
from timeslice_client import AsyncTimeSliceClient
from timeslice_client.bus import connect
from timeslice_client.protocol import (
    AGENTS_BUCKET,
    JOBS_BUCKET,
    JobContext,
    JobState,
    OpKind,
    OpResult,
    OpStarted,
    Restore,
    Snapshot,
    encode,
    subjects,
)
from timeslice_orchestrator.service import Orchestrator

from .agent_harness import (
    AGENT_TTL,
    NODE,
    START,
    AgentProcess,
    Spawn,
    Workload,
    hold_then_queue,
    op_events,
    switch_back,
)
from .helpers import eventually, group_record

pytestmark = pytest.mark.usefixtures("orchestrator")


# --------------------------------------------------------------------------- commands delivered again


async def test_a_restarted_agent_does_not_run_again_a_command_from_before_its_restart(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str
) -> None:
    """The agent's durable consumer starts again from its ack floor, which can lag the acknowledgements: in a chaos
    run a killed agent, started again, got about 30 s of commands delivered again and ran snapshots and restores of
    epochs hundreds behind, while grants went out for the current ones. A restarted agent knows each job's last
    epoch from KV: a command older than it is stale, answered without moving anything. Here a's first restore
    (before a was switched out) comes again after the restart: a's state stays on the host while b holds."""
    g = "replayed"
    a, b, worked_a = await _a_holds_b_waits(spawn, observer, g)
    a.send("release")
    await b.wait("worked")
    await agent.wait_states({"a": "SAVED", "b": "RUNNING"})
    agent.kill()
    agent.start()
    await agent.wait_ready()
    await agent.wait_states({"a": "SAVED", "b": "RUNNING"})

    ea = worked_a["epoch"]
    deadline = int(time.time() * 1000) + 30_000
    replayed = Restore(
        op_id=f"{g}:{ea}:{OpKind.RESTORE}:{NODE}", group=g, job="a", node=NODE, epoch=ea, deadline_ms=deadline
    )
    # Then a command of the same epoch for a, which the agent takes after the first (one job's operations run in
    # their order): its answer is in the stream once the first was decided.
    marker = Snapshot(
        op_id=f"{g}:{ea}:{OpKind.SNAPSHOT}:{NODE}", group=g, job="a", node=NODE, epoch=ea, deadline_ms=deadline
    )
    started = await _replayed_then_marker(nats_url, g, replayed, marker)
    assert [s.op_id for s in started if s.op_id in (replayed.op_id, marker.op_id)] == [], "a stale command ran"
    assert a.events("resume_start") == [], "a's state came back to the device while b holds"
    jobs = await agent.jobs()
    assert (jobs["a"]["state"], jobs["b"]["state"]) == ("SAVED", "RUNNING"), jobs
    assert "stale command answered without running" in agent.log_path.read_text(), agent.describe()


async def _replayed_then_marker(
    nats_url: str, group: str, replayed: Snapshot | Restore, marker: Snapshot | Restore
) -> list[OpStarted]:
    """Publish ``replayed`` (a command delivered again) and then ``marker`` (a command for the same job, which the
    agent takes after it: one job's operations run in their order); once ``marker`` is answered, check that it was
    answered stale and return the operations the stream shows started in ``group``."""
    nc = await connect(nats_url)
    try:
        for cmd in (replayed, marker):
            await nc.jetstream().publish(subjects.agent_cmd(NODE), encode(cmd), timeout=5)
    finally:
        await nc.close()

    async def marker_answered() -> OpResult | None:
        results, _, _ = await op_events(nats_url, group)
        return next((r for r in results if r.op_id == marker.op_id), None)

    answer = await eventually(marker_answered, what="the agent answered the command after the replayed one")
    assert not answer.ok and "stale epoch" in (answer.error or ""), answer
    _, started, _ = await op_events(nats_url, group)
    return started


async def test_an_operation_run_again_after_a_restart_answers_it_again_in_the_stream(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str
) -> None:
    """The agent is killed after it answered a's snapshot but before it stored a's state (its KV write follows the
    answer): a's stored state is still TRANSITIONING, and the snapshot's command, delivered again to the restarted
    agent, runs again (the workload answers the repeated op id with the outcome it gave). Its second start is in the
    stream, so its second answer must be too (before, the stream dropped it as a duplicate of the first: a snapshot
    started and never ended, and every grant after it broke ``timeslice check``: 3 ``grant-while-loaded`` in a chaos
    run)."""
    g = "run-again"
    a, b, worked_a = await _a_holds_b_waits(spawn, observer, g)
    a.send("release")
    worked_b = await b.wait("worked")
    await agent.wait_states({"a": "SAVED", "b": "RUNNING"})
    agent.kill()
    eb = worked_b["epoch"]
    snap_id = f"{g}:{eb}:{OpKind.SNAPSHOT}:{NODE}"
    nc = await connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(JOBS_BUCKET)
        stored = msgspec.json.decode((await kv.get(f"{NODE}.a")).value, type=JobContext)
        assert (stored.state, stored.last_op_id, stored.epoch) == (JobState.SAVED, snap_id, eb), stored
        await kv.put(
            f"{NODE}.a", encode(msgspec.structs.replace(stored, state=JobState.TRANSITIONING, last_op_ok=None))
        )
        agent.start()
        await agent.wait_ready()
        deadline = int(time.time() * 1000) + 30_000
        again = Snapshot(op_id=snap_id, group=g, job="a", node=NODE, epoch=eb, deadline_ms=deadline)
        # then a stale command for a, answered once the one before it ended (one job's operations run in order)
        ea = worked_a["epoch"]
        marker = Restore(
            op_id=f"{g}:{ea}:{OpKind.RESTORE}:{NODE}-m", group=g, job="a", node=NODE, epoch=ea, deadline_ms=deadline
        )
        for cmd in (again, marker):
            await nc.jetstream().publish(subjects.agent_cmd(NODE), encode(cmd), timeout=5)
    finally:
        await nc.close()

    async def marker_answered() -> bool:
        results, _, _ = await op_events(nats_url, g)
        return any(r.op_id == marker.op_id for r in results)

    await eventually(marker_answered, what="the command after the one run again answered")
    results, started, _ = await op_events(nats_url, g)
    starts, answers = [s.op_id for s in started].count(snap_id), [r.op_id for r in results].count(snap_id)
    assert (starts, answers) == (2, 2), (starts, answers)
    assert all(r.ok for r in results if r.op_id == snap_id), results
    assert (await agent.jobs())["a"]["state"] == "SAVED"


async def test_a_job_registered_afresh_gets_no_command_of_its_earlier_life(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str
) -> None:
    """The fence a restarted agent seeds from its stored jobs is gone for a group whose jobs all left the node, and a
    job that registers afresh stored epoch 0: a command from the job's earlier life, delivered again (the durable
    consumer's ack floor lags), moved the new process's state. A fresh registration stores the group's epoch from its
    record (KV ``groups``), so such a command is stale. Here a's snapshot of the switch to b comes again after a and
    b left, the agent restarted and a new process registered as a: its state stays where it is."""
    g = "afresh"
    a, b, _ = await _a_holds_b_waits(spawn, observer, g)
    a.send("release")
    eb = (await b.wait("worked"))["epoch"]
    await switch_back(a, b, observer, g)  # a holds again: the group's record moves past eb
    for w in (a, b):
        w.send("exit")
        await w.wait("exited")
        w.close()  # reaped: a zombie would pass for alive, and the agent would keep its job

    async def no_jobs() -> bool:
        return not await agent.jobs()

    await eventually(no_jobs, what="a and b unregistered")
    agent.kill()
    agent.args = ("--metrics-port", "0")
    agent.start()
    await agent.wait_ready()
    a2 = spawn(g, "a", handler="numpy", mb=2)  # the same event log as a's first process
    await a2.wait("ready", n=2, timeout=START)
    suspends = len(a2.events("suspend_start"))
    fence = (await group_record(observer, g)).epoch
    assert fence > eb, (fence, eb)
    assert (await agent.jobs())["a"]["epoch"] == fence

    snap_id = f"{g}:{eb}:{OpKind.SNAPSHOT}:{NODE}"
    deadline = int(time.time() * 1000) + 30_000
    replayed = Snapshot(op_id=snap_id, group=g, job="a", node=NODE, epoch=eb, deadline_ms=deadline)
    marker = Restore(op_id=f"{snap_id}-m", group=g, job="a", node=NODE, epoch=eb, deadline_ms=deadline)
    started = await _replayed_then_marker(nats_url, g, replayed, marker)
    assert [s.op_id for s in started].count(snap_id) == 1, "the snapshot of a's first life ran again"
    assert len(a2.events("suspend_start")) == suspends, "the new process's state moved"
    assert (await agent.jobs())["a"]["state"] == "IDLE"
    url = re.findall(r"metrics at (\S+)", agent.log_path.read_text())[-1]
    scraped = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    assert "timeslice_agent_stale_commands_total 2.0" in scraped.splitlines(), agent.describe()


async def _a_holds_b_waits(
    spawn: Spawn, observer: AsyncTimeSliceClient, group: str
) -> tuple[Workload, Workload, dict[str, Any]]:
    """Jobs a (2 MiB) and b (1 MiB) of ``group``, numpy state each: a holds, b waits behind it. Returns a's
    ``worked`` event too."""
    a = spawn(group, "a", handler="numpy", mb=2)
    b = spawn(group, "b", handler="numpy", mb=1)
    await a.wait("ready", timeout=START)
    await b.wait("ready", timeout=START)
    return a, b, await hold_then_queue(a, b, observer, group)


# --------------------------------------------------------------------------- the agent's key goes, the agent stays


async def _delete_agent_key(nats_url: str) -> None:
    """What a TTL expiry does to the key (a NATS election slower than the TTL lets it lapse while the agent runs)."""
    nc = await connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(AGENTS_BUCKET)
        await kv.delete(NODE)
    finally:
        await nc.close()


async def _agent_key(nats_url: str) -> bool:
    """Whether the agent's key has a value (a deleted key keeps its marker)."""
    nc = await connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(AGENTS_BUCKET)
        with contextlib.suppress(KeyNotFoundError):
            return bool((await kv.get(NODE)).value)
        return False
    finally:
        await nc.close()


async def _without_heartbeats(agent: AgentProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent started again with a heartbeat of 10 minutes: its key, once deleted, stays gone."""
    monkeypatch.setenv("TIMESLICE_AGENT_HEARTBEAT_S", "600")
    agent.stop()
    agent.start()
    await agent.wait_ready()


async def test_an_agent_that_answers_after_its_key_went_away_is_not_lost(
    spawn: Spawn,
    agent: AgentProcess,
    observer: AsyncTimeSliceClient,
    orchestrator: Orchestrator,
    nats_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent's key goes (as its TTL would let it during a NATS election slower than the TTL) while the agent
    runs: the orchestrator asks the agent, which answers, so nothing is lost, and the next switches move a's state
    out and back. (Before, the key's going alone was the loss: one CI run, its election slow, faulted a job so.)
    The agent writes no heartbeat meanwhile, so its key stays gone and the orchestrator keeps asking it."""
    await _without_heartbeats(agent, monkeypatch)
    g = "key-gone"
    a, b, worked_a = await _a_holds_b_waits(spawn, observer, g)
    await _delete_agent_key(nats_url)
    counts = orchestrator.metrics.agents
    await eventually(lambda: counts.answered_without_key == 1, what="the orchestrator asked the agent")
    assert not await _agent_key(nats_url)
    rec = await group_record(observer, g)
    assert NODE not in rec.lost_nodes and not rec.faulted, rec
    assert counts.lost == 0
    scraped = generate_latest(orchestrator.metrics.registry).decode()
    assert "timeslice_agent_keys_gone_while_answering_total 1.0" in scraped, scraped
    assert "timeslice_agents_lost_total 0.0" in scraped
    a.send("release")
    await b.wait("worked")
    granted_a = await switch_back(a, b, observer, g)
    assert granted_a["context_restored"] is True and granted_a["checksum"] == worked_a["checksum"], granted_a
    assert NODE not in (await group_record(observer, g)).lost_nodes and counts.lost == 0


async def test_an_agent_that_stops_answering_without_its_key_is_lost_at_the_next_probe(
    spawn: Spawn,
    agent: AgentProcess,
    observer: AsyncTimeSliceClient,
    orchestrator: Orchestrator,
    nats_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The key goes while the agent answers, and the agent dies before it writes the key again (a heartbeat of 10
    minutes here): no key event tells of the death, the orchestrator's next probe does (it asks every
    ``agent_probe_s`` while the key is missing)."""
    await _without_heartbeats(agent, monkeypatch)
    g = "key-gone-then-agent"
    a = spawn(g, "a", handler="numpy", mb=1)
    await a.wait("ready", timeout=START)
    a.send("acquire")
    await a.wait("worked")
    await _delete_agent_key(nats_url)
    counts = orchestrator.metrics.agents
    await eventually(lambda: counts.answered_without_key == 1, what="the orchestrator asked the agent")
    assert NODE not in (await group_record(observer, g)).lost_nodes
    agent.kill()
    killed = time.monotonic()

    async def lost() -> bool:
        return NODE in (await group_record(observer, g)).lost_nodes

    probe_s = orchestrator.config.agent_probe_s
    await eventually(lost, timeout=2 * probe_s + 5, what="the agent's loss, at the next probe")
    assert time.monotonic() - killed < AGENT_TTL, "not found by the probe: the key's TTL cannot tell any more"
    assert counts.lost == 1
