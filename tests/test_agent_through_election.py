"""The agent's answer to an operation rides out a NATS election (3-node loopback cluster, tests/cluster.py).

While the cluster elects the ``TIMESLICE`` stream's leader, a write to the stream gets no answer. A snapshot that
ended then used to be answered with "agent error" (the job faulted although its state was off the device), or left
unanswered and run a second time when the orchestrator sent it again (seen in ``bench/chaos.py``: 523 refused
acquires of a faulted job, and a grant while the second run was suspending the job again). Now the agent retries its
answer (same message id) until the stream takes it: one run, one answer, ok, and the waiter is granted."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
from timeslice_agent import Agent, AgentConfig
from timeslice_client import AsyncTimeSliceClient, GroupRecord, Unavailable
from timeslice_client._internal.bus_layout import BusConfig
from timeslice_client.protocol import STREAM, OpKind, OpResult, OpStarted, subjects
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .agent_harness import Blocking, Recorder
from .cluster import NatsCluster
from .helpers import eventually, group_record, running
from .workers import read_stream

GROUP = "g-elect"


async def _ops(url: str) -> tuple[list[OpStarted], list[OpResult]]:
    started: list[OpStarted] = []
    results: list[OpResult] = []
    for _, _, subject, data in await read_stream(url):
        if subject == subjects.agent_op("n1"):
            started.append(msgspec.json.decode(data, type=OpStarted))
        elif subject == subjects.agent_event("n1", GROUP) and b'"op_result"' in data:
            results.append(msgspec.json.decode(data, type=OpResult))
    return started, results


async def test_a_snapshot_answered_during_an_election_runs_once_and_counts_ok(cluster: NatsCluster) -> None:
    url = cluster.url
    cfg = OrchestratorConfig(nats_url=url, bus=BusConfig(replicas=3), write_attempts=40)
    log: list[str] = []
    go = threading.Event()
    async with (
        running(Orchestrator(cfg), timeout=30),
        running(Agent(AgentConfig(node_id="n1", nats_url=url)), timeout=30),
    ):
        async with (
            AsyncTimeSliceClient("a", GROUP, url, request_timeout_s=30) as a,
            AsyncTimeSliceClient("b", GROUP, url, request_timeout_s=30) as b,
        ):
            try:
                await a.register_workload(Blocking("a", log, go, wait_s=60), node_id="n1", op_timeout_s=60)
                await b.register_workload(Recorder("b", log), node_id="n1", op_timeout_s=60)
                await a.acquire(timeout=20)
                tb = asyncio.create_task(b.acquire(timeout=120))

                async def b_waits() -> bool:
                    return "b" in [w.job for w in (await group_record(a)).queue]

                async def snapshot_running() -> bool:
                    started, _ = await _ops(url)
                    return any(o.job == "a" and o.kind is OpKind.SNAPSHOT for o in started)

                await eventually(b_waits, what="b waiting")
                await a.release()
                await eventually(lambda: "a:suspend start" in log, what="a's suspend running")
                await eventually(snapshot_running, what="the agent's snapshot of a, in the stream")
                cluster.kill(await cluster.stream_leader(STREAM))
                t_kill = time.monotonic()
                go.set()  # a's suspend ends now: the agent answers while the stream elects its leader
                gb = await asyncio.wait_for(tb, 90)
                print(f"\nb granted {time.monotonic() - t_kill:.2f} s after the stream leader's kill")

                async def stored() -> GroupRecord | None:  # the grant goes out before its record is written
                    try:
                        rec = await group_record(b)
                    except Unavailable:  # the bus answers nothing while the cluster still settles its leaders
                        return None
                    return rec if rec.holder is not None and rec.holder.job == "b" else None

                # One read may itself take the client's request_timeout_s (30 s: a KV read sent to a server the cluster
                # is still electing around answers only then), so the bound is longer than one read.
                rec = await eventually(stored, timeout=90, what="the record shows b holding")
                assert "a" not in rec.faulted, rec.faulted
                assert rec.holder is not None and gb.epoch == rec.holder.epoch
                await b.release()
            finally:
                go.set()
        started, results = await _ops(url)
        snaps = [o for o in started if o.job == "a" and o.kind is OpKind.SNAPSHOT]
        answers = [r for r in results if r.job == "a" and r.kind is OpKind.SNAPSHOT]
        assert len(snaps) == 1, f"a's snapshot ran {len(snaps)} times: {snaps}"
        assert [r.ok for r in answers] == [True], answers
