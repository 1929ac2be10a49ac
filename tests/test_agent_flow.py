"""Orchestrator + agent + registered workloads in one event loop: the switch choreography.

Every test runs in both layouts: the agent apart (its own connection, commands through its durable consumer,
as ``timeslice agent`` on a node) and beside the orchestrator (on the orchestrator's connection, commands
handed over directly, as ``timeslice up`` runs it)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.js.errors import KeyNotFoundError
from timeslice_agent import Agent, AgentConfig
from timeslice_client import AsyncTimeSliceClient, JobFaulted, JobState
from timeslice_client.bus import connect
from timeslice_client.protocol import (
    JOBS_BUCKET,
    AgentReply,
    OpKind,
    OpResult,
    RegisterJob,
    UnregisterJob,
    decode_input,
    encode,
    subjects,
)
from timeslice_orchestrator.invariants import StreamChecker
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .agent_harness import Blocking, Recorder
from .helpers import eventually, group_record, running
from .workers import read_stream

LAYOUTS = ["apart", "beside"]


@contextlib.asynccontextmanager
async def stack(nats_url: str, layout: str, cfg: AgentConfig | None = None) -> AsyncIterator[Agent]:
    """The orchestrator and node-1's agent, in ``layout``; yields the agent."""
    cfg = cfg or AgentConfig(node_id="node-1", nats_url=nats_url)
    orch_cfg = OrchestratorConfig(nats_url=nats_url)
    if layout == "apart":
        async with running(Orchestrator(orch_cfg)), running(Agent(cfg)) as agent:
            yield agent
        return
    orch = Orchestrator(orch_cfg, local_agent=lambda nc: Agent(cfg, nc=nc))
    async with running(orch):
        assert isinstance(orch.local_agent, Agent) and orch.local_agent.ready.is_set()
        yield orch.local_agent


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def agent(nats_url: str, layout: str) -> AsyncIterator[Agent]:
    async with stack(nats_url, layout) as a:
        yield a


def _commands(agent: Agent) -> dict[str, float]:
    return {via: agent.metrics.commands.labels(via)._value.get() for via in ("direct", "stream")}


async def test_switch_snapshots_then_restores_then_grants(nats_url: str, agent: Agent, layout: str) -> None:
    log: list[str] = []
    nc = await connect(nats_url)
    results = await nc.subscribe(subjects.agent_event("node-1", "gs"))
    async with AsyncTimeSliceClient("a", "gs", nats_url) as a, AsyncTimeSliceClient("b", "gs", nats_url) as b:
        await a.register_workload(Recorder("a", log), node_id="node-1")
        await b.register_workload(Recorder("b", log), node_id="node-1")
        ga = await a.acquire(timeout=10)
        # a never ran: its first grant restores nothing but goes through the agent (IDLE -> RUNNING)
        assert log == [] and ga.context_restored is True
        await eventually(lambda: agent.jobs()["a"].state is JobState.RUNNING)
        tb = asyncio.create_task(b.acquire(timeout=10))
        rec = await eventually(lambda: _queued(a, "b"))
        assert rec.loaded == {"node-1": "a"}
        await a.release()
        gb = await tb
        assert log == ["a:suspend"] and gb.context_restored is True
        assert agent.jobs()["a"].state is JobState.SAVED
        await eventually(lambda: agent.jobs()["b"].state is JobState.RUNNING)
        ta = asyncio.create_task(a.acquire(timeout=10))
        await eventually(lambda: _queued(b, "a"))
        await b.release()
        await ta
        # the agent may run a's restore beside b's snapshot (the node has room): either order, both before the
        # grant
        assert log[0] == "a:suspend" and sorted(log[1:]) == ["a:resume", "b:suspend"]
        done = list(log)
        await a.release()
        # alone: release keeps a's context; re-acquire costs nothing
        assert (await a.acquire(timeout=10)).context_restored is False
        assert log == done
        await a.release()
    outcomes = []
    with contextlib.suppress(Exception):
        while True:
            ev = decode_input((await results.next_msg(timeout=0.5)).data)
            if isinstance(ev, OpResult):
                outcomes.append(ev)
    assert any(o.kind == "snapshot" and o.ok and o.bytes_moved == 100 and o.backend == "app_channel" for o in outcomes)
    await nc.close()
    # Each command reached the agent once: beside the orchestrator directly (its stream copy only acknowledged),
    # apart through the stream.
    n = len({o.op_id for o in outcomes})
    assert n >= 4
    assert _commands(agent) == ({"direct": n, "stream": 0} if layout == "beside" else {"direct": 0, "stream": n})
    # Every operation has ended (its KV write follows its result): the agent keeps no per-job lock after it.
    await eventually(lambda: len(agent._locks) == 0, what="the agent's per-job locks dropped")
    # The stream stores each command before anything the agent writes about it, and the agent acknowledges
    # every delivered copy.
    first: dict[tuple[str, str], int] = {}
    kinds = {
        subjects.agent_cmd("node-1"): "cmd",
        subjects.agent_op("node-1"): "op",
        subjects.agent_event("node-1", "gs"): "evt",
    }
    for seq, _, subj, data in await read_stream(nats_url):
        op_id = msgspec.json.decode(data).get("op_id") if subj in kinds else None  # None: not an operation's
        if op_id is not None:
            first.setdefault((op_id, kinds[subj]), seq)
    for op_id in {o.op_id for o in outcomes}:
        cmd = first[(op_id, "cmd")]
        assert cmd < first[(op_id, "evt")] and cmd < first.get((op_id, "op"), cmd + 1), (op_id, first)
    js = (nc2 := await connect(nats_url)).jetstream()
    try:
        info = await eventually(lambda: _settled(js))
        assert info.num_pending == 0 and info.num_ack_pending == 0
    finally:
        await nc2.close()


