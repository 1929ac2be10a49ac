"""A job spread over several processes on one node (a trainer's workers, a rollout engine, Ray actors) registers each
with the node's agent, and every switch moves all of them: before, each registration replaced the job's last one, so
only the process that registered last was suspended and the others' state stayed on the device beside the next job's.

The pure rules (``timeslice_agent._job_parts``: which registration is which part) are tested on contexts; the rest
on a real agent process with real workload processes (``tests/workers/workload_worker.py``) and, for two channels of
one process, on the in-process stack."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from timeslice_agent._errors import Refusal, Refused
from timeslice_agent._job_parts import (
    all_backends,
    all_pids,
    combine,
    part_count,
    put_part,
    views,
    without_channel,
    without_dead,
)
from timeslice_client import AsyncTimeSliceClient
from timeslice_client.bus import connect
from timeslice_client.protocol import (
    MAX_JOB_PARTS,
    JobContext,
    JobState,
    OpKind,
    SuspendMode,
    WorkloadCommand,
    WorkloadReply,
    encode,
    subjects,
)

from .agent_harness import (
    NODE,
    START,
    AgentProcess,
    Recorder,
    Workload,
    hold_then_queue,
    one,
    op_events,
    queued,
    switch_back,
    timeslice,
)
from .helpers import all_closed, eventually
from .test_agent_flow import stack


def _part(
    pids: tuple[int, ...] = (), channel: str | None = None, backends: tuple[str, ...] = ("app_channel",), **kw: Any
) -> JobContext:
    return JobContext(
        node="n", job="j", group="g", state=JobState.IDLE, pids=pids, channel=channel, backends=backends, **kw
    )


# --------------------------------------------------------------------------- the rules, on contexts


def test_a_second_process_of_the_job_is_one_more_part() -> None:
    job, replaced = put_part(_part((10,), "c1"), _part((11,), "c2"))
    assert replaced is None and part_count(job) == 2
    assert all_pids(job) == (10, 11) and [v.channel for v in views(job)] == ["c1", "c2"]


def test_the_same_channel_again_replaces_its_part_and_keeps_the_jobs_state() -> None:
    first = msgspec.structs.replace(_part((10,), "c1"), state=JobState.SAVED, saved_mode=SuspendMode.DISCARD)
    job, _ = put_part(first, _part((11,), "c2"))
    job, replaced = put_part(job, _part((10,), "c1", mode=SuspendMode.DISCARD))
    assert replaced is not None and replaced.channel == "c1" and part_count(job) == 2
    assert job.state is JobState.SAVED and job.saved_mode is SuspendMode.DISCARD
    assert views(job)[0].mode is SuspendMode.DISCARD and views(job)[1].mode is SuspendMode.OFFLOAD


def test_a_bind_and_a_handler_of_one_process_are_one_part() -> None:
    bound = _part((10,), None, backends=("cuda",))
    job, replaced = put_part(bound, _part((10,), "c1"))
    assert replaced == bound and part_count(job) == 1 and job.backends == ("app_channel",)


def test_channels_without_processes_replace_each_other() -> None:
    """Nothing tells a second process from the first one started again: the newer takes its place."""
    job, replaced = put_part(_part((), "c1"), _part((), "c2"))
    assert replaced is not None and part_count(job) == 1 and job.channel == "c2"


def test_two_parts_never_checkpoint_or_stop_the_same_process() -> None:
    job, _ = put_part(_part((10,), "c1", backends=("cuda",)), _part((11,), "c2", backends=("cuda",)))
    with pytest.raises(Refused) as caught:
        put_part(job, _part((11, 12), "c3", backends=("app_channel", "freeze")))
    assert caught.value.code is Refusal.FORBIDDEN_PROCESS and "11" in str(caught.value)
    job, _ = put_part(job, _part((11,), "c4"))  # a handler in that process touches no process: fine
    assert part_count(job) == 3


def test_parts_are_bounded() -> None:
    job = _part((2,), "c0")
    for i in range(1, MAX_JOB_PARTS):
        job, _ = put_part(job, _part((2 + i,), f"c{i}"))
    with pytest.raises(Refused) as caught:
        put_part(job, _part((9999,), "one-more"))
    assert caught.value.code is Refusal.TOO_LARGE
    assert msgspec.json.decode(msgspec.json.encode(job), type=JobContext) == job  # the wire bound holds them


def test_parts_leave_by_channel_and_by_death() -> None:
    job, _ = put_part(_part((10,), "c1"), _part((11,), "c2"))
    assert without_channel(job, "nosuch") is job
    rest = without_channel(job, "c1")
    assert rest is not None and rest.channel == "c2" and rest.parts == ()
    assert without_channel(rest, "c2") is None
    living, dropped = without_dead(job, lambda pid: pid == 11)
    assert dropped == 1 and living is not None and living.pids == (11,)
    assert without_dead(job, lambda pid: False) == (None, 2)
    assert without_dead(_part((), "c1"), lambda pid: False) == (_part((), "c1"), 0)  # no pids: never dead


_parts = st.lists(
    st.tuples(st.integers(2, 40), st.sampled_from(["app_channel", "noop", "cuda"])), min_size=1, max_size=8
)


@given(_parts)
def test_views_and_combine_round_trip(specs: list[tuple[int, str]]) -> None:
    job: JobContext | None = None
    for i, (pid, backend) in enumerate(specs):
        try:
            job, _ = put_part(job, _part((pid,), f"c{i}", backends=(backend,)))
        except Refused:
            continue  # a process another part's cuda acts on
    assert job is not None
    assert combine(views(job)) == job
    assert set(all_backends(job)) == {b for v in views(job) for b in v.backends}
    cuda = [p for v in views(job) if "cuda" in v.backends for p in v.pids]
    assert len(cuda) == len(set(cuda)), "two parts checkpoint one process"


# --------------------------------------------------------------------------- two channels of one process


async def test_every_registration_of_a_process_is_suspended_and_resumed(nats_url: str) -> None:
    """Two clients of one job in one process, each with its handler (a trainer and its reference model, say); a
    third client of the job takes the holds, so no handler begins its suspend at the release (early suspend): the
    agent's commands move both."""
    log: list[str] = []
    async with (
        stack(nats_url, "apart"),
        AsyncTimeSliceClient("a", "gs", nats_url) as holder,
        AsyncTimeSliceClient("a", "gs", nats_url) as a1,
        AsyncTimeSliceClient("a", "gs", nats_url) as a2,
        AsyncTimeSliceClient("b", "gs", nats_url) as b,
    ):
        await a1.register_workload(Recorder("a1", log), node_id="node-1")
        await a2.register_workload(Recorder("a2", log), node_id="node-1")
        await b.register_workload(Recorder("b", log), node_id="node-1")
        await holder.acquire(timeout=10)
        tb = asyncio.create_task(b.acquire(timeout=10))
        await eventually(queued(holder, "gs", "b"), what="b queued behind a")
        await holder.release()
        await asyncio.wait_for(tb, 15)
        assert sorted(log) == ["a1:suspend", "a2:suspend"], log
        ta = asyncio.create_task(holder.acquire(timeout=10))
        await eventually(queued(holder, "gs", "a"), what="a queued behind b")
        await b.release()
        await asyncio.wait_for(ta, 15)
        assert sorted(log[2:]) == ["a1:resume", "a2:resume", "b:suspend"], log
        await holder.release()


