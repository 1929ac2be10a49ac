"""The node agent beside the orchestrator (``Orchestrator(local_agent=...)``, ``timeslice up``): its lifecycle
follows the orchestrator's, a failure of it stops the orchestrator with the reason, it takes only its own
node's commands once ready and acts on one only once it is published, ``timeslice up`` runs it in its process
(or apart with ``--agent-process``), and a ``kill -9`` of the combined process during a snapshot, then a restart,
hands the group on at once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Literal

import msgspec
import pytest
from nats.aio.client import Client as NATS
from timeslice_agent import Agent, AgentConfig
from timeslice_client import AsyncTimeSliceClient, GroupRecord
from timeslice_client.protocol import OpKind, OpStarted, Restore, Snapshot, subjects
from timeslice_orchestrator.invariants import StreamChecker
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig, OrchestratorError

from .agent_harness import Blocking, Recorder, queue_behind, recorded_switch, up_command, up_fields
from .conftest import OrchestratorProcess
from .helpers import eventually, group_record, running
from .workers import read_stream

# `timeslice up` takes NATS port 4222 when it is free: tests that need it free to themselves wait (tests/conftest.py)
pytestmark = pytest.mark.port_4222("shared")


class FailingAgent:
    """A ``LocalAgent`` whose ``run`` fails at once, or (``hang``) never becomes ready."""

    node = "n1"

    def __init__(self, *, hang: bool = False) -> None:
        self.hang = hang
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()

    @property
    def ready(self) -> asyncio.Event:
        return self._ready

    async def run(self) -> None:
        if not self.hang:
            raise RuntimeError("no device here")
        await self._stop.wait()

    def shutdown(self) -> None:
        self._stop.set()

    def take(self, cmd: Snapshot | Restore) -> bool:
        return False


async def test_a_failing_agent_beside_stops_the_orchestrator_with_its_reason(nats_url: str) -> None:
    orch = Orchestrator(OrchestratorConfig(nats_url=nats_url), local_agent=lambda nc: FailingAgent())
    async with asyncio.timeout(20):
        with pytest.raises(OrchestratorError, match="no device here"):
            await orch.run()
    assert not orch.ready.is_set()


async def test_an_agent_beside_that_never_gets_ready_stops_the_orchestrator(nats_url: str) -> None:
    cfg = OrchestratorConfig(nats_url=nats_url, local_agent_ready_s=0.5)
    orch = Orchestrator(cfg, local_agent=lambda nc: FailingAgent(hang=True))
    async with asyncio.timeout(20):
        with pytest.raises(OrchestratorError, match="not ready within"):
            await orch.run()


class _Gate(asyncio.Event):
    """An event that tells when somebody first waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = asyncio.Event()

    async def wait(self) -> Literal[True]:
        self.waited.set()
        return await super().wait()


async def test_an_agent_takes_only_its_own_nodes_commands_and_only_once_ready(nats_url: str) -> None:
    snap = Snapshot(group="g", job="a", node="n1", op_id="g:2:snapshot:n1", epoch=2, deadline_ms=2**41)
    built: list[Agent] = []

    published = _Gate()

    def build(nc: NATS) -> Agent:
        built.append(Agent(AgentConfig(node_id="n1", nats_url=nats_url), nc=nc))
        assert not built[-1].take(snap, published)  # not running yet: the stream delivers it
        return built[-1]

    async with running(Orchestrator(OrchestratorConfig(nats_url=nats_url), local_agent=build)) as orch:
        (agent,) = built
        assert orch.local_agent is agent and agent.ready.is_set()
        other = Snapshot(group="g", job="a", node="n2", op_id="g:2:snapshot:n2", epoch=2, deadline_ms=2**41)
        assert not agent.take(other, published)
        assert agent.take(snap, published)  # a job it does not know: answered (refused) like any command
        try:
            async with asyncio.timeout(5):
                await published.waited.wait()  # the operation stopped at the gate…
        except TimeoutError:
            pytest.fail(f"the operation did not wait for its command's publish: {agent.operation(snap.op_id)}")
        assert agent.operation(snap.op_id) is None  # …and did nothing before the command is published
        published.set()
        await eventually(lambda: agent.operation(snap.op_id) is not None and agent.operation(snap.op_id).done)
        assert "not registered" in (agent.operation(snap.op_id).result.error or "")
    assert agent._stop.is_set()  # stopped with the orchestrator