async def _settled(js):  # type: ignore[no-untyped-def]
    info = await js.consumer_info("TIMESLICE", "agent-node-1")
    return info if info.num_pending == 0 and info.num_ack_pending == 0 else None


async def _queued(c: AsyncTimeSliceClient, job: str):  # type: ignore[no-untyped-def]
    rec = await group_record(c)
    return rec if job in [w.job for w in rec.queue] else None


async def _pending(sub) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    """The messages ``sub`` has received already, without waiting for more."""
    out = []
    while sub.pending_msgs:
        out.append(msgspec.json.decode((await sub.next_msg(timeout=1)).data))
    return out


async def _switching(c: AsyncTimeSliceClient, *, restored: bool, released_by: str):  # type: ignore[no-untyped-def]
    """The group's record once its switch is (or is not yet) ``restored``, or once somebody other than the job that
    released holds the group. The orchestrator writes records behind its commands, so a read may still show the
    releasing job's hold: that record is from before the release and is skipped."""
    rec = await group_record(c)
    done = rec.switch is not None and rec.switch.restored is restored
    granted = rec.holder is not None and rec.holder.job != released_by
    return rec if done or granted else None


async def _held(c: AsyncTimeSliceClient, job: str):  # type: ignore[no-untyped-def]
    """The group's record once ``job`` holds it (records are stored behind commands: earlier ones are skipped)."""
    rec = await group_record(c)
    return rec if rec.holder is not None and rec.holder.job == job else None


async def _trail_ended(c: AsyncTimeSliceClient) -> bool:
    rec = await group_record(c)
    return rec.trailing is None and rec.holder is not None and "a" in rec.saved


async def test_failed_snapshot_faults_only_that_job(nats_url: str, agent: Agent) -> None:
    log: list[str] = []
    async with AsyncTimeSliceClient("a", "gf", nats_url) as a, AsyncTimeSliceClient("b", "gf", nats_url) as b:
        await a.register_workload(Recorder("a", log, fail_suspend=True), node_id="node-1")
        await b.register_workload(Recorder("b", log), node_id="node-1")
        await a.acquire(timeout=10)
        tb = asyncio.create_task(b.acquire(timeout=10))
        await eventually(lambda: _queued(a, "b"))
        await a.release()
        gb = await tb  # b still gets the group
        assert gb.epoch >= 2
        # a rolled back (its handler raised before moving anything): RUNNING on the node, faulted in the group
        await eventually(lambda: agent.jobs()["a"].state is JobState.RUNNING)
        rec = await eventually(lambda: _faulted(b, "a"))
        assert "cannot offload" in rec.faulted["a"]
        with pytest.raises(JobFaulted):
            await a.acquire(timeout=5)
        await b.release()


