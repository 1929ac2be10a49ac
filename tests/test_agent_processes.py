"""The snapshot agent as a real process, with workload processes that hold real state
(tests/workers/workload_worker.py) and the orchestrator in this test's event loop.

What each test checks:

* a switch moves real state: the yielding job's registered state is freed (its device bytes drop to 0,
  reported by the job itself) and comes back bit-exact (same checksum) into the very same tensor /
  array objects; the op results in the stream (``ts.v1.agent.<node>.evt.<group>``) carry the op id,
  the epoch, the backend, the bytes moved, the device bytes freed and the elapsed time the job saw;
* ``freeze`` stops the job: a counter thread in the frozen process does not advance (and the process
  is in state ``T``) while another job holds the group, and it goes on after the restore;
* a failing suspend rolls back: the job is RUNNING again on its node, faulted in the group (with the
  reason), the waiter still gets the group, and ``timeslice agent-clear-fault`` + ``timeslice
  clear-fault`` let the job acquire again;
* an agent SIGKILLed during a snapshot does not wedge the group: within the agents bucket's TTL
  (+ a few seconds) the operation is resolved as lost (AgentLost), the job whose operation was cut is
  faulted and the waiter is granted; a restarted agent recovers its jobs from KV, the cut job shows
  FAULTED with a reason, and once cleared it comes back bit-exact;
* jobs registered but never run do not block the first acquire, and nothing is moved for them;
* a job whose state is offloaded on a node whose agent dies before its restore is not granted with its
  state missing (it is faulted until the agent is back and the fault is cleared).

A restarted agent meeting commands from before its restart, and an agent whose key goes: tests/test_agent_restarts.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import pytest
from timeslice_client import AsyncTimeSliceClient, GroupRecord
from timeslice_client.protocol import OpKind

from .agent_harness import (
    AGENT_TTL,
    MB,
    NODE,
    START,
    AgentProcess,
    Spawn,
    hold_then_queue,
    one,
    op_events,
    queued,
    switch_back,
    timeslice,
)
from .helpers import eventually, group_record

pytestmark = pytest.mark.usefixtures("orchestrator")


# --------------------------------------------------------------------------- real state moves


@pytest.mark.parametrize("handler", ["numpy", "torch"])
async def test_switch_frees_device_state_and_restores_it_bit_exact(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str, handler: str
) -> None:
    if handler == "torch":
        pytest.importorskip("torch")
    g = f"offload-{handler}"
    a = spawn(g, "a", handler=handler, mb=8)
    b = spawn(g, "b", handler="numpy", mb=2)
    ready_a = await a.wait("ready", timeout=START)
    ready_b = await b.wait("ready", timeout=START)
    assert ready_a["device_bytes"] >= 6 * MB and ready_a["host_bytes"] == 0, ready_a

    worked_a = await hold_then_queue(a, b, observer, g)
    a.send("release")
    worked_b = await b.wait("worked")

    # a's state left the "device": the job itself measures 0 bytes there, all of it on the host.
    start = one(a.events("suspend_start"), "suspend of a")
    susp = one(a.events("suspended"), "suspended a")
    releasing = a.last("releasing")
    assert releasing is not None and start["checksum"] == releasing["checksum"] == worked_a["checksum"]
    assert susp["device_bytes_before"] == ready_a["device_bytes"]
    assert susp["device_bytes_after"] == 0, susp
    assert susp["host_bytes_after"] >= susp["device_bytes_before"], susp
    assert susp["bytes_moved"] >= susp["device_bytes_before"] and susp["device_bytes_freed"] == ready_a["device_bytes"]
    jobs = await agent.wait_states({"a": "SAVED", "b": "RUNNING"})  # the agent stores a state after its result
    assert jobs["a"]["last_op_ok"] is True and jobs["a"]["device_bytes_freed"] == susp["device_bytes_freed"]
    assert b.events("resume_start") == [], "b never ran: there was nothing to restore"

    granted_a = await switch_back(a, b, observer, g)
    resumed = one(a.events("resumed"), "resume of a")
    # Bit-exact, into the same objects the training loop holds.
    assert granted_a["context_restored"] is True
    assert resumed["checksum"] == granted_a["checksum"] == releasing["checksum"]
    assert granted_a["ids"] == ready_a["ids"], "the restore replaced the training loop's tensors"
    assert granted_a["device_bytes"] == ready_a["device_bytes"], granted_a
    worked_a2 = await a.wait("worked", n=2)
    assert worked_a2["checksum"] != granted_a["checksum"], "the job trains on after the restore"
    susp_b = one(b.events("suspended"), "suspended b")
    assert (susp_b["device_bytes_before"], susp_b["device_bytes_after"]) == (ready_b["device_bytes"], 0)
    a.send("release")
    await a.wait("released", n=2)

    # The outcomes in the stream carry what the jobs measured.
    results, started, checker = await op_events(nats_url, g)
    assert checker.unpublished_grants() == []
    ea, eb, ea2 = worked_a["epoch"], worked_b["epoch"], granted_a["epoch"]
    assert ea < eb < ea2
    by_id = {r.op_id: r for r in results}
    snap = by_id[f"{g}:{eb}:{OpKind.SNAPSHOT}:{NODE}"]
    assert (snap.job, snap.kind, snap.epoch, snap.ok, snap.backend) == ("a", OpKind.SNAPSHOT, eb, True, "app_channel")
    assert (snap.bytes_moved, snap.device_bytes_freed) == (susp["bytes_moved"], susp["device_bytes_freed"])
    # (a suspend begun at the release, before the command: the operation's elapsed time covers only its end, and
    # work_ms the workload's whole call)
    whole = snap.work_ms if snap.began_at_release else snap.elapsed_ms
    assert whole is not None and whole >= susp["elapsed_ms"] > 0, (snap, susp)
    rest = by_id[f"{g}:{ea2}:{OpKind.RESTORE}:{NODE}"]
    assert (rest.job, rest.kind, rest.epoch, rest.ok, rest.backend) == ("a", OpKind.RESTORE, ea2, True, "app_channel")
    assert (rest.bytes_moved, rest.device_bytes_freed) == (resumed["bytes_moved"], resumed["device_bytes_taken"])
    assert rest.elapsed_ms >= resumed["elapsed_ms"] > 0, (rest, resumed)
    # The first grants restored nothing (the jobs never ran): answered at once, nothing moved.
    for epoch, job in ((ea, "a"), (eb, "b")):
        first = by_id[f"{g}:{epoch}:{OpKind.RESTORE}:{NODE}"]
        assert (first.job, first.ok, first.bytes_moved, first.elapsed_ms) == (job, True, 0, 0.0), first
    assert {s.op_id for s in started} == {snap.op_id, rest.op_id, f"{g}:{ea2}:{OpKind.SNAPSHOT}:{NODE}"}
    assert all(s.backend == "app_channel" and s.epoch == int(s.op_id.split(":")[1]) for s in started)


# --------------------------------------------------------------------------- freeze


async def test_freeze_stops_the_job_while_another_holds(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str
) -> None:
    g = "freeze"
    a = spawn(g, "a", backend="freeze", handler="none", counter_ms=10)
    b = spawn(g, "b", backend="noop", handler="none")
    await a.wait("ready", timeout=START)
    await b.wait("ready", timeout=START)
    await hold_then_queue(a, b, observer, g)
    a.send("release")
    granted_b = await b.wait("granted")

    # While b holds, a is stopped: state T, and its counter thread does not tick.
    await eventually(lambda: a.proc_state() == "T", timeout=2, what="a stopped")
    ticks = len(a.events("tick"))
    window_end = time.monotonic() + 1.0
    samples = 0
    while time.monotonic() < window_end:
        assert a.proc_state() == "T", "a ran while b held the group"
        samples += 1
        await asyncio.sleep(0.05)  # sampling a window, not waiting for something
    assert samples >= 5
    assert len(a.events("tick")) == ticks, "a's counter advanced while a was frozen"
    b.send("release")
    released_b = await b.wait("released")
    assert a.proc_state() == "T", "a stays frozen until its job is granted again"
    await agent.wait_states({"a": "SAVED", "b": "RUNNING"})

    # A frozen process cannot ask for the group itself: its job's next grant (here taken on a's behalf)
    # restores it, which continues it.
    async with AsyncTimeSliceClient("a", g, nats_url) as on_behalf:
        grant = await on_behalf.acquire(timeout=10)
        assert grant.context_restored is True and grant.epoch == granted_b["epoch"] + 1
        assert a.proc_state() != "T"
        thawed_at = time.time()
        after = await eventually(lambda: [e for e in a.events("tick") if e["t"] > thawed_at], what="a ticks again")
        await on_behalf.release()
    ticks_all = a.events("tick")
    before = [e for e in ticks_all if e["t"] < granted_b["t"]]
    frozen = [e for e in ticks_all if granted_b["t"] <= e["t"] <= released_b["t"]]
    assert frozen == [], f"a ticked while b held the group: {frozen[:3]}"
    assert before, "a's counter never ran before the switch"
    # The counter went on from where it stopped: it did not advance while frozen.
    first_after = next(e for e in ticks_all if e["t"] > released_b["t"])
    assert first_after["n"] == before[-1]["n"] + 1 and first_after["n"] <= after[0]["n"]
    assert first_after["t"] - before[-1]["t"] >= released_b["t"] - granted_b["t"]

    a.send("acquire")  # alone now: its context is loaded, granted without any operation
    again = await a.wait("granted", n=2)
    assert again["context_restored"] is False
    a.send("release")
    await a.wait("released", n=2)


# --------------------------------------------------------------------------- a failing suspend


async def test_failed_suspend_rolls_back_and_faults_only_that_job(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str
) -> None:
    g = "failing"
    a = spawn(g, "a", handler="failing", mb=4)
    b = spawn(g, "b", handler="numpy", mb=1)
    ready_a = await a.wait("ready", timeout=START)
    await b.wait("ready", timeout=START)
    worked_a = await hold_then_queue(a, b, observer, g)
    a.send("release")
    granted_b = await b.wait("granted")  # the other waiter still gets the group

    failed = one(a.events("suspend_failed"), "failed suspend")
    await agent.wait_states({"a": "RUNNING", "b": "RUNNING"})
    await eventually(lambda: _held_by(observer, g, "b"), what="record stored")  # stored after the grant
    assert "injected failure" in failed["error"]
    assert failed["device_bytes"] == ready_a["device_bytes"] and failed["checksum"] == worked_a["checksum"]
    rc, out = await timeslice(nats_url, "agent-status", "--node-id", NODE, "--json")
    assert rc == 0, out
    ctx = {j["job"]: j for j in json.loads(out)}
    assert ctx["a"]["state"] == "RUNNING", ctx["a"]  # rolled back, not FAULTED on the node
    assert ctx["a"]["last_op_ok"] is False and "injected failure" in ctx["a"]["last_op_error"]
    assert ctx["b"]["state"] == "RUNNING"
    rc, out = await timeslice(nats_url, "status", "--group", g, "--json")
    assert rc == 0, out
    rec = one(json.loads(out)["groups"], "group record")
    assert rec["holder"]["job"] == "b" and rec["holder"]["epoch"] == granted_b["epoch"]
    assert "injected failure" in rec["faulted"]["a"], rec["faulted"]

    a.send("acquire")
    refused = await a.wait("error")
    assert refused["where"] == "acquire" and refused["type"] == "JobFaulted", refused

    rc, out = await timeslice(nats_url, "agent-clear-fault", "--node-id", NODE, "--job", "a")
    assert rc == 0, out
    rc, out = await timeslice(nats_url, "clear-fault", "--group", g, "--job", "a")
    assert rc == 0, out
    await eventually(lambda: _not_faulted(observer, g, "a"), what="a's fault cleared")
    granted_a = await switch_back(a, b, observer, g)
    # a's state never left (the suspend was rolled back): it is just as it was.
    assert granted_a["checksum"] == worked_a["checksum"] and granted_a["ids"] == ready_a["ids"]
    assert granted_a["device_bytes"] == ready_a["device_bytes"]
    assert a.events("resume_start") == []
    assert one(b.events("suspended"), "suspended b")["device_bytes_after"] == 0
    a.send("release")
    await a.wait("released")
    results, _, checker = await op_events(nats_url, g)
    assert checker.unpublished_grants() == []
    assert [(r.job, r.kind, r.ok) for r in results if r.bytes_moved] == [("b", OpKind.SNAPSHOT, True)]
    bad = one([r for r in results if not r.ok], "failed op")
    assert (bad.job, bad.kind, bad.backend) == ("a", OpKind.SNAPSHOT, "app_channel")
    assert "injected failure" in (bad.error or "") and "rolled back" in (bad.error or "")


async def _not_faulted(obs: AsyncTimeSliceClient, group: str, job: str) -> bool:
    return job not in (await group_record(obs, group)).faulted


# --------------------------------------------------------------------------- the job dies mid-operation


async def test_job_killed_during_its_snapshot_does_not_wedge_the_group_or_fault_the_job(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str
) -> None:
    """The agent watches the job's processes while it snapshots them: when they exit, the operation ends
    at once (not at its timeout, 120 s here), the job is unregistered and not faulted, and the waiter gets
    the group."""
    g = "job-dies"
    a = spawn(g, "a", handler="slow", mb=4, slow_s=60)
    b = spawn(g, "b", handler="numpy", mb=1)
    await a.wait("ready", timeout=START)
    await b.wait("ready", timeout=START)
    await hold_then_queue(a, b, observer, g)
    a.send("release")
    await a.wait("suspend_start")  # the snapshot of a is running (the handler blocks)

    t_kill = time.time()
    a.close()  # SIGKILL mid-suspend: the agent's request to it will never be answered
    granted_b = await b.wait("granted", timeout=15)
    delay = granted_b["t"] - t_kill
    assert delay <= 5, f"the group waited {delay:.1f} s for a job that had exited"
    rec = await eventually(lambda: _held_by(observer, g, "b"), what="record stored")
    assert "a" not in rec.faulted and "a" not in rec.placements, rec
    assert "a" not in await agent.jobs()
    results, _, checker = await op_events(nats_url, g)
    assert checker.unpublished_grants() == []
    bad = one([r for r in results if r.job == "a" and not r.ok], "a's ended snapshot")
    assert bad.kind is OpKind.SNAPSHOT and "exited during the snapshot" in (bad.error or "")
    b.send("release")
    await b.wait("released")


# --------------------------------------------------------------------------- the agent dies mid-operation


@pytest.mark.slow
async def test_agent_killed_during_snapshot_and_restarted_grants_only_once_the_suspend_ended(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str
) -> None:
    """The agent dies while job a's own process is suspending its state (the handler blocks), and comes back. The
    restarted agent announces a, is sent the snapshot again and asks a's process again, which answers once its
    suspend has ended: only then is b granted, and a is not faulted. (Before, the restarted agent answered at once
    with a failure, and b was granted 2.8 s after the release while a's 12 s suspend still ran: on a GPU both
    contexts sat on the device.)"""
    g = "agent-dies"
    a = spawn(g, "a", handler="slow", mb=4, slow_s=60)
    b = spawn(g, "b", handler="numpy", mb=1)
    ready_a = await a.wait("ready", timeout=START)
    await b.wait("ready", timeout=START)
    worked_a = await hold_then_queue(a, b, observer, g)
    a.send("release")
    await a.wait("suspend_start")  # the snapshot of a is running (the handler blocks)
    assert (await agent.jobs())["a"]["state"] == "TRANSITIONING"

    agent.kill()
    agent.start()
    await agent.wait_ready()
    rc, out = await timeslice(nats_url, "agent-status", "--node-id", NODE, "--json")
    assert rc == 0, out
    ctx = {j["job"]: j for j in json.loads(out)}
    assert ctx["a"]["state"] == "TRANSITIONING" and "restarted during an operation" in ctx["a"]["reason"], ctx["a"]
    await eventually(lambda: _placed(observer, g, {"a", "b"}), what="jobs placed again by the new agent")
    rec = await group_record(observer, g)
    assert rec.holder is None and "a" not in rec.faulted, "no grant while a's suspend runs"
    assert not b.events("granted")

    a.send("unblock")  # a's suspend ends: the restarted agent's repeated command gets its outcome
    suspended_a = await a.wait("suspended")
    granted_b = await b.wait("granted", timeout=20)
    assert granted_b["t"] >= suspended_a["t"], "b was granted before a's state was off the device"
    rec = await eventually(lambda: _held_by(observer, g, "b"), what="record stored")
    assert "a" not in rec.faulted, rec.faulted

    # a comes back bit-exact.
    a.send("acquire")
    await eventually(queued(observer, g, "a"), what="a queued behind b")
    b.send("release")
    granted_a = await a.wait("granted", n=2, timeout=20)
    assert granted_a["context_restored"] is True
    assert granted_a["checksum"] == worked_a["checksum"] and granted_a["ids"] == ready_a["ids"]
    a.send("release")
    await a.wait("released")
    _, _, checker = await op_events(nats_url, g)  # the invariant checker agrees with the whole story
    assert checker.unpublished_grants() == []


@pytest.mark.slow
async def test_a_restarted_agent_restores_the_incoming_job_only_after_the_outgoing_suspend_it_follows(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str
) -> None:
    """The agent dies during a switch whose restore waits for the outgoing job's snapshot (``Restore.after``), and
    the incoming job is announced first when it comes back (its key sorts first). The orchestrator sends its
    restore again before the snapshot it follows: that snapshot runs nowhere yet, so ``after`` named nothing to
    wait for, and the restore began beside a suspend still moving the outgoing state off the device (two contexts
    on it at once, without the room rule's leave). Now a restore also waits for a job of its group whose state a
    restart left in doubt (TRANSITIONING, its last operation one the restore follows)."""
    agent.stop()  # the restore must wait for the snapshot: no room rule's leave to start beside it
    agent.args = ("--no-overlap-restores",)
    agent.start()
    await agent.wait_ready()
    g = "agent-dies-order"
    z = spawn(g, "z", handler="slow", mb=4, slow_s=60)  # outgoing: its key sorts after the incoming one's
    b = spawn(g, "b", handler="numpy", mb=1)
    await z.wait("ready", timeout=START)
    await b.wait("ready", timeout=START)
    b.send("acquire")
    await b.wait("worked")
    b.send("release")
    await b.wait("released")
    z.send("acquire")  # b's state is moved off at this switch (its suspend is not the slow one)
    await z.wait("worked")
    assert (await agent.jobs())["b"]["state"] == "SAVED"
    b.send("acquire")
    await eventually(queued(observer, g, "b"), what="b queued behind z")
    z.send("release")
    await z.wait("suspend_start")  # the switch: z's snapshot runs (blocked), b's restore waits for it

    agent.kill()
    agent.start()
    await agent.wait_ready()
    await eventually(lambda: _placed(observer, g, {"z", "b"}), what="jobs placed again by the new agent")
    early = None
    with contextlib.suppress(AssertionError):
        early = await b.wait("resume_start", timeout=3.0)  # the old code began b's restore within this
    assert early is None, f"b's restore began at {early} while z's suspend still ran"

    z.send("unblock")
    suspended = await z.wait("suspended")
    resumed = await b.wait("resume_start", timeout=30)
    assert resumed["t"] >= suspended["t"], (resumed, suspended)
    granted = await b.wait("granted", n=2, timeout=30)
    assert granted["context_restored"] is True
    rec = await eventually(lambda: _held_by(observer, g, "b"), what="record stored")
    assert not rec.faulted, rec.faulted


async def test_agent_killed_during_snapshot_for_good_grants_at_the_snapshot_deadline_and_faults_the_job(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str
) -> None:
    """The agent dies mid-snapshot and stays dead: nobody can tell whether a's state left the device. The group
    waits for the snapshot's deadline (a's op timeout), not for the agent's loss, then faults a and grants b.
    (Before, b was granted at the agent's loss, 7.2 s after the release, while a's suspend still ran.)"""
    g = "agent-gone"
    op_timeout = AGENT_TTL + 6
    a = spawn(g, "a", handler="slow", mb=4, slow_s=60, op_timeout=op_timeout)
    b = spawn(g, "b", handler="numpy", mb=1)
    await a.wait("ready", timeout=START)
    await b.wait("ready", timeout=START)
    await hold_then_queue(a, b, observer, g)
    t_release = time.time()
    a.send("release")
    await a.wait("suspend_start")
    agent.kill()

    async def agent_lost() -> bool:
        return NODE in (await group_record(observer, g)).lost_nodes

    await eventually(agent_lost, timeout=AGENT_TTL + 10, what="the agent's loss is recorded")
    rec = await group_record(observer, g)
    assert rec.holder is None and "a" not in rec.faulted, "no grant at the agent's loss: a's state is unknown"
    granted_b = await b.wait("granted", timeout=op_timeout + 15)
    assert granted_b["t"] - t_release >= op_timeout - 1, "b was granted before a's snapshot deadline"
    rec = await eventually(lambda: _held_by(observer, g, "b"), what="record stored")
    assert "timed out" in rec.faulted.get("a", ""), rec.faulted
    assert granted_b["context_restored"] is False
    a.send("unblock")
    agent.start()
    await agent.wait_ready()


async def _held_by(obs: AsyncTimeSliceClient, group: str, job: str) -> GroupRecord | None:
    rec = await group_record(obs, group)
    return rec if rec.holder is not None and rec.holder.job == job else None


async def _placed(obs: AsyncTimeSliceClient, group: str, jobs: set[str]) -> bool:
    rec = await group_record(obs, group)
    return all(NODE in rec.placements.get(j, ()) for j in jobs)


# --------------------------------------------------------------------------- jobs that never ran


async def test_registered_jobs_that_never_ran_do_not_block_the_first_acquire(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str
) -> None:
    g = "never-ran"
    a = spawn(g, "a", handler="numpy", mb=1)
    frozen = spawn(g, "f", backend="freeze", handler="none")
    b = spawn(g, "b", handler="numpy", mb=1)
    for w in (a, frozen, b):
        await w.wait("ready", timeout=START)
    await eventually(lambda: _placed(observer, g, {"a", "f", "b"}), what="all registered")
    assert {j: c["state"] for j, c in (await agent.jobs()).items()} == {"a": "IDLE", "f": "IDLE", "b": "IDLE"}

    b.send("acquire")
    granted = await b.wait("granted", timeout=10)
    assert granted["epoch"] == 1
    b.send("release")
    await b.wait("released")
    a.send("acquire")
    await a.wait("granted", timeout=10)
    # b ran, so it was snapshotted for a; a never ran, so nothing was restored; f was never touched.
    assert one(b.events("suspended"), "suspended b")["device_bytes_after"] == 0
    assert a.events("resume_start") == [] and a.events("suspend_start") == []
    assert frozen.proc_state() != "T"
    await agent.wait_states({"a": "RUNNING", "f": "IDLE", "b": "SAVED"}, exact=True)
    a.send("release")
    await a.wait("released")
    results, _, _ = await op_events(nats_url, g)
    assert all(r.ok for r in results), results
    assert {r.job for r in results} == {"a", "b"}


# --------------------------------------------------------------------------- the agent dies before a restore


@pytest.mark.slow
async def test_job_saved_on_a_lost_agent_is_not_granted_without_its_state(
    spawn: Spawn, agent: AgentProcess, observer: AsyncTimeSliceClient, nats_url: str
) -> None:
    """a's state is offloaded (SAVED) on n1; n1's agent dies during the snapshot of b that precedes a's
    restore. a must not be granted while its state is still offloaded: either its grant waits for a
    restore (by the restarted agent), or a is refused (faulted)."""
    g = "lost-before-restore"
    a = spawn(g, "a", handler="numpy", mb=4)
    b = spawn(g, "b", handler="slow", mb=1, slow_s=60)
    ready_a = await a.wait("ready", timeout=START)
    await b.wait("ready", timeout=START)
    worked_a = await hold_then_queue(a, b, observer, g)
    a.send("release")
    await b.wait("worked")
    assert one(a.events("suspended"), "suspended a")["device_bytes_after"] == 0
    a.send("acquire")
    await eventually(queued(observer, g, "a"), what="a queued behind b")
    b.send("release")
    await b.wait("suspend_start")  # b's snapshot hangs: a's restore has not started
    agent.kill()

    async def lost() -> bool:
        return NODE in (await group_record(observer, g)).lost_nodes

    await eventually(lost, timeout=AGENT_TTL + 15, what="n1's agent lost")
    # b's snapshot stays pending (b's own process may still be suspending it). a's restore either had not started
    # (queued behind it: a's state is stranded on the lost node, a is refused) or had run beside it (the node had
    # room for both): then a is granted once b's snapshot is known, which the restarted agent tells once b's
    # suspend ends.
    agent.start()
    await agent.wait_ready()
    b.send("unblock")

    def outcome() -> dict[str, Any] | None:
        granted = a.events("granted")
        refused = [e for e in a.events("error") if e["where"] == "acquire"]
        return granted[1] if len(granted) >= 2 else (refused[0] if refused else None)

    got = await eventually(outcome, timeout=40, what="a granted again or refused")
    if got["ev"] == "error":
        assert got["type"] == "JobFaulted", got  # refused: acceptable
        return
    assert got["device_bytes"] == ready_a["device_bytes"], f"a was granted with its state offloaded: {got}"
    assert got["checksum"] == worked_a["checksum"] and got["context_restored"] is True


async def _faulted(obs: AsyncTimeSliceClient, group: str, job: str) -> bool:
    return job in (await group_record(obs, group)).faulted