@pytest.mark.parametrize("apart", [False, True], ids=["agent-in-process", "agent-process"])
async def test_timeslice_up_runs_the_agent_in_its_process_unless_asked(
    tmp_path: Path, apart: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIMESLICE_URL_FILE", str(tmp_path / "nats.url"))  # here too: its credentials lie beside it
    extra = ["--agent-process"] if apart else ["--agent-metrics-port", "0"]
    args, env = up_command(tmp_path, *extra)
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.startswith(b"timeslice up: nats="), (line, proc.poll())
        fields = up_fields(line.decode())
        url = fields["nats"]
        assert (tmp_path / "nats.url").read_text().strip() == url
        assert ("(in this process)" in line.decode()) is not apart
        log: list[str] = []
        async with AsyncTimeSliceClient("a", "g-up", url) as a, AsyncTimeSliceClient("b", "g-up", url) as b:
            gb = await recorded_switch(a, b, log, "n-up")
            assert gb.context_restored and log == ["a:suspend"]
            await b.release()
        if not apart:  # the agent's metrics, served by the `up` process: every command was handed over (a's first
            # restore, which has nothing to move, then a's snapshot and b's restore)
            with urllib.request.urlopen(fields["agent-metrics"], timeout=10) as r:
                text = r.read().decode()
            assert 'timeslice_agent_commands_total{via="direct"} 3.0' in text, text
            assert 'via="stream"' not in text
        stream = await read_stream(url)
        assert any(subj == "ts.v1.agent.n-up.cmd" for _, _, subj, _ in stream)
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(asyncio.to_thread(proc.communicate), 60)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert b"timeslice up: stopped" in out
        assert not (tmp_path / "nats.url").exists()
    finally:
        if proc.poll() is None:  # a failed test: stop it gracefully first, so that it stops its nats-server
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def _held_by(c: AsyncTimeSliceClient, job: str) -> GroupRecord | None:
    rec = await group_record(c)
    return rec if rec.holder is not None and rec.holder.job == job else None


async def _snapshot_started(nats_url: str, job: str, times: int = 1) -> bool:
    """The agent on n1 has started a snapshot of ``job`` (``times`` OpStarted are in the stream)."""
    subject = subjects.agent_op("n1")
    started = [
        msgspec.json.decode(data, type=OpStarted) for _, _, subj, data in await read_stream(nats_url) if subj == subject
    ]
    return sum(o.job == job and o.kind is OpKind.SNAPSHOT for o in started) >= times


async def test_killed_mid_snapshot_and_restarted_the_stack_moves_on_once_the_suspend_ended(
    nats_url: str, tmp_path: Path
) -> None:
    """``kill -9`` of the process that runs the orchestrator and the agent while a snapshot runs, then a restart
    (as a supervisor does). The restarted agent recovers the cut job as still TRANSITIONING and announces its jobs;
    the orchestrator sends it the switch's pending operations again (the restarted agent had forgotten them), and
    the agent asks a's workload again, which answers once its suspend (still running in a's own process) ended.
    So b is not granted while a's context may still be on the device, and is granted as soon as it is off; a is
    not faulted. (Before, the restarted agent answered the cut snapshot with a failure at once and b was granted
    while a's suspend still ran.)"""
    orch = OrchestratorProcess(nats_url, tmp_path / "orchestrator.log", args=("--with-agent", "n1"))
    orch.start()
    await asyncio.to_thread(orch.wait_ready, 60)
    log: list[str] = []
    go = threading.Event()
    try:
        async with AsyncTimeSliceClient("a", "g-cut", nats_url) as a, AsyncTimeSliceClient("b", "g-cut", nats_url) as b:
            await a.register_workload(Blocking("a", log, go, wait_s=60), node_id="n1", op_timeout_s=60)
            await b.register_workload(Recorder("b", log), node_id="n1", op_timeout_s=60)
            _, tb = await queue_behind(a, b, wait_s=90)
            await a.release()
            # a's suspend begins at its release (early suspend); the kill must come once the agent's operation
            # runs too, and the stream shows when it does.
            await eventually(lambda: "a:suspend start" in log, what="a's suspend running")
            await eventually(lambda: _snapshot_started(nats_url, "a"), what="the agent's snapshot of a running")
            await asyncio.to_thread(orch.kill)
            orch.start()
            await asyncio.to_thread(orch.wait_ready, 60)
            await eventually(
                lambda: _snapshot_started(nats_url, "a", times=2),
                timeout=30,
                what="the restarted agent runs a's snapshot again",
            )
            assert not tb.done(), "b was granted while a's suspend still ran"
            rec = await group_record(b)
            assert rec.holder is None and "a" not in rec.faulted, rec
            t_go = time.monotonic()
            go.set()  # a's suspend ends: the repeated command gets its outcome, and the switch goes on
            gb = await asyncio.wait_for(tb, 30)
            print(f"\nb granted {(time.monotonic() - t_go) * 1000:.0f} ms after a's suspend ended")
            rec = await eventually(lambda: _held_by(b, "b"), what="the record shows b holding")
            assert rec.holder is not None and gb.epoch == rec.holder.epoch
            assert "a" not in rec.faulted and "b" not in rec.faulted, rec.faulted
            await b.release()
        checker = StreamChecker()
        checker.feed_all(await read_stream(nats_url))
        assert checker.unpublished_grants() == []
    finally:
        go.set()
        orch.stop()