# --------------------------------------------------------------------------- processes of one job


@pytest.fixture
def workers(agent: AgentProcess, tmp_path: Path, nats_url: str) -> Iterator[Any]:
    def workload(group: str, job: str, name: str, **opts: Any) -> Workload:
        where = tmp_path / name  # each process of the job its own files
        where.mkdir()
        return Workload(where, nats_url, group, job, NODE, **opts)

    with all_closed(workload) as made:
        yield made


async def _parts_of(agent: AgentProcess, job: str, n: int) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        ctx = (await agent.jobs()).get(job)
        return ctx if ctx is not None and 1 + len(ctx.get("parts", ())) == n else None

    return await eventually(check, interval=0.05, what=f"job {job} registered as {n} processes")


async def _switch_begins(
    agent: AgentProcess, a1: Workload, b: Workload, observer: AsyncTimeSliceClient, group: str
) -> None:
    """Once job a is registered as two processes, ``a1`` (one of them) holds, ``b`` queues behind it and ``a1``
    releases: the switch from a, both its parts, to b begins."""
    await _parts_of(agent, "a", 2)
    await hold_then_queue(a1, b, observer, group)
    a1.send("release")


async def test_a_switch_moves_every_process_of_the_job(workers: Any, agent: AgentProcess, nats_url: str) -> None:
    g = "parts"
    a1 = workers(g, "a", "a1", handler="numpy", mb=4)  # the process that takes the holds
    a2 = workers(g, "a", "a2", handler="numpy", mb=2)  # another process of the job: registers, never acquires
    b = workers(g, "b", "b", handler="numpy", mb=1)
    ready1, ready2 = await a1.wait("ready", timeout=START), await a2.wait("ready", timeout=START)
    await b.wait("ready", timeout=START)
    ctx = await _parts_of(agent, "a", 2)
    assert {ctx["pids"][0], ctx["parts"][0]["pids"][0]} == {a1.pid, a2.pid}
    rc, out = await timeslice(nats_url, "agent-status", "--node-id", NODE)
    row = next(line for line in out.splitlines() if line.startswith("a "))
    assert rc == 0 and f"pids {ctx['pids'][0]},{ctx['parts'][0]['pids'][0]}" in row, out

    async with AsyncTimeSliceClient("observer", "observer", nats_url) as observer:
        await hold_then_queue(a1, b, observer, g)
        a1.send("release")
        await b.wait("worked")
        for w, ready in ((a1, ready1), (a2, ready2)):
            # (b may be granted on its restore while a's snapshot still ends beside it: wait for each suspend)
            susp = await w.wait("suspended")
            assert (susp["device_bytes_before"], susp["device_bytes_after"]) == (ready["device_bytes"], 0), susp
        await agent.wait_states({"a": "SAVED", "b": "RUNNING"})
        results, _, _ = await op_events(nats_url, g)
        snap = one([r for r in results if r.job == "a" and r.kind is OpKind.SNAPSHOT], "a's snapshot")
        assert snap.ok and snap.bytes_moved >= ready1["device_bytes"] + ready2["device_bytes"], snap

        granted = await switch_back(a1, b, observer, g)
        resumed2 = one(a2.events("resumed"), "resume of a2")
        assert granted["context_restored"] is True
        assert resumed2["checksum"] == ready2["checksum"] and resumed2["ids"] == ready2["ids"]
        a1.send("release")
        await a1.wait("released", n=2)

        # One process leaves (its client closes): the job goes on registered in the other, which the next switch
        # still moves.
        a2.send("exit")
        assert await asyncio.to_thread(a2.proc.wait, 15) == 0
        ctx = await _parts_of(agent, "a", 1)
        assert ctx["pids"] == [a1.pid] and ctx["state"] == "RUNNING"
        a1.send("acquire")
        await a1.wait("granted", n=3)
        b.send("acquire")
        await eventually(queued(observer, g, "b"), what="b queued behind a again")
        a1.send("release")
        await b.wait("worked", n=2)
        await a1.wait("suspended", n=2)
        assert len(a2.events("suspended")) == 1
        await agent.wait_states({"a": "SAVED", "b": "RUNNING"})