async def _faulted(c: AsyncTimeSliceClient, job: str):  # type: ignore[no-untyped-def]
    rec = await group_record(c)
    return rec if job in rec.faulted else None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlapped"])
async def test_restore_sent_with_the_snapshot_waits_for_it_on_the_node_unless_there_is_room(
    nats_url: str, overlap: bool, layout: str
) -> None:
    """The orchestrator sends b's restore together with a's snapshot (``Restore.after``). With overlap off the
    agent runs the restore only once the snapshot on its node has ended, and b is granted once both ended; with it
    on (the default) and room on the node, the restore runs beside the snapshot, says so in its result
    (``OpResult.overlapped``), and b is granted on it while a's snapshot still runs (grant on restore)."""
    log: list[str] = []
    go = threading.Event()
    nc = await connect(nats_url)
    cfg = AgentConfig(node_id="node-1", nats_url=nats_url, overlap_restores=overlap)
    try:
        async with (
            stack(nats_url, layout, cfg) as agent,
            AsyncTimeSliceClient("a", "gp", nats_url) as a,
            AsyncTimeSliceClient("b", "gp", nats_url) as b,
        ):
            await a.register_workload(Blocking("a", log, go), node_id="node-1")
            await b.register_workload(Recorder("b", log), node_id="node-1")
            await b.acquire(timeout=10)  # b runs first, so that it has a context to restore later
            ta = asyncio.create_task(a.acquire(timeout=10))
            await eventually(lambda: _queued(b, "a"))
            await b.release()
            await ta
            assert log == ["b:suspend"]
            tb = asyncio.create_task(b.acquire(timeout=20))
            await eventually(lambda: _queued(a, "b"))
            cmds = await nc.subscribe(subjects.agent_cmd("node-1"))
            ops = await nc.subscribe(subjects.agent_op("node-1"))
            await nc.flush()
            taken = sum(_commands(agent).values())
            await a.release()

            restore = None
            while restore is None:  # the restore of b goes out with the snapshot of a, before it ends
                cmd = msgspec.json.decode((await cmds.next_msg(timeout=5)).data)
                if cmd["type"] == "restore" and cmd["job"] == "b":
                    restore = cmd
            snapshot_id = f"gp:{restore['epoch']}:snapshot:node-1"
            assert restore["after"] == [snapshot_id]
            await eventually(lambda: "a:suspend start" in log, what="a's suspend running")
            started: list[dict[str, object]] = []
            if overlap:
                await eventually(lambda: "b:resume" in log, what="b's resume beside a's suspend")
            else:
                # Both commands reached the agent, so the restore's task ran its first step: one that ignored
                # `after` would have sent OpStarted, and the request to b, before anything it answers later.
                # A round trip through the agent's connection then shows whether it did.
                await eventually(lambda: sum(_commands(agent).values()) >= taken + 2, what="both commands taken")
                await nc.request(subjects.agent_rpc("node-1", "status"), b"", timeout=5)
                started += await _pending(ops)
                assert restore["op_id"] not in [s["op_id"] for s in started], started
            if overlap:  # side by side: which handler starts first is up to the two workloads' threads
                assert log[0] == "b:suspend" and sorted(log[1:]) == ["a:suspend start", "b:resume"], log
            else:
                assert log == ["b:suspend", "a:suspend start"]
            if overlap:  # granted on b's restore: a's snapshot trails the grant
                gb = await asyncio.wait_for(tb, 10)
                rec = await eventually(lambda: _held(b, "b"), what="the record of b's grant")  # stored after the grant
                assert rec.holder is not None and rec.holder.job == "b" and rec.switch is None, rec
                assert rec.trailing is not None and [o.job for o in rec.trailing.ops] == ["a"], rec
                assert "a:suspend" not in log  # a's suspend still runs
            else:
                # The record the switch is at: the orchestrator grants in the same step that takes the last result,
                # so a grant before a's snapshot ended would show in it.
                rec = await eventually(
                    lambda: _switching(b, restored=False, released_by="a"), what="the switch's record"
                )
                assert rec.holder is None and rec.switch is not None, rec
                assert sorted(o.kind.value for o in rec.switch.ops) == ["restore", "snapshot"], rec.switch
                assert not tb.done()
            go.set()
            gb = await tb
            assert gb.context_restored
            if overlap:
                await eventually(lambda: _trail_ended(b), what="a's snapshot ended, b holding on")
            if overlap:
                assert log[3:] == ["a:suspend"], log
            else:
                assert log == ["b:suspend", "a:suspend start", "a:suspend", "b:resume"]
            await b.release()
            overlapped = agent.metrics.overlapped.labels("app_channel")._value.get()
            assert overlapped == (1 if overlap else 0)
        with contextlib.suppress(TimeoutError):
            while True:
                started.append(msgspec.json.decode((await ops.next_msg(timeout=0.5)).data))
        ids = [s["op_id"] for s in started]
        assert ids.index(snapshot_id) < ids.index(restore["op_id"])
        assert next(s for s in started if s["op_id"] == restore["op_id"])["overlapped"] is overlap
        checker = StreamChecker()
        checker.feed_all(await read_stream(nats_url))  # the stream passes the invariant checker
        assert checker.records["gp"].holder is None
    finally:
        await nc.close()


