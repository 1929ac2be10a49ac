"""The snapshot agent treats every message it receives as untrusted (issue 23, finding 4).

A command on ``ts.v1.agent.<node>.cmd`` or a request on ``ts.rpc.agent.<node>.*`` with a malformed field (an id
that cannot go into a subject, another node, a negative or far-off deadline, an absurd op id, a pid that is not a
job's) is refused: with an ``OpResult(ok=False)`` on the stream where the command's ids can be put in a subject,
else only logged, counted (``timeslice_agent_refused``) and acknowledged. The agent process never ends because
of one, and a poison command left in its durable consumer does not crash it again after a restart.

The agent runs as a real process (``python -m timeslice_agent``) against a real nats-server; the commands are
bytes built by hand, since a command that the wire structs would refuse to build is exactly what is tested.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from timeslice_agent import Agent, AgentConfig
from timeslice_client._internal.bus_layout import ensure_bus
from timeslice_client._names import AGENT_JOB_VERBS
from timeslice_client.protocol import (
    STREAM,
    AgentReply,
    GroupRecord,
    JobContext,
    JobState,
    OpResult,
    RegisterJob,
    Restore,
    Snapshot,
    encode,
    subjects,
    validate_id,
)

from .agent_harness import NODE, AgentProcess
from .helpers import eventually, running

DURABLE = f"agent-{NODE}"
PID_MAX = 1 << 22  # no process has this pid (Linux's pid_max is at most PID_MAX_LIMIT = 2**22)


class OwnSessionAgent(AgentProcess):
    """``python -m timeslice_agent`` in a session of its own: its process group is its pid, never this test's,
    so no registration the tests make can name a group that holds the test process."""

    own_session = True

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
async def agent(nats_url: str, tmp_path: Path) -> AsyncIterator[OwnSessionAgent]:
    async with OwnSessionAgent(nats_url, NODE, tmp_path / "agent.log") as a:
        assert os.getpgid(a.pid) == a.pid != os.getpgid(0)
        yield a


def _now_ms() -> int:
    return int(time.time() * 1000)


def snapshot_bytes(**fields: Any) -> bytes:
    """A ``Snapshot`` command as raw JSON: a valid one for node ``NODE``, with ``fields`` put over it."""
    cmd: dict[str, Any] = {
        "type": "snapshot",
        "op_id": "op-1",
        "group": "g",
        "job": "j",
        "node": NODE,
        "epoch": 1,
        "deadline_ms": _now_ms() + 30_000,
    }
    cmd.update(fields)
    return json.dumps(cmd).encode()


async def publish_command(nc: NATS, data: bytes) -> int:
    """Store ``data`` on this node's command subject; returns its stream sequence."""
    ack = await nc.jetstream().publish(subjects.agent_cmd(NODE), data, timeout=5)
    return int(ack.seq)


async def all_acknowledged(nc: NATS, seq: int) -> None:
    """Wait until the agent's durable consumer acknowledged every command up to ``seq``."""
    js = nc.jetstream()

    async def acked() -> bool:
        try:
            info = await js.consumer_info(STREAM, DURABLE)
        except NotFoundError:  # a starting agent answers requests before it makes its consumer again
            return False
        return bool(
            info.ack_floor
            and info.ack_floor.stream_seq is not None
            and info.ack_floor.stream_seq >= seq
            and info.num_ack_pending == 0
        )

    await eventually(acked, timeout=15, interval=0.05, what=f"the agent acknowledged its commands up to #{seq}")


def assert_alive(agent: AgentProcess) -> None:
    assert agent.proc is not None and agent.proc.poll() is None, f"the agent process ended: {agent.describe()}"


def rpc_subject(node: str, verb: str, payload: bytes) -> str:
    """The subject of a request: per-job verbs on the subject of the job the payload names (when it can be put in a
    subject, else ``fz``), as that job would send it."""
    if verb not in AGENT_JOB_VERBS:
        return subjects.agent_rpc(node, verb)
    try:
        job = validate_id("job", json.loads(payload).get("job"))
    except (ValueError, AttributeError, TypeError):
        job = "fz"
    return subjects.agent_rpc(node, verb, job)