async def test_a_process_that_died_leaves_the_job_registered_in_the_others(workers: Any, agent: AgentProcess) -> None:
    a1 = workers("dead", "a", "a1", handler="numpy", mb=1)
    a2 = workers("dead", "a", "a2", handler="numpy", mb=1)
    await a1.wait("ready", timeout=START)
    await a2.wait("ready", timeout=START)
    await _parts_of(agent, "a", 2)
    a2.close()  # SIGKILL: no unregistration; the agent's pid check notices
    ctx = await _parts_of(agent, "a", 1)
    assert ctx["pids"] == [a1.pid]


async def test_a_part_that_cannot_suspend_undoes_the_others(workers: Any, agent: AgentProcess, nats_url: str) -> None:
    g = "undo"
    a1 = workers(g, "a", "a1", handler="numpy", mb=2)
    a2 = workers(g, "a", "a2", handler="failing", mb=1)
    b = workers(g, "b", "b", handler="numpy", mb=1)
    ready1 = await a1.wait("ready", timeout=START)
    await a2.wait("ready", timeout=START)
    await b.wait("ready", timeout=START)
    async with AsyncTimeSliceClient("observer", "observer", nats_url) as observer:
        await _switch_begins(agent, a1, b, observer, g)
        await a2.wait("suspend_failed")
        # a1 had suspended; the switch failed in a2, so a1 is brought back: the whole job runs again
        resumed = await a1.wait("resumed")  # its undo carries the snapshot's op id: before, a1 took it for a retry
        assert resumed["device_bytes"] == ready1["device_bytes"]
        jobs = await agent.wait_states({"a": "RUNNING"})
        assert jobs["a"]["last_op_ok"] is False and "rolled back in every part" in jobs["a"]["last_op_error"]
        results, _, _ = await op_events(nats_url, g)
        failed = one([r for r in results if r.job == "a" and r.kind is OpKind.SNAPSHOT], "a's snapshot")
        assert not failed.ok and f"pid {a2.pid}" in (failed.error or ""), failed