@pytest.mark.parametrize("again", [None, "same group", "other group"])
async def test_a_job_unregistered_mid_operation_stays_gone(nats_url: str, again: str | None) -> None:
    """A job that unregisters while its snapshot runs is unregistered once the snapshot ended (the unregistration
    waits for it, so the switch hears the snapshot's outcome first), and is not brought back: no context in the
    agent, no key in KV ``jobs``. A registration while the unregistration waits is answered "busy"; made again
    after it, in either group, it is a fresh one that the old operation leaves alone."""
    cfg = AgentConfig(node_id="node-1", nats_url=nats_url)
    log: list[str] = []
    go = threading.Event()
    nc = await connect(nats_url)
    try:
        async with running(Agent(cfg)) as agent, AsyncTimeSliceClient("x", "g1", nats_url) as x:
            await x.register_workload(Blocking("x", log, go), node_id="node-1")
            op_id = await agent.run_standalone("x", OpKind.SNAPSHOT)
            await eventually(lambda: log == ["x:suspend start"], what="x's suspend started")
            rpc = functools.partial(nc.request, timeout=5)
            leave = asyncio.ensure_future(
                nc.request(
                    subjects.agent_rpc("node-1", "unregister", "x"),
                    encode(UnregisterJob(group="g1", job="x")),
                    timeout=30,
                )
            )
            await eventually(lambda: "x" in agent.leaving(), what="the unregistration waits")
            assert "x" in agent.jobs() and not leave.done()  # not while its snapshot runs
            group = "g1" if again == "same group" else "g2"
            reg = RegisterJob(group=group, job="x", backends=("app_channel",), pids=(os.getpid(),), tags=("fresh",))
            if again is not None:
                busy = await rpc(subjects.agent_rpc("node-1", "register", "x"), encode(reg))
                assert msgspec.json.decode(busy.data, type=AgentReply).code == "busy"
                assert agent.jobs()["x"].group == "g1" and agent.jobs()["x"].tags != ("fresh",)
            go.set()
            status = await eventually(
                lambda: (s := agent.operation(op_id)) is not None and s.done and s, what="the snapshot's end"
            )
            assert status.result is not None and status.result.ok
            assert msgspec.json.decode((await asyncio.wait_for(leave, 30)).data, type=AgentReply).ok
            if again is not None:
                await rpc(subjects.agent_rpc("node-1", "register", "x"), encode(reg))
            kv = await nc.jetstream().key_value(JOBS_BUCKET)
            if again is None:
                assert "x" not in agent.jobs()
                with pytest.raises(KeyNotFoundError):  # deleted at the unregistration and not written again
                    await kv.get("node-1.x")
            else:
                ctx = agent.jobs()["x"]
                assert ctx.tags == ("fresh",)  # the registration made during the operation, not the old one
                assert ctx.state is JobState.IDLE and ctx.group == group, ctx  # fresh: the old snapshot left it
                stored = msgspec.json.decode((await kv.get("node-1.x")).value)
                assert stored["tags"] == ["fresh"] and stored["state"] == ctx.state.value
    finally:
        go.set()  # a failed assertion must not leave the handler waiting
        await nc.close()