async def rpc(nc: NATS, agent: AgentProcess, verb: str, payload: bytes) -> bytes:
    """One request to the agent; a missing answer fails with the agent's exit status and log."""
    try:
        msg = await nc.request(rpc_subject(NODE, verb, payload), payload, timeout=5)
    except Exception as exc:
        assert_alive(agent)
        raise AssertionError(f"the agent did not answer {verb} ({exc!r}): {agent.describe()}") from exc
    return bytes(msg.data)


async def register(nc: NATS, agent: AgentProcess, payload: bytes) -> AgentReply:
    return msgspec.json.decode(await rpc(nc, agent, "register", payload), type=AgentReply)


async def serves_a_switch(
    nc: NATS, agent: AgentProcess, *, group: str = "ok", job: str = "fine", op_id: str = "op-valid"
) -> OpResult:
    """A valid registration (this test process, ``noop`` backend) and a valid snapshot of it are served."""
    req = RegisterJob(group=group, job=job, backends=("noop",), pids=(os.getpid(),))
    reply = await register(nc, agent, encode(req))
    assert reply.ok, reply
    results = await nc.subscribe(subjects.agent_event(NODE, group))
    try:
        await publish_command(nc, snapshot_bytes(op_id=op_id, group=group, job=job))

        async def answered() -> OpResult | None:
            assert_alive(agent)
            try:
                msg = await results.next_msg(timeout=0.5)
            except TimeoutError:
                return None
            ev = msgspec.json.decode(msg.data)
            return msgspec.json.decode(msg.data, type=OpResult) if ev.get("type") == "op_result" else None

        result = await eventually(answered, timeout=15, what=f"the result of {op_id}")
    finally:
        await results.unsubscribe()
    assert (result.op_id, result.ok, result.job, result.group) == (op_id, True, job, group), result
    await agent.wait_states({job: "SAVED"})
    assert_alive(agent)
    return result


# --------------------------------------------------------------------------- (a) the repro


@pytest.mark.parametrize("group", ["", "a.b"])
async def test_snapshot_with_an_unsubjectable_group_does_not_end_the_agent(
    agent: AgentProcess, nc: NATS, group: str
) -> None:
    seq = await publish_command(nc, snapshot_bytes(op_id=f"bad-group-{len(group)}", group=group))
    await all_acknowledged(nc, seq)
    assert_alive(agent)
    await serves_a_switch(nc, agent)


# --------------------------------------------------------------------------- (b) a bounded fuzz

# Values a field may be swapped for: mostly of the field's own type, so the message still decodes and reaches the
# agent's checks (ids that cannot go into a subject, numbers out of bounds), else of any type. The pids and
# process groups among them are never a live process other than the agent's own (refused for ``freeze``): 0, 1
# and negatives, PID_MAX and past it, values no pid_t holds, and the agent's pid (added per run).
_BAD_STR: tuple[str, ...] = (
    "",
    "a.b",
    "a b",
    "*",
    ">",
    "a.>",
    ".",
    "x" * 65,
    "x" * 300,
    "\u00fc",
    "-lead",
    "ok\r\nNats-Msg-Id: x",
    "n2",
    "op id",
    "1",
)
_BAD_INT: tuple[int, ...] = (-1, -7, 0, 1, PID_MAX, PID_MAX + 1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 2**64)
_WRONG: tuple[Any, ...] = (None, True, 1.5, 1e308, [], {}, ["x"], "1", 7)
_ELEMENTS: dict[str, tuple[Any, ...]] = {  # what list fields may hold
    "after": (*_BAD_STR, "fz-1", "fz-2"),
    "pids": _BAD_INT,
    "tags": (*_BAD_STR, "t"),
    "backends": (*_BAD_STR, "freeze", "cuda", "app_endpoint", "app_channel", "noop", "bogus"),
    "endpoints": (*_BAD_STR, "vllm+http://127.0.0.1:1", "nope+ftp://x", "vllm+"),
}