async def test_an_undo_with_the_suspends_op_id_resumes(nats_url: str) -> None:
    """The agent undoes a snapshot step (another step or part failed) with a resume of the same op id: the channel
    must run it, not answer it with the suspend's outcome as a retry of that suspend. Before, the state stayed off the
    device while the agent recorded the job as running again."""
    log: list[str] = []
    async with stack(nats_url, "apart"), AsyncTimeSliceClient("a", "gu", nats_url) as a:
        await a.register_workload(Recorder("a", log), node_id="node-1")
        nc = await connect(nats_url)
        try:
            for action in ("suspend", "suspend", "resume", "resume"):  # each sent twice: a retry is answered alike
                cmd = WorkloadCommand(op_id="op-1", action=action)  # type: ignore[arg-type]
                reply = await nc.request(subjects.workload_rpc("node-1", "a"), encode(cmd), timeout=10)
                assert msgspec.json.decode(reply.data, type=WorkloadReply).ok
        finally:
            await nc.close()
    assert log == ["a:suspend", "a:resume"], log


async def test_a_process_that_dies_during_the_switch_does_not_hold_it_up(
    workers: Any, agent: AgentProcess, nats_url: str
) -> None:
    """One part's suspend hangs and its process is killed: that part has nothing left to move, so the switch ends
    when the others are done, not at the operation's deadline (120 s), and nobody is faulted."""
    g = "dies"
    a1 = workers(g, "a", "a1", handler="numpy", mb=1)
    a2 = workers(g, "a", "a2", handler="slow", mb=1)  # its suspend blocks until told
    b = workers(g, "b", "b", handler="numpy", mb=1)
    for w in (a1, a2, b):
        await w.wait("ready", timeout=START)
    async with AsyncTimeSliceClient("observer", "observer", nats_url) as observer:
        await _switch_begins(agent, a1, b, observer, g)
        await a2.wait("suspend_start")
        await a1.wait("suspended")
        a2.close()  # SIGKILL mid-suspend
        await b.wait("worked", timeout=20)
        jobs = await agent.wait_states({"a": "SAVED", "b": "RUNNING"})
        assert jobs["a"]["last_op_ok"] is True, jobs["a"]
        ctx = await _parts_of(agent, "a", 1)
        assert ctx["pids"] == [a1.pid]
