"""Prometheus metrics: they move as handoffs happen (registries owned by the tests, a real nats-server, the
orchestrator and an agent in this event loop), and ``--metrics-port`` serves them over a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import re
import urllib.request
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry
from timeslice_agent import Agent, AgentConfig, AgentMetrics
from timeslice_client import AcquireTimeout, AsyncTimeSliceClient, HandlerResult, JobState, SuspendMode
from timeslice_client._internal.metrics_http import MetricsServerError, serve_metrics
from timeslice_client.bus import connect
from timeslice_client.protocol import Acquire, GroupRecord, encode, subjects
from timeslice_orchestrator import Orchestrator, OrchestratorConfig, OrchestratorMetrics

from .agent_harness import queued, start_cli
from .helpers import eventually, running


@pytest.fixture
async def registry(nats_url: str) -> AsyncIterator[CollectorRegistry]:
    """An orchestrator in this loop whose metrics live on the returned registry."""
    reg = CollectorRegistry()
    async with running(Orchestrator(OrchestratorConfig(nats_url=nats_url), metrics=OrchestratorMetrics(reg))):
        yield reg


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


async def test_orchestrator_metrics_follow_a_handoff(nats_url: str, registry: CollectorRegistry) -> None:
    g = "gm"
    async with (
        AsyncTimeSliceClient("a", g, nats_url) as a,
        AsyncTimeSliceClient("b", g, nats_url) as b,
        AsyncTimeSliceClient("c", g, nats_url) as c,
    ):
        await a.acquire(timeout=10)
        assert value(registry, "timeslice_grants_total", group=g) == 1
        assert value(registry, "timeslice_group_epoch", group=g) == 1
        tb = asyncio.create_task(b.acquire(timeout=10))
        await eventually(queued(a, g, "b"), what="b queued")
        assert value(registry, "timeslice_queue_depth", group=g) == 1
        with pytest.raises(AcquireTimeout):
            await c.acquire(timeout=0.3)  # gives up: the client cancels its place
        await eventually(lambda: _cancelled(registry, g) == 1, what="c's exit from the queue counted")
        await a.release()
        granted_b = await tb
        await b.release()
    await eventually(lambda: value(registry, "timeslice_releases_total", group=g) == 2, what="two releases")
    assert value(registry, "timeslice_grants_total", group=g) == 2
    assert value(registry, "timeslice_group_epoch", group=g) == 2 == granted_b.epoch
    assert value(registry, "timeslice_queue_depth", group=g) == 0
    # a waited for nobody, b for a's hold: the acquire wait histogram saw both grants
    assert value(registry, "timeslice_acquire_wait_seconds_count", group=g) == 2
    assert value(registry, "timeslice_acquire_wait_seconds_sum", group=g) == pytest.approx(granted_b.waited_ms / 1000)
    # one handoff (a released while b waited); no switch happened for a's first grant
    assert value(registry, "timeslice_handoff_seconds_count", group=g) == 1
    assert value(registry, "timeslice_handoff_seconds_bucket", group=g, le="+Inf") == 1
    assert value(registry, "timeslice_events_applied_total", type="acquire") == 3
    assert value(registry, "timeslice_events_applied_total", type="release") == 2
    applied = sum(
        s.value
        for m in registry.collect()
        if m.name == "timeslice_events_applied"
        for s in m.samples
        if s.name.endswith("_total")
    )
    assert value(registry, "timeslice_apply_seconds_count") == applied
    assert value(registry, "timeslice_lease_expiries_total", group=g, reason="lease_expired") == 0
    assert value(registry, "timeslice_faults_total", group=g) == 0


def _cancelled(reg: CollectorRegistry, group: str) -> float:
    """Waiters that left ``group`` without a grant, whatever the reason (the client's cancel and the
    orchestrator's own deadline race: either may remove it)."""
    return sum(
        value(reg, "timeslice_waiters_cancelled_total", group=group, reason=r)
        for r in ("cancelled", "timeout", "lost", "faulted")
    )


async def test_unconfirmed_grant_counts_as_an_expiry(nats_url: str, registry: CollectorRegistry) -> None:
    """A job that asks and vanishes: granted, never confirmed, revoked by the orchestrator's own tick."""
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        await js.publish(
            subjects.job("gx", "ghost", "acquire"),
            encode(Acquire(group="gx", job="ghost", request_id="r1", waiter_ttl_ms=300, confirm_ms=300)),
        )
        await eventually(
            lambda: value(registry, "timeslice_lease_expiries_total", group="gx", reason="grant_unconfirmed") == 1,
            what="the grant revoked",
        )
        assert value(registry, "timeslice_grants_total", group="gx") == 1
        assert value(registry, "timeslice_events_applied_total", type="tick") >= 1
    finally:
        await nc.close()


class Recorder:
    def __init__(self, fail_suspend: bool = False) -> None:
        self.fail_suspend = fail_suspend

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        if self.fail_suspend:
            raise RuntimeError("cannot offload right now")
        return HandlerResult(bytes_moved=1000, device_bytes_freed=600)

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return HandlerResult(bytes_moved=1000, device_bytes_freed=0)


@pytest.fixture
async def agent_registry(nats_url: str, registry: CollectorRegistry) -> AsyncIterator[tuple[Agent, CollectorRegistry]]:
    reg = CollectorRegistry()
    async with running(Agent(AgentConfig(node_id="node-m", nats_url=nats_url), metrics=AgentMetrics(reg))) as agent:
        yield agent, reg


async def test_agent_metrics_count_operations(
    nats_url: str, registry: CollectorRegistry, agent_registry: tuple[Agent, CollectorRegistry]
) -> None:
    _, reg = agent_registry
    g, ops = "ga", "timeslice_agent_operations_total"
    async with AsyncTimeSliceClient("a", g, nats_url) as a, AsyncTimeSliceClient("b", g, nats_url) as b:
        await a.register_workload(Recorder(), node_id="node-m")
        await b.register_workload(Recorder(), node_id="node-m")
        await a.acquire(timeout=10)  # a never ran: its restore has nothing to move
        assert value(reg, ops, backend="app_channel", operation="restore", outcome="noop") == 1
        tb = asyncio.create_task(b.acquire(timeout=10))
        await eventually(queued(a, g, "b"), what="b queued")
        await a.release()
        await tb  # a's snapshot ran (1000 bytes), b's restore had nothing to move
        ta = asyncio.create_task(a.acquire(timeout=10))
        await eventually(queued(b, g, "a"), what="a queued")
        await b.release()
        await ta  # b's snapshot and a's restore ran
        await a.release()
    labels = {"backend": "app_channel", "operation": "snapshot"}
    assert value(reg, ops, **labels, outcome="ok") == 2
    assert value(reg, ops, backend="app_channel", operation="restore", outcome="ok") == 1
    assert value(reg, ops, backend="app_channel", operation="restore", outcome="noop") == 2
    assert value(reg, "timeslice_agent_bytes_moved_total", **labels) == 2000
    assert value(reg, "timeslice_agent_device_bytes_freed_total", **labels) == 1200
    assert value(reg, "timeslice_agent_bytes_moved_total", backend="app_channel", operation="restore") == 1000
    assert value(reg, "timeslice_agent_operation_seconds_count", **labels) == 2
    assert value(reg, "timeslice_agent_operation_seconds_count", backend="app_channel", operation="restore") == 1
    assert value(reg, "timeslice_agent_operation_seconds_sum", **labels) > 0
    assert value(registry, "timeslice_handoff_seconds_count", group=g) == 2
    for m in reg.collect():  # job ids never become label values
        for s in m.samples:
            assert not {"a", "b", "job"} & set(s.labels.values()) and "job" not in s.labels, s


async def test_failed_snapshot_counts_a_rollback_and_a_fault(
    nats_url: str, registry: CollectorRegistry, agent_registry: tuple[Agent, CollectorRegistry]
) -> None:
    agent, reg = agent_registry
    g = "gf"
    async with AsyncTimeSliceClient("a", g, nats_url) as a, AsyncTimeSliceClient("b", g, nats_url) as b:
        await a.register_workload(Recorder(fail_suspend=True), node_id="node-m")
        await b.register_workload(Recorder(), node_id="node-m")
        await a.acquire(timeout=10)
        tb = asyncio.create_task(b.acquire(timeout=10))
        await eventually(queued(a, g, "b"), what="b queued")
        await a.release()
        await tb  # b still gets the group
        await eventually(lambda: agent.jobs()["a"].state is JobState.RUNNING, what="a rolled back")
        await b.release()
    assert (
        value(
            reg, "timeslice_agent_operations_total", backend="app_channel", operation="snapshot", outcome="rolled_back"
        )
        == 1
    )
    assert value(registry, "timeslice_faults_total", group=g) == 1
    assert value(registry, "timeslice_grants_total", group=g) == 2


async def test_serve_metrics_over_http() -> None:
    reg = CollectorRegistry()
    OrchestratorMetrics(reg).loaded(GroupRecord(group="g1", epoch=7))
    async with serve_metrics(reg, 0, "127.0.0.1") as endpoint:
        assert endpoint is not None and endpoint.port > 0
        body = await asyncio.to_thread(_get, endpoint.url)
        assert 'timeslice_group_epoch{group="g1"} 7.0' in body
        with pytest.raises(MetricsServerError, match=f"127.0.0.1:{endpoint.port}.*--metrics-port"):
            async with serve_metrics(reg, endpoint.port, "127.0.0.1"):
                pass  # the port is taken: a clear error, not a traceback from deep inside
    with pytest.raises(OSError):  # stopped: nothing listens any more
        await asyncio.to_thread(_get, endpoint.url)
    async with serve_metrics(reg, -1) as off:
        assert off is None


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


@pytest.mark.parametrize("command", [["orchestrator"], ["agent", "--node-id", "node-p"]])
async def test_metrics_port_flag_serves_the_process_metrics(nats_url: str, command: list[str]) -> None:
    """``timeslice orchestrator|agent --metrics-port 0`` as a real process: the port it logs answers /metrics."""
    sub, *rest = command
    proc = await start_cli(
        nats_url, sub, *rest, "--metrics-port", "0", "--metrics-host", "127.0.0.1", log_level="info", merged=True
    )
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(30):
            while not (m := re.search(r"metrics at (http://\S+/metrics)", seen[-1] if seen else "")):
                line = await proc.stdout.readline()
                assert line, f"exited before serving metrics: {''.join(seen)}"
                seen.append(line.decode())
        body = await asyncio.to_thread(_get, m[1])
        prefix = "timeslice_agent_operations" if command[0] == "agent" else "timeslice_events_applied"
        assert f"# HELP {prefix}" in body and "process_cpu_seconds_total" in body, body[:2000]
    finally:
        if proc.returncode is None:
            proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.communicate(), 20)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, "".join(seen)