def _junk(rng: random.Random, field: str, value: Any, agent_pid: int) -> Any:
    if rng.random() < 0.2:
        return rng.choice((*_WRONG, *_BAD_STR, *_BAD_INT))
    if field in _ELEMENTS:
        pool = (*_ELEMENTS[field], agent_pid) if field == "pids" else _ELEMENTS[field]
        return [rng.choice(pool) for _ in range(rng.choice([1, 1, 2, 3, 300]))]
    if field == "pgid":
        return rng.choice((*_BAD_INT, agent_pid, None))
    if isinstance(value, bool):
        return rng.choice(_WRONG)
    if isinstance(value, int):
        return rng.choice((*_BAD_INT, agent_pid))
    if field == "type":
        return rng.choice(["snapshot", "restore", "register", "bogus", ""])
    return rng.choice((*_BAD_STR, "op-" + "9" * 300))


def _mutate(rng: random.Random, base: dict[str, Any], agent_pid: int) -> dict[str, Any]:
    """``base`` with one or two fields swapped for junk, dropped, or an unknown field added."""
    out = dict(base)
    for _ in range(rng.choice([1, 1, 2])):
        field = rng.choice([*base, "extra"])
        action = rng.random()
        if action < 0.07:
            out.pop(field, None)
        elif field == "extra":
            out[rng.choice(["extra", "x" * 200])] = rng.choice(_WRONG)
        else:
            out[field] = _junk(rng, field, base[field], agent_pid)
    return out


def _fuzzed(rng: random.Random, agent_pid: int) -> tuple[str, bytes]:
    """One fuzzed message: (``"cmd"`` or an RPC verb, its bytes)."""
    pick = rng.random()
    if pick < 0.05:
        raw = rng.choice([b"", b"{", b"\xff\xfe", b"[]", b"null", b"1", b'{"type":"snapshot"}', b"x" * 5000])
        return rng.choice(["cmd", "register", "unregister", "clear_fault", "status"]), raw
    if pick < 0.55:
        base: dict[str, Any] = {
            "type": rng.choice(["snapshot", "restore"]),
            "op_id": f"fz-{rng.randrange(10**6)}",
            "group": "fg",
            "job": "fz",
            "node": NODE,
            "epoch": rng.randint(0, 5),
            "deadline_ms": _now_ms() + 20_000,
        }
        if base["type"] == "restore":
            base["after"] = [f"fz-{rng.randrange(10)}"]
        return "cmd", json.dumps(_mutate(rng, base, agent_pid)).encode()
    verb = rng.choice(["register", "register", "unregister", "clear_fault", "status"])
    if verb == "register":
        # No pid of a live process: a backend swapped for freeze never has a process to stop.
        base = {
            "type": "register",
            "group": "fg",
            "job": f"fr{rng.randrange(4)}",
            "backends": ["noop"],
            "pids": [],
            "pgid": None,
            "mode": "offload",
            "tags": [],
            "op_timeout_ms": 10_000,
            "endpoints": [],
        }
    elif verb == "unregister":
        base = {"type": "unregister", "group": "fg", "job": "fr0"}
    elif verb == "clear_fault":
        base = {"type": "clear_job_fault", "job": "fz"}
    else:
        return verb, rng.choice([b"", b"junk", json.dumps({"type": "status"}).encode()])
    return verb, json.dumps(_mutate(rng, base, agent_pid)).encode()


async def test_fuzzed_commands_and_requests_never_end_the_agent(agent: OwnSessionAgent, nc: NATS) -> None:
    # A registered job for the fuzzed commands that keep valid ids, so some run into the operation itself.
    fz = RegisterJob(group="fg", job="fz", backends=("noop",), pids=(os.getpid(),))
    assert (await register(nc, agent, encode(fz))).ok
    rng = random.Random(20231)
    counts = {"cmd": 0, "rpc": 0}
    last_seq = 0
    async with asyncio.timeout(120):
        for i in range(200):
            where, data = _fuzzed(rng, agent.pid)
            if where == "cmd":
                last_seq = await publish_command(nc, data)
                counts["cmd"] += 1
                continue
            answer = await rpc(nc, agent, where, data)  # every request is answered
            counts["rpc"] += 1
            if where == "status":
                assert isinstance(msgspec.json.decode(answer), list), answer
            else:
                reply = msgspec.json.decode(answer, type=AgentReply)
                assert reply.ok or reply.error, (i, data, reply)
            if i % 20 == 0:
                assert_alive(agent)
        assert counts["cmd"] >= 50 and counts["rpc"] >= 50, counts
        await all_acknowledged(nc, last_seq)
    assert_alive(agent)
    assert isinstance(msgspec.json.decode(await rpc(nc, agent, "status", b"")), list)
    await serves_a_switch(nc, agent)
    text = agent.log_text()
    assert "Traceback" not in text, f"an unexpected exception in the agent: {text[-4000:]}"
    assert "refused a command" in text and "refused a request" in text


