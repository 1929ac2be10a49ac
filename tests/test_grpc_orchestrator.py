"""The orchestrator's gRPC API against the real stack (nats-server, orchestrator, shim), driven by a
client built from the .proto files alone, with the blocking calls an existing client makes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from timeslice_client import AsyncTimeSliceClient
from timeslice_orchestrator.embedded import NatsServer
from timeslice_orchestrator.grpc_shim import GrpcConfig, OrchestratorGrpcShim
from timeslice_orchestrator.service import Orchestrator

from .grpc_helpers import call, orchestrator_command, orchestrator_shim, rpc_error
from .grpc_proto_client import OrchestratorClient
from .helpers import eventually

# module-scoped fixtures: the whole module in one worker, its fixtures made once

LEASE_S = 1.5


@pytest.fixture
async def shim(nats_url: str, orchestrator: Orchestrator) -> AsyncIterator[OrchestratorGrpcShim]:
    async with orchestrator_shim(nats_url, lease_s=LEASE_S, liveness_interval_s=0.05) as s:
        yield s


@pytest.fixture
def target(shim: OrchestratorGrpcShim) -> str:
    return f"127.0.0.1:{shim.port}"


@pytest.fixture
def client(target: str) -> Iterator[OrchestratorClient]:
    with OrchestratorClient(target) as c:
        yield c


async def queue_depth(c: OrchestratorClient, group: str) -> int:
    return int((await call(c.get_status, group)).group.waiter_queue_depth)


@pytest.mark.parametrize("legacy", [False, True], ids=["timeslice_orchestrator", "accelerator_orchestrator"])
async def test_existing_client_call_patterns(target: str, legacy: bool) -> None:
    with OrchestratorClient(target, legacy=legacy, group_id="g1") as c:
        pb = c.pb
        assert await call(c.list_groups) == []
        err = await rpc_error(c.get_status, "g1")
        assert err.code() is grpc.StatusCode.NOT_FOUND

        # blocking acquire, no deadline: granted at once on a fresh group
        r = await call(c.acquire, "job-a")
        assert r.success and r.waited_ms >= 0 and r.context_restored is False
        assert await call(c.list_groups) == ["g1"]
        st = await call(c.get_status)
        g = st.group
        assert (g.group_id, g.group_state, g.locking_job, g.active_job, g.waiter_queue_depth) == (
            "g1",
            pb.GroupStatus.STATE_LOCKED,
            "job-a",
            "job-a",
            0,
        )
        assert g.HasField("state_timestamp") and abs(g.state_timestamp.seconds - time.time()) < 60
        # the holder asking again (a retry) gets it back at once
        again = await call(c.acquire, "job-a", timeout=5)
        assert again.success and again.waited_ms == 0

        # acquire with a deadline that passes: DEADLINE_EXCEEDED, and no waiter is left behind
        err = await rpc_error(c.acquire, "job-b", timeout=0.3)
        assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        # withdrawn at once (the bus-side deadline, a backstop, would only fire a second later)
        await eventually(lambda: _depth_is(c, 0), timeout=0.8, what="the timed-out waiter left the queue")

        # yield by a job that does not hold the group
        err = await rpc_error(c.release, "job-b")
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED and "job-a" in (err.details() or "")

        # a waiter blocks until the holder yields; its waited_ms is the true wait
        t0 = time.monotonic()
        waiting = asyncio.ensure_future(call(c.acquire, "job-b"))
        await eventually(lambda: _depth_is(c, 1), what="job-b queued")
        await asyncio.sleep(0.2)  # let job-b wait a measurable while (the figure checked below)
        y = await call(c.release, "job-a")
        assert y.success and y.pending_waiters == 1 and y.snapshot_deferred is False
        rb = await waiting
        assert rb.success and 200 <= rb.waited_ms <= (time.monotonic() - t0) * 1000 + 50
        # job-b's Acquire went through this shim: GetGroupStatus reflects its grant (read-your-writes)
        assert await _locked_by(c, "job-b")

        # with-style acquire/yield around work
        def work() -> tuple[Any, Any]:
            with c.on_accelerators("job-b") as res:
                status = c.get_status()
            return res, status

        res, during = await call(work)
        assert res.success and during.group.locking_job == "job-b"
        alone = await call(c.get_status)
        assert alone.group.group_state == pb.GroupStatus.STATE_IDLE_YIELDED
        assert alone.group.locking_job == "" and alone.group.active_job == "job-b"

        # alone: yield keeps the context, re-acquire restores nothing
        again = await call(c.acquire, "job-b", timeout=5)
        assert again.success and again.context_restored is False
        y = await call(c.release, "job-b")
        assert y.pending_waiters == 0 and y.snapshot_deferred is True


async def _locked_by(c: OrchestratorClient, job: str) -> bool:
    return bool((await call(c.get_status)).group.locking_job == job)


async def _depth_is(c: OrchestratorClient, n: int) -> bool:
    return await queue_depth(c, c.group_id or "") == n


async def test_invalid_ids(client: OrchestratorClient) -> None:
    for fn, args in (
        (client.acquire, ("bad job", "g")),
        (client.release, ("j", "g.>")),
        (client.get_status, ("",)),
        (client.acquire, ("j", "x" * 65)),
    ):
        err = await rpc_error(fn, *args)
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (args, err)
        assert "invalid" in (err.details() or "")


async def test_cancelled_acquire_leaves_no_phantom_grant(client: OrchestratorClient) -> None:
    client.group_id = "g2"
    await call(client.acquire, "a")
    fut = client.acquire_future("b")
    await eventually(lambda: _depth_is(client, 1), what="b queued")
    fut.cancel()
    # withdrawn at once, not when its place lapses for want of renewal (5 s)
    await eventually(lambda: _depth_is(client, 0), timeout=1.0, what="the cancelled waiter left the queue")
    await call(client.release, "a")
    st = (await call(client.get_status)).group
    assert st.locking_job == "" and st.active_job == "a"  # nobody was granted behind a's back


async def test_grpc_and_bus_clients_share_one_queue(target: str, nats_url: str) -> None:
    """Two jobs through gRPC and a third through the bus client take turns on one group, FIFO."""
    rounds = 3
    held: list[str] = []
    overlap: list[str] = []
    lock = threading.Lock()

    def enter(job: str) -> None:
        with lock:
            if held:
                overlap.append(f"{job} entered while {held} held")
            held.append(job)

    def leave(job: str) -> None:
        with lock:
            held.remove(job)

    def grpc_job(job: str) -> list[int]:
        waits = []
        with OrchestratorClient(target, job_id=job, group_id="shared") as c:
            for _ in range(rounds):
                with c.on_accelerators(timeout=30) as r:
                    enter(job)
                    waits.append(r.waited_ms)
                    time.sleep(0.02)
                    leave(job)
        return waits

    async def bus_job() -> None:
        async with AsyncTimeSliceClient("bus-job", "shared", nats_url) as c:
            for _ in range(rounds):
                async with c.on_accelerators(timeout=30):
                    enter("bus-job")
                    await asyncio.sleep(0.02)
                    leave("bus-job")

    results = await asyncio.gather(call(grpc_job, "grpc-a"), call(grpc_job, "grpc-b"), bus_job())
    assert overlap == []
    assert len(results[0]) == len(results[1]) == rounds
    with OrchestratorClient(target, group_id="shared") as c:
        st = (await call(c.get_status)).group
        assert st.locking_job == "" and st.waiter_queue_depth == 0 and st.active_job in ("grpc-a", "grpc-b", "bus-job")


async def test_queue_order_is_shared_fifo(target: str, nats_url: str) -> None:
    with OrchestratorClient(target, group_id="fifo") as c:
        await call(c.acquire, "first")
        async with AsyncTimeSliceClient("bus-second", "fifo", nats_url) as bus:
            second = asyncio.ensure_future(bus.acquire(timeout=20))
            await eventually(lambda: _depth_is(c, 1))
            third = asyncio.ensure_future(call(c.acquire, "grpc-third", timeout=20))
            await eventually(lambda: _depth_is(c, 2))
            await call(c.release, "first")
            await second
            assert not third.done()
            assert (await call(c.get_status)).group.locking_job == "bus-second"
            await bus.release()
            await third
            assert (await call(c.get_status)).group.locking_job == "grpc-third"
            await call(c.release, "grpc-third")


async def test_connected_holder_keeps_group_dead_one_loses_it(target: str, shim: OrchestratorGrpcShim) -> None:
    with OrchestratorClient(target, group_id="lease") as b:
        holder = OrchestratorClient(target, group_id="lease", own_connection=True)
        await call(holder.acquire, "a")
        # connected and holding for more than two leases: the shim renews, b keeps waiting
        err = await rpc_error(b.acquire, "b", timeout=2.2 * LEASE_S)
        assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert (await call(b.get_status)).group.locking_job == "a"
        # the holder's connection dies: the group goes to b after about one lease
        waiting = asyncio.ensure_future(call(b.acquire, "b", timeout=20))
        await eventually(lambda: _depth_is(b, 1))
        t0 = time.monotonic()
        holder.close()
        r = await waiting
        elapsed = time.monotonic() - t0
        assert r.success and 0.8 * LEASE_S <= elapsed <= LEASE_S + 5, elapsed
        assert shim.released_for_lost_connection == 1
        # the old holder comes back too late: it holds nothing any more
        with OrchestratorClient(target, group_id="lease") as back:
            err = await rpc_error(back.release, "a")
            assert err.code() is grpc.StatusCode.PERMISSION_DENIED and "'b'" in (err.details() or "")
        await call(b.release, "b")


async def test_holder_that_reconnects_in_time_keeps_group(target: str) -> None:
    first = OrchestratorClient(target, group_id="recon", own_connection=True)
    await call(first.acquire, "a")
    first.close()
    with OrchestratorClient(target, group_id="recon", own_connection=True) as again:
        # back on a new connection within the lease: the hold moves over
        r = await call(again.acquire, "a", timeout=5)
        assert r.success and r.waited_ms == 0
        await asyncio.sleep(1.5 * LEASE_S)
        assert (await call(again.get_status)).group.locking_job == "a"
        y = await call(again.release, "a")
        assert y.success


async def test_group_status_reports_agent_job_states(target: str, nats_url: str) -> None:
    from timeslice_agent import Agent, AgentConfig
    from timeslice_client import CallbackHandler, HandlerResult

    agent = Agent(AgentConfig(node_id="node-s", nats_url=nats_url))
    task = asyncio.get_running_loop().create_task(agent.run())
    await asyncio.wait_for(agent.ready.wait(), 20)
    try:
        handler = CallbackHandler(suspend=lambda m, t: HandlerResult(10, 10), resume=lambda m, t: HandlerResult(10, 0))
        async with AsyncTimeSliceClient("w1", "gs", nats_url) as w1, AsyncTimeSliceClient("w2", "gs", nats_url) as w2:
            await w1.register_workload(handler, node_id="node-s")
            await w2.register_workload(handler, node_id="node-s")
            with OrchestratorClient(target, group_id="gs") as c:
                pb = c.pb
                await call(c.acquire, "w1")
                b = asyncio.ensure_future(call(c.acquire, "w2", timeout=20))
                await eventually(lambda: _depth_is(c, 1))
                await call(c.release, "w1")
                r = await b
                assert r.context_restored is True

                def states() -> dict[str, int] | None:
                    st = c.get_status()
                    got = {s.job_id: s.job_state for s in st.agent_job_states if s.agent == "node-s"}
                    want = {"w1": pb.SnapshotAgentJobState.STATE_SAVED, "w2": pb.SnapshotAgentJobState.STATE_RUNNING}
                    return got if got == want and st.group.loaded_job == "w2" else None

                await eventually(lambda: call(states), what="agent job states in GetGroupStatus")
                await call(c.release, "w2")
    finally:
        agent.shutdown()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)


async def test_health_and_reflection(target: str) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    def probe() -> tuple[list[int], list[str], list[str]]:
        with grpc.insecure_channel(target) as ch:
            hs = health_pb2_grpc.HealthStub(ch)
            names = [
                "",
                "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService",
                "accelerator_orchestrator.v1alpha1.AcceleratorOrchestratorService",
            ]
            statuses = [hs.Check(health_pb2.HealthCheckRequest(service=n), timeout=5).status for n in names]
            db = ProtoReflectionDescriptorDatabase(ch)
            services = sorted(db.get_services())
            legacy = db.FindFileContainingSymbol("accelerator_orchestrator.v1alpha1.AcceleratorOrchestratorService")
            methods = [m.name for m in legacy.service[0].method]
            return statuses, services, methods

    statuses, services, methods = await call(probe)
    assert statuses == [1, 1, 1]  # SERVING
    assert "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService" in services
    assert "accelerator_orchestrator.v1alpha1.AcceleratorOrchestratorService" in services
    assert "grpc.health.v1.Health" in services
    assert methods == ["Acquire", "Yield", "ListGroups", "GetGroupStatus"]


async def test_bus_down_is_unavailable(nats_server: NatsServer, target: str, shim: OrchestratorGrpcShim) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with OrchestratorClient(target, group_id="down") as c:
        nats_server.stop()

        def shim_disconnected() -> bool:
            assert shim._nc is not None
            return not shim._nc.is_connected

        await eventually(shim_disconnected, what="the shim noticed the bus is gone")
        for fn, args in ((c.acquire, ("a",)), (c.release, ("a",)), (c.list_groups, ()), (c.get_status, ())):
            err = await rpc_error(fn, *args)
            assert err.code() is grpc.StatusCode.UNAVAILABLE, (fn, err)
            assert "bus" in (err.details() or "")

        def health() -> int:
            with grpc.insecure_channel(target) as ch:
                return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status)

        await eventually(lambda: call(lambda: health() == health_pb2.HealthCheckResponse.NOT_SERVING))


# ---------------------------------------------------------------------- TLS


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("certs")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca", cwd=d)
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
            cwd=d,
        )
    return d


@pytest.mark.usefixtures("orchestrator")
async def test_tls_and_mutual_tls(nats_url: str, certs: Path) -> None:
    from timeslice_client._grpc.runtime import channel_credentials

    for mutual in (False, True):
        cfg = GrpcConfig(
            host="127.0.0.1",
            port=0,
            tls_cert=certs / "server.pem",
            tls_key=certs / "server.key",
            tls_client_ca=(certs / "ca.pem") if mutual else None,
            lease_s=1,
            liveness_interval_s=0.05,
        )
        s = OrchestratorGrpcShim(cfg, nats_url=nats_url)
        port = await s.start()
        try:
            target = f"localhost:{port}"
            with OrchestratorClient(target, credentials=channel_credentials(certs / "ca.pem")) as anon:
                if mutual:
                    err = await rpc_error(anon.list_groups, timeout=5)
                    assert err.code() is grpc.StatusCode.UNAVAILABLE
                else:
                    assert await call(anon.list_groups) == []
            creds = channel_credentials(certs / "ca.pem", certs / "client.pem", certs / "client.key")
            with OrchestratorClient(target, credentials=creds, group_id="tls") as c:
                r = await call(c.acquire, "a", timeout=10)
                assert r.success
                if mutual:  # the holder's TLS connection is recognised as alive: it keeps the group
                    await asyncio.sleep(2.5)
                    assert (await call(c.get_status)).group.locking_job == "a"
                    assert s.released_for_lost_connection == 0
                await call(c.release, "a")
            with OrchestratorClient(target) as plain:
                err = await rpc_error(plain.list_groups, timeout=5)
                assert err.code() is grpc.StatusCode.UNAVAILABLE
        finally:
            await s.stop()


# ---------------------------------------------------------------------- the real process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_orchestrator_process_serves_grpc(nats_url: str, tmp_path: Path) -> None:
    """``timeslice orchestrator --grpc-port P``: the orchestrator process with its gRPC API."""
    port = _free_port()
    env = dict(os.environ, TIMESLICE_LOG_LEVEL="warning")
    log = (tmp_path / "orch.log").open("wb")
    proc = subprocess.Popen(
        orchestrator_command(nats_url, "--grpc-port", str(port), "--grpc-host", "127.0.0.1"),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        with OrchestratorClient(f"127.0.0.1:{port}", group_id="proc") as c:

            def up() -> bool:
                assert proc.poll() is None, (tmp_path / "orch.log").read_text()
                try:
                    c.list_groups(timeout=1)
                except grpc.RpcError:
                    return False
                return True

            await eventually(lambda: call(up), timeout=30, interval=0.05, what="gRPC API of the process")
            r = await call(c.acquire, "a", timeout=10)
            assert r.success
            assert (await call(c.release, "a")).snapshot_deferred is True
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def test_orchestrator_without_grpc_flags_needs_no_grpc_packages(nats_url: str, tmp_path: Path) -> None:
    """``timeslice orchestrator`` without ``--grpc-port`` serves the bus API on a host that lacks the gRPC
    packages (the GPU machine's image had grpcio but not grpcio-health-checking)."""
    from .conftest import OrchestratorProcess

    proc = OrchestratorProcess(
        nats_url, tmp_path / "orch.log", blocked_imports=("grpc", "grpc_health", "grpc_reflection")
    )
    proc.start()
    try:
        proc.wait_ready()

        async def handoff() -> int:
            async with AsyncTimeSliceClient(job_id="j1", group_id="g-nogrpc", nats_url=nats_url) as c:
                grant = await c.acquire(timeout=10)
                await c.release()
                return grant.epoch

        assert asyncio.run(handoff()) >= 1
    finally:
        proc.stop()
