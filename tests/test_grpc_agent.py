"""The snapshot agent's standalone gRPC API (SnapshotAgentService): a client built from the .proto
alone, and ``SnapshotAgentClient``, against a real agent on a real nats-server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from timeslice_agent import Agent, AgentConfig
from timeslice_agent.grpc_shim import AgentGrpcConfig
from timeslice_client import AsyncTimeSliceClient, CallbackHandler, HandlerResult, JobState, SuspendMode
from timeslice_client.agent_client import (
    AgentError,
    AppChannel,
    AsyncSnapshotAgentClient,
    Cuda,
    OperationFailed,
    OperationNotFound,
    OperationState,
    SnapshotAgentClient,
)
from timeslice_client.errors import InvalidRequest

from .grpc_helpers import call, rpc_error, shim_target
from .grpc_proto_client import AGENT_PROTO, Stub, compile_proto
from .helpers import eventually, running

NODE = "node-g"


@pytest.fixture
async def agent(nats_url: str) -> AsyncIterator[Agent]:
    async with running(Agent(AgentConfig(node_id=NODE, nats_url=nats_url))) as a:
        yield a


@pytest.fixture
async def target(agent: Agent) -> AsyncIterator[str]:
    async with shim_target(agent) as t:
        yield t


class Workload:
    """A registered workload whose suspend/resume report bytes, and can be held or made to fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, SuspendMode, frozenset[str]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_suspend = False

    def handler(self) -> CallbackHandler:
        def suspend(mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
            self.gate.wait(10)
            if self.fail_suspend:
                raise RuntimeError("no host memory left")
            self.calls.append(("suspend", mode, tags))
            return HandlerResult(bytes_moved=4096, device_bytes_freed=4000)

        def resume(mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
            self.calls.append(("resume", mode, tags))
            return HandlerResult(bytes_moved=4096, device_bytes_freed=0)

        return CallbackHandler(suspend, resume)


@pytest.fixture
async def workload(nats_url: str, agent: Agent) -> AsyncIterator[Workload]:
    w = Workload()
    async with AsyncTimeSliceClient("trainer", "solo", nats_url) as c:
        await c.register_workload(w.handler(), node_id=NODE)
        yield w


async def test_standalone_snapshot_and_restore_proto_only(target: str, workload: Workload) -> None:
    pb = compile_proto(AGENT_PROTO)
    with grpc.insecure_channel(target) as ch:
        s = Stub(ch, pb, "SnapshotAgentService")
        st = await call(s.Status, pb.StatusRequest(), timeout=5)
        assert [(j.job_id, j.state) for j in st.job_statuses] == [("trainer", pb.JOB_STATE_IDLE)]

        def op(op_id: str) -> Any:
            return s.GetOperation(pb.GetOperationRequest(operation_id=op_id), timeout=5)

        async def finished(op_id: str) -> Any:
            r = await call(op, op_id)
            return r if r.status != pb.OPERATION_STATUS_PENDING else None

        # snapshot through the workload channel, offload mode with tags
        cfg = pb.BackendConfig(app_channel=pb.AppChannelConfig(mode=pb.SUSPEND_MODE_OFFLOAD, tags=["weights"]))
        snap = await call(s.Snapshot, pb.SnapshotRequest(job_id="trainer", group="solo", backend_config=cfg), timeout=5)
        assert snap.operation_id
        r = await eventually(lambda: finished(snap.operation_id), what="snapshot done")
        assert r.status == pb.OPERATION_STATUS_COMPLETE
        assert (r.storage_bytes, r.snapshot_device_bytes) == (4096, 4000) and not r.HasField("error")
        assert r.elapsed_ms >= 0
        assert workload.calls == [("suspend", SuspendMode.OFFLOAD, frozenset({"weights"}))]
        st = await call(s.Status, pb.StatusRequest(), timeout=5)
        assert [(j.job_id, j.state) for j in st.job_statuses] == [("trainer", pb.JOB_STATE_SAVED)]

        # restore with the registered backends (no backend_config)
        rest = await call(s.Restore, pb.RestoreRequest(job_id="trainer"), timeout=5)
        r = await eventually(lambda: finished(rest.operation_id), what="restore done")
        assert r.status == pb.OPERATION_STATUS_COMPLETE and r.storage_bytes == 4096
        assert [c[0] for c in workload.calls] == ["suspend", "resume"]

        # restoring a job that already runs completes at once, with a real operation id of its own
        again = await call(s.Restore, pb.RestoreRequest(job_id="trainer"), timeout=5)
        assert again.operation_id and again.operation_id != rest.operation_id
        r = await call(op, again.operation_id)
        assert r.status == pb.OPERATION_STATUS_COMPLETE
        assert len(workload.calls) == 2  # nothing moved

        err = await rpc_error(op, "no-such-operation")
        assert err.code() is grpc.StatusCode.NOT_FOUND

        # an operation that takes a while is PENDING meanwhile
        workload.gate.clear()
        slow = await call(s.Snapshot, pb.SnapshotRequest(job_id="trainer"), timeout=5)
        r = await call(op, slow.operation_id)
        assert r.status == pb.OPERATION_STATUS_PENDING and not r.HasField("storage_bytes")
        st = await call(s.Status, pb.StatusRequest(), timeout=5)
        assert st.job_statuses[0].state == pb.JOB_STATE_TRANSITIONING
        workload.gate.set()
        r = await eventually(lambda: finished(slow.operation_id))
        assert r.status == pb.OPERATION_STATUS_COMPLETE


async def test_refusals(target: str, workload: Workload) -> None:
    pb = compile_proto(AGENT_PROTO)
    with grpc.insecure_channel(target) as ch:
        s = Stub(ch, pb, "SnapshotAgentService")
        err = await rpc_error(s.Snapshot, pb.SnapshotRequest(job_id="no such job"), timeout=5)
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
        err = await rpc_error(s.Snapshot, pb.SnapshotRequest(job_id="stranger"), timeout=5)
        assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and "not registered" in (err.details() or "")
        err = await rpc_error(s.Snapshot, pb.SnapshotRequest(job_id="trainer", group="other"), timeout=5)
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "solo" in (err.details() or "")
        unsupported = [
            pb.BackendConfig(direct_memory=pb.DirectMemoryBackendConfig(explicit_target=pb.ProcessTarget(pids=[1]))),
            pb.BackendConfig(
                memory_regions=pb.MemoryRegionsBackendConfig(
                    regions=[pb.MemoryRegion(pid=1, address=0x7F00, size_bytes=4096)]
                )
            ),
        ]
        if not _has_backend("cuda"):
            unsupported.append(pb.BackendConfig(cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=[1]))))
        for cfg in unsupported:
            err = await rpc_error(s.Snapshot, pb.SnapshotRequest(job_id="trainer", backend_config=cfg), timeout=5)
            assert err.code() is grpc.StatusCode.FAILED_PRECONDITION, cfg
            assert "supports: " in (err.details() or "") and "BackendConfig.app_channel" in (err.details() or "")
        legacy = pb.SnapshotRequest(job_id="trainer", backend=pb.BACKEND_CUDA)
        if not _has_backend("cuda"):
            err = await rpc_error(s.Snapshot, legacy, timeout=5)
            assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and "cuda" in (err.details() or "")
        # nothing was started by any of these
        st = await call(s.Status, pb.StatusRequest(), timeout=5)
        assert st.job_statuses[0].state == pb.JOB_STATE_IDLE