# --------------------------------------------------------------------------- (c) poison across a restart


async def test_a_poison_command_left_in_the_stream_does_not_crash_the_restarted_agent(
    agent: OwnSessionAgent, nc: NATS
) -> None:
    agent.stop()  # its durable consumer stays: commands sent meanwhile wait there
    poison = [
        snapshot_bytes(op_id="p-empty", group=""),
        snapshot_bytes(op_id="p-dot", group="a.b"),
        snapshot_bytes(op_id="p" * 10_000),
        snapshot_bytes(op_id="p-node", node="n2"),
        snapshot_bytes(op_id="p-deadline", deadline_ms=-1),
        snapshot_bytes(op_id="p-epoch", epoch=-3),
        b"not json at all",
        json.dumps(
            {
                "type": "restore",
                "op_id": "p-after",
                "group": "g",
                "job": "j",
                "node": NODE,
                "epoch": 1,
                "deadline_ms": _now_ms() + 30_000,
                "after": ["ok", "a b"],
            }
        ).encode(),
    ]
    seq = 0
    for data in poison:
        seq = await publish_command(nc, data)
    for restart in range(2):  # the second start finds nothing left to redeliver
        agent.start()
        await agent.wait_ready()
        await all_acknowledged(nc, seq)
        assert_alive(agent)
        await serves_a_switch(nc, agent, op_id=f"after-restart-{restart}")
        agent.stop()
        assert agent.proc is not None and agent.proc.returncode == 0, agent.describe()
    assert "Traceback" not in agent.log_text(), agent.log_text()[-4000:]


# --------------------------------------------------------------------------- (d) processes a job cannot be


async def test_registration_naming_a_process_the_agent_must_not_touch_is_refused(
    agent: OwnSessionAgent, nc: NATS
) -> None:
    mine = os.getpid()
    # Each refusal names the value. Some values the wire decoder already refuses (protocol bounds), others only
    # the agent's checks: either message is accepted, as long as it says what was wrong.
    cases: list[tuple[dict[str, Any], tuple[str, ...]]] = [
        ({"pids": (1,)}, ("pid 1 is not a job's process id",)),
        ({"pids": (0,)}, ("pid 0 is not a job's process id",)),
        ({"pids": (-1,)}, ("pid -1 is not a job's process id", "Expected `int` >= 0 - at `$.pids[0]`")),
        ({"pids": (PID_MAX + 1,)}, (f"pid {PID_MAX + 1} is not a job's process id",)),
        ({"pids": (2**40,)}, (f"pid {2**40} is not a job's process id", "at `$.pids[0]`")),
        ({"pids": (), "pgid": 0}, ("pgid 0 is not a job's process group",)),
        ({"pids": (), "pgid": 1}, ("pgid 1 is not a job's process group",)),
        ({"pids": (mine,), "pgid": agent.pid}, (f"pgid {agent.pid} is the agent's own process group",)),
        ({"pids": (agent.pid,), "backends": ("freeze",)}, (f"pid {agent.pid} is the agent's own process",)),
        ({"pids": (agent.pid,), "backends": ("noop", "freeze")}, (f"pid {agent.pid} is the agent's own process",)),
        ({"pids": tuple(range(2, 2000))}, ("1998 pids (at most 1024)",)),
        ({"tags": ("t",) * 100}, ("100 tags (at most 64)", "at `$.tags`")),
        ({"backends": ("noop",) * 3}, ("each at most once",)),
        ({"op_timeout_ms": 0}, ("op_timeout_ms 0 is not in", "at `$.op_timeout_ms`")),
        ({"op_timeout_ms": -5}, ("op_timeout_ms -5 is not in", "at `$.op_timeout_ms`")),
        ({"group": "a.b"}, ("invalid group id 'a.b'",)),
        ({"job": ""}, ("invalid job id ''", "names job ''")),
    ]
    for i, (fields, expected) in enumerate(cases):
        req: dict[str, Any] = {"group": "g", "job": f"r{i}", "backends": ("noop",), "pids": (mine,), **fields}
        reply = await register(nc, agent, encode(RegisterJob(**req)))
        assert not reply.ok and reply.error and any(e in reply.error for e in expected), (fields, reply)
    assert await agent.jobs() == {}, "a refused registration was stored"
    # The agent's own pid, for a backend that never acts on processes, only says the job lives while it does.
    same = await register(
        nc, agent, encode(RegisterJob(group="g", job="beside", backends=("noop",), pids=(agent.pid,)))
    )
    assert same.ok, same
    assert_alive(agent)
    await serves_a_switch(nc, agent)


