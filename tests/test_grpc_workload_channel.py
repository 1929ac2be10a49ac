"""The agent's ``WorkloadChannel`` (the reference API's bidirectional stream), against a real nats-server, the
orchestrator and the agent in this process, and workloads in a process of their own whose stubs protoc generated
from ``tests/reference_api/snapshot_agent_ref.proto`` alone (``tests/workers/reference_workload.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_tools import protoc
from nats.js.errors import KeyNotFoundError
from timeslice_agent import Agent, AgentConfig
from timeslice_agent.grpc_shim import AgentGrpcConfig, AgentGrpcShim
from timeslice_client import AsyncTimeSliceClient, JobState, SuspendMode
from timeslice_client.bus import connect
from timeslice_client.protocol import JOBS_BUCKET, JobUnregistered, decode_input, subjects
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .grpc_helpers import shim_target
from .grpc_proto_client import AGENT_PROTO, Stub, compile_proto
from .helpers import eventually, group_record, running

ROOT = Path(__file__).resolve().parents[1]
REF_PROTO = ROOT / "tests" / "reference_api" / "snapshot_agent_ref.proto"
WORKER = ROOT / "tests" / "workers" / "reference_workload.py"
NODE = "node-wc"
OFFLOAD, DISCARD = 1, 2  # SuspendMode's numbers on the wire
Event = dict[str, Any]


@pytest.fixture(scope="module")
def ref_stubs() -> Iterator[Path]:
    """protoc's Python stubs of the reference API (messages and the service's stub), in a directory of their own."""
    include = str(resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory(prefix="ts-ref-stubs-") as out:
        rc = protoc.main(
            [
                "protoc",
                f"-I{REF_PROTO.parent}",
                f"-I{include}",
                f"--python_out={out}",
                f"--grpc_python_out={out}",
                REF_PROTO.name,
            ]
        )
        assert rc == 0, "protoc failed on the reference API"
        yield Path(out)


@pytest.fixture
async def agent(nats_url: str) -> AsyncIterator[Agent]:
    async with (
        running(Orchestrator(OrchestratorConfig(nats_url=nats_url))),
        running(Agent(AgentConfig(node_id=NODE, nats_url=nats_url))) as a,
    ):
        yield a


@pytest.fixture
async def target(agent: Agent) -> AsyncIterator[str]:
    async with shim_target(agent) as t:  # local callers: the workload's uid
        yield t


class RefWorkload:
    """The workload process: ``await w.do(op=..., ...)`` asks it, ``await w.event(...)`` waits for what it reports."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr: Path) -> None:
        self.proc, self.stderr = proc, stderr
        self.events: list[Event] = []
        self._taken: set[int] = set()

    async def do(self, **req: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        await self.proc.stdin.drain()
        await self.event(lambda e: e["event"] == "done" and e["op"] == req["op"])

    async def event(self, match: Callable[[Event], bool], timeout: float = 15.0) -> Event:
        """The first event not taken yet that ``match``es, waiting for it at most ``timeout`` s."""
        async with asyncio.timeout(timeout):
            i = 0
            while True:
                while i < len(self.events):
                    if i not in self._taken and match(self.events[i]):
                        self._taken.add(i)
                        return self.events[i]
                    i += 1
                assert self.proc.stdout is not None
                line = await self.proc.stdout.readline()
                assert line, f"the workload process ended: {self.stderr.read_text()[-2000:]}"
                self.events.append(json.loads(line))

    def commands(self, stream: str) -> list[Event]:
        return [e for e in self.events if e["event"] == "command" and e["stream"] == stream]

    async def command(self, stream: str, kind: str) -> Event:
        return await self.event(lambda e: e["event"] == "command" and e["stream"] == stream and e["kind"] == kind)

    async def ended(self, stream: str) -> Event:
        return await self.event(lambda e: e["event"] == "ended" and e["stream"] == stream)


@pytest.fixture
async def workload(target: str, ref_stubs: Path, tmp_path: Path) -> AsyncIterator[RefWorkload]:
    async with _workload_process(target, ref_stubs, tmp_path) as w:
        yield w


@contextlib.asynccontextmanager
async def _workload_process(target: str, ref_stubs: Path, tmp_path: Path) -> AsyncIterator[RefWorkload]:
    stderr = tmp_path / "reference_workload.stderr"
    with stderr.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            "--target",
            target,
            "--stubs",
            str(ref_stubs),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
    w = RefWorkload(proc, stderr)
    try:
        await w.event(lambda e: e["event"] == "ready")
        yield w
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


@contextlib.contextmanager
def agent_api(target: str) -> Iterator[tuple[Any, Any]]:
    """The unary calls (Snapshot, Restore, GetOperation, Status) from the published proto alone."""
    pb = compile_proto(AGENT_PROTO)
    with grpc.insecure_channel(target) as ch:
        yield Stub(ch, pb, "SnapshotAgentService"), pb


async def finished(stub: Any, pb: Any, op_id: str) -> Any:
    async def done() -> Any:
        r = await asyncio.to_thread(stub.GetOperation, pb.GetOperationRequest(operation_id=op_id), timeout=5)
        return r if r.status != pb.OPERATION_STATUS_PENDING else None

    return await eventually(done, what=f"operation {op_id} ended")


async def queued(c: AsyncTimeSliceClient, job: str) -> bool:
    return job in [w.job for w in (await group_record(c)).queue]


def registered(agent: Agent, job: str) -> Callable[[], bool]:
    return lambda: job in agent.jobs()


async def test_switches_drive_the_stream(agent: Agent, workload: RefWorkload, nats_url: str) -> None:
    """Two jobs registered through WorkloadChannel share the node: the orchestrator's switches reach each job's
    workload as SnapshotCommand/RestoreCommand on its stream, and the job's results decide the switch."""
    for job in ("a", "b"):
        await workload.do(op="open", stream=job, job=job, group="g", modes=[OFFLOAD], default=OFFLOAD)
        await eventually(registered(agent, job), what=f"job {job} registered")
    assert agent.jobs()["a"].backends == ("app_channel",) and agent.jobs()["a"].group == "g"
    async with AsyncTimeSliceClient("a", "g", nats_url) as a, AsyncTimeSliceClient("b", "g", nats_url) as b:
        await a.acquire(timeout=15)  # a never ran: nothing to restore, nothing sent
        await eventually(lambda: agent.jobs()["a"].state is JobState.RUNNING)
        waiting = asyncio.create_task(b.acquire(timeout=15))
        await eventually(lambda: queued(a, "b"), what="b waits")
        await a.release()
        snap = await workload.command("a", "snapshot")
        assert (snap["mode"], snap["tags"]) == (OFFLOAD, [])
        grant = await waiting
        assert grant.context_restored is True
        assert agent.jobs()["a"].state is JobState.SAVED
        # back to a: b is suspended, a resumed, each on its own stream; then a's failing suspend faults nothing
        # of b's
        waiting = asyncio.create_task(a.acquire(timeout=15))
        await eventually(lambda: agent.jobs()["b"].state is JobState.RUNNING)
        await eventually(lambda: queued(b, "a"), what="a waits")
        await b.release()
        await workload.command("b", "snapshot")
        restore = await workload.command("a", "restore")
        assert restore["tags"] == []
        await waiting
        assert agent.jobs()["a"].state is JobState.RUNNING and agent.jobs()["b"].state is JobState.SAVED
        assert [c["kind"] for c in workload.commands("a")] == ["snapshot", "restore"]
        assert [c["kind"] for c in workload.commands("b")] == ["snapshot"]
        # a failed result is honoured: the suspend failed (and undid itself), so a keeps running
        await workload.do(op="fail_next", stream="a", error="no host memory left")
        waiting = asyncio.create_task(b.acquire(timeout=15))
        await eventually(lambda: queued(a, "b"), what="b waits again")
        await a.release()
        await workload.command("a", "snapshot")
        await eventually(lambda: agent.jobs()["a"].last_op_ok is False, what="a's failed suspend recorded")
        assert "no host memory left" in (agent.jobs()["a"].last_op_error or "")
        assert agent.jobs()["a"].state is JobState.RUNNING
        waiting.cancel()
        with contextlib.suppress(BaseException):
            await waiting


async def test_default_and_one_off_modes_and_an_unsupported_one(
    agent: Agent, workload: RefWorkload, target: str
) -> None:
    await workload.do(
        op="open", stream="m", job="m", modes=[OFFLOAD, DISCARD], default=DISCARD, tags=["weights", "kv_cache"]
    )
    await workload.do(op="open", stream="t", job="t", group="trainers", modes=[OFFLOAD])
    await eventually(registered(agent, "m"))
    await eventually(registered(agent, "t"))
    assert agent.jobs()["m"].mode is SuspendMode.DISCARD and agent.jobs()["m"].group == "standalone"
    with agent_api(target) as (s, pb):
        channel = pb.BackendConfig(app_channel=pb.AppChannelConfig())
        # the registration's default mode, for a snapshot that names none
        op = await asyncio.to_thread(s.Snapshot, pb.SnapshotRequest(job_id="m", backend_config=channel), timeout=5)
        assert (await finished(s, pb, op.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
        cmd = await workload.command("m", "snapshot")
        assert (cmd["mode"], cmd["tags"]) == (DISCARD, [])
        op = await asyncio.to_thread(s.Restore, pb.RestoreRequest(job_id="m"), timeout=5)
        assert (await finished(s, pb, op.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
        await workload.command("m", "restore")
        # a one-off mode and tags, this snapshot's alone; its restore brings the same tags back
        once = pb.BackendConfig(app_channel=pb.AppChannelConfig(mode=pb.SUSPEND_MODE_OFFLOAD, tags=["weights"]))
        op = await asyncio.to_thread(s.Snapshot, pb.SnapshotRequest(job_id="m", backend_config=once), timeout=5)
        assert (await finished(s, pb, op.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
        cmd = await workload.command("m", "snapshot")
        assert (cmd["mode"], cmd["tags"]) == (OFFLOAD, ["weights"])
        op = await asyncio.to_thread(s.Restore, pb.RestoreRequest(job_id="m"), timeout=5)
        assert (await finished(s, pb, op.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
        assert (await workload.command("m", "restore"))["tags"] == ["weights"]
        assert agent.jobs()["m"].mode is SuspendMode.DISCARD  # the registered default stays
        # a mode the trainer did not declare: refused, typed, and nothing is sent to it
        discard = pb.BackendConfig(app_channel=pb.AppChannelConfig(mode=pb.SUSPEND_MODE_DISCARD))
        with pytest.raises(grpc.RpcError) as info:
            await asyncio.to_thread(s.Snapshot, pb.SnapshotRequest(job_id="t", backend_config=discard), timeout=5)
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "offload only, not discard" in (info.value.details() or "")
        assert agent.jobs()["t"].state is JobState.IDLE
        op = await asyncio.to_thread(s.Snapshot, pb.SnapshotRequest(job_id="t", backend_config=channel), timeout=5)
        assert (await finished(s, pb, op.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
        await workload.command("t", "snapshot")
        assert [(c["kind"], c["mode"]) for c in workload.commands("t")] == [("snapshot", OFFLOAD)]
    # a registration whose default is not among its supported modes is refused
    await workload.do(op="open", stream="bad", job="bad", modes=[DISCARD])
    ended = await workload.ended("bad")
    assert ended["code"] == "INVALID_ARGUMENT" and "declare default_mode" in ended["details"]
    assert "bad" not in agent.jobs()


async def test_the_stream_ending_ends_its_registration(agent: Agent, workload: RefWorkload, target: str) -> None:
    await workload.do(op="open", stream="c", job="c", group="g2")
    await eventually(registered(agent, "c"))
    await workload.do(op="close", stream="c")  # the workload is done: it ends its requests
    assert (await workload.ended("c"))["code"] == "OK"
    await eventually(lambda: "c" not in agent.jobs(), what="c's registration ended with its stream")
    # a stream cancelled while a command waits for its answer: that operation fails at once, not at its deadline
    await workload.do(op="open", stream="d", job="d", group="g2")
    await eventually(registered(agent, "d"))
    await workload.do(op="hold_next", stream="d")
    with agent_api(target) as (s, pb):
        op = await asyncio.to_thread(s.Snapshot, pb.SnapshotRequest(job_id="d"), timeout=5)
        await workload.command("d", "snapshot")
        await workload.do(op="cancel", stream="d")
        r = await finished(s, pb, op.operation_id)
        assert r.status == pb.OPERATION_STATUS_FAILED and "closed before the workload answered" in r.error
        assert r.elapsed_ms < 10_000  # the operation's budget is 120 s
    await eventually(lambda: "d" not in agent.jobs(), what="d's registration ended with its stream")


def _hex(pb: Any, **fields: Any) -> str:
    return str(pb.WorkloadMessage(**fields).SerializeToString().hex())


async def test_malformed_messages_are_refused_and_the_agent_serves_on(
    agent: Agent, workload: RefWorkload, target: str
) -> None:
    pb = compile_proto(AGENT_PROTO)  # only to write the malformed messages' bytes
    caps = pb.WorkloadCapabilities
    firsts = {
        "result-first": _hex(pb, result=pb.CommandResult(command_id="x", ok=True)),
        "no-job": _hex(pb, register=pb.RegisterWorkload()),
        "bad-job": _hex(pb, register=pb.RegisterWorkload(job_id="no such job")),
        "long-job": _hex(pb, register=pb.RegisterWorkload(job_id="j" * 65)),
        "many-tags": _hex(pb, register=pb.RegisterWorkload(job_id="j", capabilities=caps(tags=["t"] * 33))),
        "long-tag": _hex(pb, register=pb.RegisterWorkload(job_id="j", capabilities=caps(tags=["t" * 65]))),
        "odd-mode": _hex(pb, register=pb.RegisterWorkload(job_id="j", capabilities=caps(supported_modes=[7]))),
        "many-modes": _hex(pb, register=pb.RegisterWorkload(job_id="j", capabilities=caps(supported_modes=[1] * 9))),
        "empty": "",
        "garbage": "ffffffff",
    }
    for name, first in firsts.items():
        await workload.do(op="open_raw", stream=name, first=first)
        ended = await workload.ended(name)
        assert ended["code"] == "INVALID_ARGUMENT", (name, ended)
    assert (
        "must be a RegisterWorkload"
        in next(e for e in workload.events if e.get("stream") == "result-first" and e["event"] == "ended")["details"]
    )
    assert agent.jobs() == {}
    # a registered stream that sends a second registration, or a result without a command id, is ended; its
    # registration with it
    for name, later in (
        ("twice", _hex(pb, register=pb.RegisterWorkload(job_id="e"))),
        ("no-id", _hex(pb, result=pb.CommandResult(ok=True))),
    ):
        await workload.do(op="open", stream=name, job="e", group="g3")
        await eventually(registered(agent, "e"))
        await workload.do(op="send_raw", stream=name, data=later)
        assert (await workload.ended(name))["code"] == "INVALID_ARGUMENT"
        await eventually(lambda: "e" not in agent.jobs(), what="the malformed stream's registration ended")
    # the agent serves on: a good registration works, and so do the other calls
    await workload.do(op="open", stream="good", job="good", group="g3")
    await eventually(registered(agent, "good"))
    with agent_api(target) as (s, apb):
        st = await asyncio.to_thread(s.Status, apb.StatusRequest(), timeout=5)
        assert [j.job_id for j in st.job_statuses] == ["good"]
    assert agent.metrics.refused.labels("grpc", "undecodable")._value.get() >= 4


async def test_a_second_stream_of_the_job_takes_the_first_ones_place(
    agent: Agent, workload: RefWorkload, target: str
) -> None:
    """As the reference agent does (its client registers again on each reconnect): the newer stream takes the job's
    commands, the older one ends (ABORTED), and the job keeps its state."""
    await workload.do(op="open", stream="s1", job="r", group="g4")
    await eventually(registered(agent, "r"))
    first_token = agent.jobs()["r"].channel
    with agent_api(target) as (s, pb):
        op = await asyncio.to_thread(s.Snapshot, pb.SnapshotRequest(job_id="r"), timeout=5)
        assert (await finished(s, pb, op.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
        await workload.command("s1", "snapshot")
        await workload.do(op="open", stream="s2", job="r", group="g4")
        ended = await workload.ended("s1")
        assert ended["code"] == "ABORTED" and "replaced by a newer registration" in ended["details"]
        await eventually(lambda: agent.jobs()["r"].channel != first_token, what="the second stream registered")
        assert agent.jobs()["r"].state is JobState.SAVED  # what the first stream's workload did stands
        op = await asyncio.to_thread(s.Restore, pb.RestoreRequest(job_id="r"), timeout=5)
        assert (await finished(s, pb, op.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
        await workload.command("s2", "restore")
        assert [c["kind"] for c in workload.commands("s1")] == ["snapshot"]
    assert "r" in agent.jobs()  # the first stream's end did not end the second's registration
    await workload.do(op="close", stream="s2")
    await eventually(lambda: "r" not in agent.jobs())


async def test_no_stream_registration_outlives_its_agent(nats_url: str, ref_stubs: Path, tmp_path: Path) -> None:
    """An agent that stops leaves its streams' registrations in KV ``jobs`` (nobody can end them then); the next
    agent on the node drops them when it reads the jobs back, and says the job is gone."""
    cfg = AgentConfig(node_id=NODE, nats_url=nats_url)
    async with contextlib.AsyncExitStack() as streams, running(Agent(cfg)) as first:
        shim = AgentGrpcShim(first, AgentGrpcConfig(host="127.0.0.1", port=0))
        streams.push_async_callback(shim.stop)  # after the agent stopped, as ``run_beside`` stops them
        w = await streams.enter_async_context(_workload_process(f"127.0.0.1:{await shim.start()}", ref_stubs, tmp_path))
        await w.do(op="open", stream="x", job="x", group="g5")
        await eventually(registered(first, "x"))
    # the agent stopped first, its stream open till then
    nc = await connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(JOBS_BUCKET)
        assert (await kv.get(f"{NODE}.x")).value  # left behind
        events = await nc.subscribe(subjects.agent_event(NODE, "g5"))
        async with running(Agent(cfg)) as second:
            assert "x" not in second.jobs()
            gone = decode_input((await events.next_msg(timeout=10)).data)
            assert isinstance(gone, JobUnregistered) and gone.job == "x"
        with pytest.raises(KeyNotFoundError):
            await kv.get(f"{NODE}.x")
    finally:
        await nc.close()


async def test_only_a_caller_that_may_act_as_the_job_registers_it(nats_url: str) -> None:
    """The door of Snapshot and Restore: a token of job A registers A, not B; no credential is UNAUTHENTICATED."""
    from timeslice_client._grpc import snapshot_agent_pb2 as pb
    from timeslice_client._grpc import snapshot_agent_pb2_grpc as pb_grpc

    from .grpc_identity_helpers import new_account, public, user_jwt

    account = new_account()
    token = (("authorization", f"Bearer {user_jwt(account, 'job', job='job-a')}"),)
    async with running(Agent(AgentConfig(node_id=NODE, nats_url=nats_url))) as agent:
        cfg = AgentGrpcConfig(host="127.0.0.1", port=0, trust_account=public(account), local_callers=False)
        shim = AgentGrpcShim(agent, cfg)
        port = await shim.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.SnapshotAgentServiceStub(ch)

                async def refusal(job: str, metadata: Any) -> grpc.StatusCode:
                    call = stub.WorkloadChannel(metadata=metadata, timeout=10)
                    await call.write(pb.WorkloadMessage(register=pb.RegisterWorkload(job_id=job, group="g6")))
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call.read()
                    return err.value.code()

                assert await refusal("job-b", token) is grpc.StatusCode.PERMISSION_DENIED
                assert await refusal("job-a", None) is grpc.StatusCode.UNAUTHENTICATED
                assert agent.jobs() == {}
                call = stub.WorkloadChannel(metadata=token, timeout=10)
                await call.write(pb.WorkloadMessage(register=pb.RegisterWorkload(job_id="job-a", group="g6")))
                await eventually(registered(agent, "job-a"))
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF
                await eventually(lambda: "job-a" not in agent.jobs())
        finally:
            await shim.stop()