def _has_backend(name: str) -> bool:
    from timeslice_agent.backends import available_backends

    return name in available_backends()


async def test_snapshot_agent_client(target: str, workload: Workload, agent: Agent) -> None:
    def run() -> None:
        with SnapshotAgentClient(target, timeout=5, wait_timeout_s=20) as c:
            assert c.status().jobs == {"trainer": JobState.IDLE}
            op = c.snapshot_and_wait("trainer", backend=AppChannel(mode="discard", tags=("kv_cache",)))
            assert op.ok and op.state is OperationState.COMPLETE
            assert (op.storage_bytes, op.device_bytes, op.error) == (4096, 4000, None)
            assert c.status().jobs == {"trainer": JobState.SAVED}
            assert c.get_operation(op.op_id) == op
            op = c.restore_and_wait("trainer")
            assert op.ok and op.storage_bytes == 4096
            assert c.status().jobs == {"trainer": JobState.RUNNING}
            with pytest.raises(OperationNotFound):
                c.get_operation("unknown")
            with pytest.raises(InvalidRequest):
                c.snapshot("bad id!")
            if not _has_backend("cuda"):
                with pytest.raises(AgentError, match="FAILED_PRECONDITION") as refused:
                    c.snapshot("trainer", backend=Cuda(pids=[1]))
                assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
            workload.fail_suspend = True
            with pytest.raises(OperationFailed, match="no host memory left") as info:
                c.snapshot_and_wait("trainer")
            assert info.value.operation.state is OperationState.FAILED

    await call(run)
    # a failed suspend rolls back: the job runs again
    assert agent.jobs()["trainer"].state is JobState.RUNNING
    assert [c[:2] for c in workload.calls] == [("suspend", SuspendMode.DISCARD), ("resume", SuspendMode.DISCARD)]
    assert workload.calls[0][2] == frozenset({"kv_cache"})

    async with AsyncSnapshotAgentClient(target, timeout=5) as ac:
        workload.fail_suspend = False
        op = await ac.snapshot_and_wait("trainer", backend=AppChannel(mode="offload"))
        assert op.ok and op.storage_bytes == 4096
        op = await ac.restore_and_wait("trainer")
        assert op.ok and (await ac.status()).jobs == {"trainer": JobState.RUNNING}


async def test_unreachable_agent_is_unavailable() -> None:
    from timeslice_client import Unavailable

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    def run() -> None:
        with SnapshotAgentClient(f"127.0.0.1:{port}", timeout=0.5) as c, pytest.raises(Unavailable):
            c.status()

    await call(run)