# --------------------------------------------------------------------------- in process: answers and metrics


def _value(agent: Agent, name: str, **labels: str) -> float:
    got = agent.metrics.registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


async def test_a_group_record_the_agent_cannot_use_is_counted_and_the_registration_goes_on(
    nats_url: str, nc: NATS
) -> None:
    """A job registering afresh starts at its group's epoch from KV ``groups``. A record there that is not JSON, that
    names another group or whose epoch is out of bounds is refused as a job context read back is: logged, counted,
    and the job starts at the epoch this agent saw (none here: 0). A usable record gives its epoch."""
    node = "node-g"
    cfg = AgentConfig(node_id=node, nats_url=nats_url)
    buckets = await ensure_bus(nc.jetstream(), cfg.bus)
    await buckets.groups.put("g-garbage", b"{not json")
    await buckets.groups.put("g-other", encode(GroupRecord(group="g-else", epoch=7)))
    await buckets.groups.put("g-huge", encode(GroupRecord(group="g-huge", epoch=2**60)))
    await buckets.groups.put("g-ok", encode(GroupRecord(group="g-ok", epoch=12)))
    async with running(Agent(cfg)) as agent:
        for i, group in enumerate(("g-garbage", "g-other", "g-huge", "g-ok")):
            req = RegisterJob(group=group, job=f"j{i}", backends=("noop",), pids=(os.getpid(),))
            assert (await agent.register(req)).ok
        epochs = {c.group: c.epoch for c in agent.jobs().values()}
        assert epochs == {"g-garbage": 0, "g-other": 0, "g-huge": 0, "g-ok": 12}, epochs
        for reason in ("undecodable", "wrong_subject", "out_of_range"):
            assert _value(agent, "timeslice_agent_refused_total", source="kv", reason=reason) == 1, reason