async def test_agent_process_serves_grpc(nats_url: str, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path / "agent.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "timeslice_agent",
            "--node-id",
            "node-p",
            "--nats-url",
            nats_url,
            "--grpc-port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    try:
        with SnapshotAgentClient(f"127.0.0.1:{port}", timeout=1) as c:

            def up() -> bool:
                assert proc.poll() is None, (tmp_path / "agent.log").read_text()
                try:
                    return c.status().jobs == {}
                except Exception:
                    return False

            await eventually(lambda: call(up), timeout=30, interval=0.05, what="the agent's gRPC API")
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


async def test_a_one_off_discard_never_changes_a_later_snapshot(target: str, workload: Workload, agent: Agent) -> None:
    """A request's mode and tags are that request's: a DISCARD snapshot once (and the restore after it, which
    brings back what that snapshot left) does not make the next default snapshot discard the trainer's state,
    nor the orchestrator's switches, which read the job's registered settings (issue 26: data loss)."""
    async with AsyncSnapshotAgentClient(target, timeout=5) as c:
        op = await c.snapshot_and_wait("trainer", backend=AppChannel(mode="discard", tags=("kv_cache",)))
        assert op.ok
        assert (await c.restore_and_wait("trainer")).ok
        registered = agent.jobs()["trainer"]
        assert (registered.mode, registered.tags) == (SuspendMode.OFFLOAD, ())
        assert (await c.snapshot_and_wait("trainer")).ok  # no backend config: the job's own settings
        assert (await c.restore_and_wait("trainer")).ok
    assert [(what, mode, set(tags)) for what, mode, tags in workload.calls] == [
        ("suspend", SuspendMode.DISCARD, {"kv_cache"}),
        ("resume", SuspendMode.DISCARD, {"kv_cache"}),  # the restore of a discarded state knows it was discarded
        ("suspend", SuspendMode.OFFLOAD, set()),
        ("resume", SuspendMode.OFFLOAD, set()),
    ]


async def test_a_second_call_while_an_operation_runs_is_aborted_at_once(
    target: str, workload: Workload, agent: Agent
) -> None:
    """Snapshot or Restore for a job whose operation runs answers ABORTED at once (the reference's behaviour, and
    our docs'), naming the running operation; it used to wait until that operation ended."""
    pb = compile_proto(AGENT_PROTO)
    workload.gate.clear()  # the trainer's suspend blocks until the gate opens
    try:
        with grpc.insecure_channel(target) as ch:
            s = Stub(ch, pb, "SnapshotAgentService")
            first = (await call(s.Snapshot, pb.SnapshotRequest(job_id="trainer"), timeout=5)).operation_id
            for rpc, req in (
                (s.Snapshot, pb.SnapshotRequest(job_id="trainer")),
                (s.Restore, pb.RestoreRequest(job_id="trainer")),
            ):
                t0 = time.perf_counter()
                err = await rpc_error(rpc, req, timeout=5)
                took_ms = (time.perf_counter() - t0) * 1000
                assert err.code() is grpc.StatusCode.ABORTED, err
                assert first in (err.details() or ""), err.details()
                assert took_ms < 50, f"ABORTED after {took_ms:.1f} ms"
    finally:
        workload.gate.set()

    async def done() -> bool:
        status = agent.operation(first)
        return status is not None and status.done

    await eventually(done, what="the first snapshot ended")
    assert agent.jobs()["trainer"].state is JobState.SAVED


async def test_each_backend_has_its_health_service(target: str) -> None:
    """``Health.Check(service="cuda")`` and the like answer as the reference agent's do: SERVING for a backend this
    node can run, NOT_SERVING for one it cannot (no GPU here: cuda), NOT_FOUND for no backend at all."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        def status(service: str) -> Any:
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

        for backend in ("app_channel", "app_endpoint", "noop", "freeze"):
            assert await call(status, backend) == health_pb2.HealthCheckResponse.SERVING, backend
        cuda = (
            health_pb2.HealthCheckResponse.SERVING
            if _has_backend("cuda")
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        assert await call(status, "cuda") == cuda
        err = await rpc_error(status, "no-such-backend")
        assert err.code() is grpc.StatusCode.NOT_FOUND


def test_the_default_port_is_the_reference_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from timeslice_agent._main import add_agent_flags
    from timeslice_client.agent_client import default_target

    p = argparse.ArgumentParser()
    add_agent_flags(p)
    assert p.parse_args([]).grpc_port is None  # off unless asked
    assert p.parse_args(["--grpc-port"]).grpc_port == 9001
    assert p.parse_args(["--grpc-port", "0"]).grpc_port == 0
    assert AgentGrpcConfig().port == 9001
    monkeypatch.delenv("TIMESLICE_AGENT_GRPC_TARGET", raising=False)
    assert default_target() == "127.0.0.1:9001"