async def test_refusals_are_answered_where_they_can_be_and_counted(nats_url: str, nc: NATS) -> None:
    node = "node-u"
    cfg = AgentConfig(node_id=node, nats_url=nats_url)
    # Job contexts in KV that are not this agent's to use: read back at start, skipped and counted.
    buckets = await ensure_bus(nc.jetstream(), cfg.bus)
    await buckets.jobs.put(f"{node}.garbage", b"{not json")
    elsewhere = JobContext(node="other-node", job="elsewhere", group="g", state=JobState.IDLE, backends=("noop",))
    await buckets.jobs.put(f"{node}.elsewhere", encode(elsewhere))
    frozen_self = JobContext(node=node, job="self", group="g", state=JobState.IDLE, backends=("freeze",), pgid=0)
    await buckets.jobs.put(f"{node}.self", encode(frozen_self))
    async with running(Agent(cfg)) as agent:
        assert _value(agent, "timeslice_agent_refused_total", source="kv", reason="undecodable") == 1
        assert _value(agent, "timeslice_agent_refused_total", source="kv", reason="wrong_node") == 1
        assert _value(agent, "timeslice_agent_refused_total", source="kv", reason="forbidden_process") == 1
        assert agent.jobs() == {}
        results = await nc.subscribe(subjects.agent_event(node, "g"))
        late = Snapshot(op_id="late-1", group="g", job="j", node=node, epoch=2, deadline_ms=-1)
        # take() leaves a malformed command to the stream copy (which is refused there and answered).
        assert agent.take(late, asyncio.Event()) is False
        cmd = subjects.agent_cmd(node)
        js = nc.jetstream()
        await js.publish(cmd, encode(late))
        await js.publish(
            cmd,
            json.dumps(
                {
                    "type": "snapshot",
                    "op_id": "o",
                    "group": "",
                    "job": "j",
                    "node": node,
                    "epoch": 1,
                    "deadline_ms": _now_ms(),
                }
            ).encode(),
        )
        await js.publish(
            cmd,
            encode(
                Restore(
                    op_id="far-1",
                    group="g",
                    job="j",
                    node=node,
                    epoch=2,
                    deadline_ms=_now_ms() + 200 * 365 * 24 * 3600 * 1000,
                )
            ),
        )
        await js.publish(cmd, b"\x00garbage")
        answers: dict[str, OpResult] = {}

        async def answered() -> bool:
            try:
                msg = await results.next_msg(timeout=0.5)
            except TimeoutError:
                return False
            r = msgspec.json.decode(msg.data, type=OpResult)
            answers[r.op_id] = r
            return set(answers) >= {"late-1", "far-1"}

        await eventually(answered, timeout=10, what="the refusals answered")
        assert not answers["late-1"].ok and "deadline_ms -1" in (answers["late-1"].error or ""), answers
        assert not answers["far-1"].ok and "at most 100 years ahead" in (answers["far-1"].error or ""), answers
        assert (answers["late-1"].epoch, answers["late-1"].node, answers["late-1"].backend) == (2, node, "none")

        def counted() -> bool:
            return (
                _value(agent, "timeslice_agent_refused_total", source="command", reason="out_of_range") == 2
                and _value(agent, "timeslice_agent_refused_total", source="command", reason="invalid_id") == 1
                and _value(agent, "timeslice_agent_refused_total", source="command", reason="undecodable") == 1
            )

        await eventually(counted, timeout=10, what="the refusals counted")
        bad = await nc.request(
            subjects.agent_rpc(node, "register", "j"),
            encode(RegisterJob(group="g", job="j", backends=("noop",), pids=(1,))),
            timeout=5,
        )
        assert not msgspec.json.decode(bad.data, type=AgentReply).ok
        assert _value(agent, "timeslice_agent_refused_total", source="rpc", reason="forbidden_process") == 1
        await results.unsubscribe()

        # A command naming a group its job is not registered in: refused, the job untouched.
        own = await nc.request(
            subjects.agent_rpc(node, "register", "j"),
            encode(RegisterJob(group="g", job="j", backends=("noop",), pids=(os.getpid(),))),
            timeout=5,
        )
        assert msgspec.json.decode(own.data, type=AgentReply).ok
        other = await nc.subscribe(subjects.agent_event(node, "h"))
        await js.publish(
            cmd,
            encode(
                Snapshot(op_id="wrong-group", group="h", job="j", node=node, epoch=9, deadline_ms=_now_ms() + 30_000)
            ),
        )
        msg = await other.next_msg(timeout=10)
        wrong = msgspec.json.decode(msg.data, type=OpResult)
        assert (wrong.op_id, wrong.ok) == ("wrong-group", False), wrong
        assert "registered in group 'g'" in (wrong.error or ""), wrong
        assert agent.jobs()["j"].state is JobState.IDLE and agent.jobs()["j"].epoch == 0
        await other.unsubscribe()
        assert _value(agent, "timeslice_agent_task_errors_total", task="operation") == 0


# --------------------------------------------------------------------------- gRPC (SnapshotAgentService)


async def test_malformed_grpc_calls_are_invalid_argument_and_counted(nats_url: str, nc: NATS) -> None:
    import grpc
    from timeslice_agent.grpc_shim import AgentGrpcConfig, AgentGrpcShim
    from timeslice_client._grpc import snapshot_agent_pb2 as pb
    from timeslice_client._grpc import snapshot_agent_pb2_grpc as pb_grpc

    node = "node-rpc"
    async with running(Agent(AgentConfig(node_id=node, nats_url=nats_url))) as agent:
        reg = await nc.request(
            subjects.agent_rpc(node, "register", "j"),
            encode(RegisterJob(group="g", job="j", backends=("noop",), pids=(os.getpid(),))),
            timeout=5,
        )
        assert msgspec.json.decode(reg.data, type=AgentReply).ok
        shim = AgentGrpcShim(agent, AgentGrpcConfig(host="127.0.0.1", port=0))
        port = await shim.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.SnapshotAgentServiceStub(channel)
                many = pb.BackendConfig(
                    app_endpoint=pb.AppEndpointConfig(
                        app=pb.APP_VLLM, endpoints=[f"http://127.0.0.1:{8000 + i}" for i in range(100)]
                    )
                )
                calls: list[tuple[Any, str]] = [
                    (stub.Snapshot(pb.SnapshotRequest(job_id="a.b"), timeout=5), "invalid job id 'a.b'"),
                    (stub.Snapshot(pb.SnapshotRequest(job_id="j" * 10_000), timeout=5), "(10002 chars)"),
                    (stub.Restore(pb.RestoreRequest(job_id="j", group="a b"), timeout=5), "invalid group id"),
                    (
                        stub.GetOperation(pb.GetOperationRequest(operation_id="o" * 10_000), timeout=5),
                        "invalid operation_id",
                    ),
                    (
                        stub.Snapshot(pb.SnapshotRequest(job_id="j", backend_config=many), timeout=5),
                        "100 endpoints (at most 16)",
                    ),
                ]
                for call, expected in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value
                    assert expected in (err.value.details() or ""), err.value.details()
                    assert len(err.value.details() or "") < 1000
                status = await stub.Status(pb.StatusRequest(), timeout=5)  # still serving
                assert [j.job_id for j in status.job_statuses] == ["j"]
        finally:
            await shim.stop()
        assert _value(agent, "timeslice_agent_refused_total", source="grpc", reason="invalid_id") == 4
        assert _value(agent, "timeslice_agent_refused_total", source="grpc", reason="too_large") == 1
        assert agent.jobs()["j"].backends == ("noop",), "a refused call changed the job's configuration"


async def test_a_stream_message_pushed_at_the_agents_deliver_subject_is_not_a_command(
    agent: OwnSessionAgent, nc: NATS
) -> None:
    """A push consumer delivers stored messages to any subject its creator names, and the agent's deliver subject is
    in its consumer's info. A job stores a Snapshot-shaped payload under its own subject; a consumer of it delivers
    that at the agent: the copy keeps the job's subject, and the agent refuses it (only the orchestrator publishes on
    the command subject). The job is not snapshotted; a real command still is."""
    js = nc.jetstream()
    req = RegisterJob(group="ok", job="fine", backends=("noop",), pids=(os.getpid(),))
    assert (await register(nc, agent, encode(req))).ok
    deliver = (await js.consumer_info(STREAM, DURABLE)).config.deliver_subject
    assert deliver
    forged = subjects.job("ok", "fine", "phase")  # any subject the job may publish on
    await js.publish(forged, snapshot_bytes(op_id="op-pushed", group="ok", job="fine"), timeout=5)
    await js.add_consumer(
        STREAM,
        ConsumerConfig(
            deliver_subject=deliver, filter_subject=forged, deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE
        ),
    )
    await eventually(
        lambda: "not from the command subject" in agent.log_text(), timeout=15, what="the pushed copy refused"
    )
    fine = (await agent.jobs())["fine"]
    assert fine["state"] != "SAVED" and fine.get("last_op_id") != "op-pushed", fine
    await serves_a_switch(nc, agent, op_id="op-real")  # the real command subject still works
