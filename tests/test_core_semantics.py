"""Plain unit tests pinning the semantics described in ``core.py``, and regressions the state machine found."""

from __future__ import annotations

from typing import Any

import msgspec
from timeslice_client.protocol import (
    Acquire,
    AgentLost,
    Cancel,
    ClearFault,
    Contended,
    Dequeued,
    ErrorCode,
    Granted,
    GroupState,
    JobUnregistered,
    OpKind,
    OpResult,
    Refused,
    Release,
    Released,
    Renew,
    Restore,
    Revoked,
    Snapshot,
)
from timeslice_orchestrator.core import apply, next_deadline

from .core_sim import NODES, T0, G, Sim, commands, notices

# --------------------------------------------------------------------------- unit tests of the semantics


def test_first_acquire_without_agents_is_granted_at_once() -> None:
    sim = Sim()
    actions = sim.acquire("a")
    (g,) = notices(actions, Granted)
    assert (g.job, g.epoch, g.context_restored) == ("a", 1, False)
    assert commands(actions) == []
    assert sim.rec.state is GroupState.LOCKED
    assert sim.rec.holder is not None and not sim.rec.holder.confirmed


def test_zero_cost_reacquire_after_release_with_no_waiter() -> None:
    sim = Sim()
    sim.register("a", "n1")
    first = sim.hold("a")
    assert first.context_restored  # registered but never run: its context was brought in
    (rel,) = notices(sim.release("a"), Released)
    assert rel.snapshot_deferred and rel.pending_waiters == 0
    assert sim.rec.state is GroupState.IDLE_YIELDED
    assert sim.rec.active_job == "a" and sim.rec.loaded == {"n1": "a"} and sim.rec.holder is None

    actions = sim.acquire("a", dt=50)
    (g,) = notices(actions, Granted)
    assert commands(actions) == [], "no snapshot and no restore when the job is alone"
    assert g.epoch == first.epoch + 1 and not g.context_restored
    assert sim.rec.state is GroupState.LOCKED and sim.rec.loaded == {"n1": "a"}


def test_the_holder_is_told_of_each_new_waiter_and_a_grant_counts_those_left() -> None:
    """``Contended`` goes to the holder when the first job starts waiting (not for later waiters, not when a
    waiter asks again, not during a switch, when nobody holds); a grant says how many still wait. Workloads use
    it to suspend at their release (WorkloadChannel.suspend_early)."""
    sim = Sim()
    for job in ("a", "b", "c"):
        sim.register(job, "n1")
    sim.hold("a")
    assert notices(sim.acquire("b")) == [Contended(group=G, job="a", epoch=1, waiters=1)]
    assert notices(sim.acquire("b", dt=5)) == [], "a waiter's second acquire is not news"
    snap, restore = commands(sim.release("a"))
    assert notices(sim.acquire("c")) == [], "nobody holds during a switch"
    sim.result(snap)
    (g,) = notices(sim.result(restore), Granted)
    assert (g.job, g.waiters) == ("b", 1)
    assert notices(sim.acquire("a")) == [], "b was granted while c waited: it knows"
    (again,) = notices(sim.acquire("b"), Granted)
    assert (again.epoch, again.waiters) == (2, 2), "the holder's re-acquire counts them too"
    snap, restore = commands(sim.release("b"))
    assert sim.rec.switch is not None and sim.rec.switch.to is not None and sim.rec.switch.to.job == "c"
    sim.result(snap)
    (g,) = notices(sim.result(restore), Granted)
    assert (g.job, g.waiters) == ("c", 1)
    sim(Cancel(group=G, job="a", request_id=sim.rec.queue[0].request_id))
    assert notices(sim.acquire("b")) == [Contended(group=G, job="c", epoch=3, waiters=1)], "a new first waiter"


def test_holder_reacquire_gets_the_same_epoch_back() -> None:
    sim = Sim()
    g1 = sim.hold("a")
    actions = sim.acquire("a", lease_ms=7_000, dt=100)
    (g2,) = notices(actions, Granted)
    assert g2.epoch == g1.epoch and g2.request_id != g1.request_id
    assert sim.rec.holder is not None and sim.rec.holder.lease_deadline_ms == sim.now + 7_000


def test_release_by_non_holder_is_refused_naming_the_holder() -> None:
    sim = Sim()
    sim.hold("a")
    (r,) = notices(sim.release("b", epoch=1), Refused)
    assert (r.code, r.holder, r.epoch, r.job) == (ErrorCode.NOT_HOLDER, "a", 1, "b")
    assert sim.rec.holder is not None and sim.rec.holder.job == "a"


def test_release_or_renew_with_a_stale_epoch_is_refused() -> None:
    sim = Sim()
    sim.hold("a")
    sim.release("a")
    sim.hold("a")  # epoch 2 now
    (r,) = notices(sim.release("a", epoch=1), Refused)
    assert (r.code, r.epoch) == (ErrorCode.STALE_EPOCH, 2)
    (r,) = notices(sim.renew("a", epoch=1), Refused)
    assert r.code is ErrorCode.STALE_EPOCH
    assert sim.rec.holder is not None and sim.rec.holder.epoch == 2


def test_grant_not_confirmed_is_revoked_and_the_next_waiter_granted() -> None:
    sim = Sim()
    (g,) = notices(sim.acquire("a", confirm_ms=1_000, lease_ms=30_000), Granted)
    assert g.lease_deadline_ms == sim.now + 1_000  # a confirmation window, not the full lease
    sim.acquire("b", waiter_ttl_ms=5_000)
    assert [w.job for w in sim.rec.queue] == ["b"]
    assert next_deadline(sim.rec) == g.lease_deadline_ms
    assert notices(sim.tick(dt=999)) == []
    actions = sim.tick(dt=1)
    revoked, granted = notices(actions)
    assert isinstance(revoked, Revoked) and revoked.job == "a" and "not confirmed" in revoked.reason
    assert isinstance(granted, Granted) and (granted.job, granted.epoch) == ("b", 2)


def test_confirmed_lease_runs_its_full_length_then_expires() -> None:
    sim = Sim()
    sim.acquire("a", confirm_ms=1_000, lease_ms=10_000)
    sim.renew("a", dt=500)
    assert sim.rec.holder is not None and sim.rec.holder.confirmed
    assert notices(sim.tick(dt=9_999)) == []
    (rv,) = notices(sim.tick(dt=1), Revoked)
    assert rv.reason == "lease expired"
    assert sim.rec.state is GroupState.IDLE_YIELDED


def test_switch_snapshots_then_restores_and_grants_only_after_every_restore() -> None:
    sim = Sim()
    for job in ("a", "b"):
        for node in NODES:
            sim.register(job, node)
    sim.hold("a")
    assert sim.rec.loaded == {"n1": "a", "n2": "a"}
    assert notices(sim.acquire("b")) == [Contended(group=G, job="a", epoch=1, waiters=1)]
    actions = sim.release("a")
    (rel,) = notices(actions, Released)
    assert rel.pending_waiters == 1 and not rel.snapshot_deferred
    cmds = commands(actions)
    # The restores go out with the snapshots; on each node the agent runs its restore after the snapshot there.
    assert [(type(c), c.job, c.node, c.epoch) for c in cmds] == [
        (Snapshot, "a", "n1", 2),
        (Snapshot, "a", "n2", 2),
        (Restore, "b", "n1", 2),
        (Restore, "b", "n2", 2),
    ]
    snaps, restores = cmds[:2], cmds[2:]
    assert [r.after for r in restores] == [(snaps[0].op_id,), (snaps[1].op_id,)]  # type: ignore[union-attr]
    # A restore's deadline counts from when the snapshot it follows is due.
    assert [r.deadline_ms - s.deadline_ms for r, s in zip(restores, snaps, strict=True)] == [10_000, 10_000]
    assert sim.rec.state is GroupState.SWITCHING and sim.rec.epoch == 2

    assert commands(sim.result(snaps[0])) == []  # nothing new to send
    assert notices(sim.result(snaps[1])) == []
    assert notices(sim.result(restores[1])) == []  # one restore still out: no grant
    (g,) = notices(sim.result(restores[0]), Granted)
    assert (g.job, g.epoch, g.context_restored) == ("b", 2, True)
    assert sim.rec.loaded == {"n1": "b", "n2": "b"} and sim.rec.active_job == "b"


def test_failed_snapshot_faults_that_job_and_the_waiter_still_gets_the_group() -> None:
    sim, snap, restore = Sim.a_releasing_to_b()
    assert (restore.job, restore.node, restore.after) == ("b", "n1", (snap.op_id,))
    assert commands(sim.result(snap, ok=False)) == []
    assert sim.rec.faulted == {"a": "backend said no"}
    (g,) = notices(sim.result(restore), Granted)
    assert g.job == "b"
    # The faulted job is refused until its fault is cleared.
    (r,) = notices(sim.acquire("a"), Refused)
    assert r.code is ErrorCode.JOB_FAULTED and r.message == "backend said no"
    sim(ClearFault(group=G, job="a"))
    assert sim.rec.faulted == {}
    assert notices(sim.acquire("a")) == [Contended(group=G, job="b", epoch=2, waiters=1)]
    assert [w.job for w in sim.rec.queue] == ["a"]


def test_failed_restore_faults_the_incoming_job_which_is_refused() -> None:
    sim = Sim()
    sim.register("b", "n1")
    (restore,) = commands(sim.acquire("b"))
    actions = sim.result(restore, ok=False)
    (r,) = notices(actions, Refused)
    assert (r.job, r.code) == ("b", ErrorCode.JOB_FAULTED)
    assert sim.rec.state is GroupState.IDLE and sim.rec.holder is None and "b" in sim.rec.faulted


def _two_node_switch(**register_a: Any) -> tuple[Sim, Snapshot | Restore, Snapshot | Restore]:
    """Job a on n1 (``register_a``: its registration's options) holds, b on n2 waits patiently, a releases: the
    switch's snapshot of a on n1 and restore of b on n2, neither answered yet."""
    sim = Sim()
    sim.register("a", "n1", **register_a)
    sim.register("b", "n2")
    sim.hold("a")
    sim.acquire("b", timeout_ms=60_000, waiter_ttl_ms=600_000)
    snap, restore = commands(sim.release("a"))
    return sim, snap, restore


def test_agent_lost_mid_snapshot_grants_nothing_until_the_snapshot_is_known_or_its_deadline() -> None:
    """The agent snapshotting the outgoing job dies: that job's context may still be on the device (its own
    process may still be suspending it), so the incoming job is not granted on the agent's loss; the snapshot
    stays pending until an agent on that node answers it, or until its deadline, which faults the outgoing job."""
    sim, snap, restore = _two_node_switch(op_timeout_ms=10_000)
    assert snap.node == "n1"
    assert (restore.job, restore.node, restore.after) == ("b", "n2", ())  # type: ignore[union-attr]
    assert commands(sim(AgentLost(group=G, node="n1"))) == []
    assert "a" not in sim.rec.faulted and sim.rec.loaded.get("n1") == "a", "a's context may still be there"
    assert notices(sim.result(restore), Granted) == [], "no grant while the outgoing state is unknown"
    assert sim.rec.state is GroupState.SWITCHING
    (g,) = notices(sim.tick(dt=10_000), Granted)  # the snapshot's deadline: a is faulted, b goes on
    assert g.job == "b" and sim.rec.loaded == {"n2": "b"}
    assert "timed out" in sim.rec.faulted["a"]
    # The lost answer arriving after all changes nothing (fenced: the operation is gone).
    before = sim.rec
    sim.result(snap)
    assert sim.rec is before


def test_agent_restarted_mid_snapshot_answers_it_and_only_then_the_incoming_job_is_granted() -> None:
    sim, snap, restore = _two_node_switch()
    sim(AgentLost(group=G, node="n1"))
    assert notices(sim.result(restore), Granted) == []
    assert commands(sim.register("a", "n1")) == [snap], "the restarted agent is sent the snapshot again"
    (g,) = notices(sim.result(snap), Granted)  # it answered once a's state was off the device
    assert g.job == "b" and "a" not in sim.rec.faulted and sim.rec.saved == {"a": ("n1",)}


def test_agent_lost_mid_restore_faults_the_incoming_job() -> None:
    sim = Sim()
    sim.register("b", "n1")
    commands(sim.acquire("b"))
    assert sim.rec.state is GroupState.SWITCHING
    (r,) = notices(sim(AgentLost(group=G, node="n1")), Refused)
    assert r.code is ErrorCode.JOB_FAULTED
    assert sim.rec.switch is None and sim.rec.placements == {} and sim.rec.state is GroupState.IDLE


def test_operation_timeout_resolves_the_operation() -> None:
    sim, snap, restore = _two_node_switch(op_timeout_ms=2_000)
    assert next_deadline(sim.rec) == snap.deadline_ms == sim.now + 2_000
    assert restore.job == "b" and restore.deadline_ms == sim.now + 10_000  # on n2: it follows nothing
    assert commands(sim.tick(dt=2_000)) == []
    assert "timed out" in sim.rec.faulted["a"]
    (g,) = notices(sim.result(restore), Granted)
    assert g.job == "b"


def test_job_registered_but_never_run_gets_a_restore_and_is_granted_when_it_succeeds() -> None:
    sim = Sim()
    sim.register("c", "n1")
    sim.register("c", "n2")
    actions = sim.acquire("c")
    assert notices(actions) == []
    cmds = commands(actions)
    assert [(type(c), c.job, c.node) for c in cmds] == [(Restore, "c", "n1"), (Restore, "c", "n2")]
    assert notices(sim.result(cmds[0])) == []
    (g,) = notices(sim.result(cmds[1]), Granted)
    assert g.job == "c" and g.context_restored and g.epoch == 1


def test_cancel_crossing_a_grant_releases_it() -> None:
    sim = Sim()
    sim.hold("a")
    rid = sim.rid("b")
    sim.acquire("b", rid)
    (g,) = notices(sim.release("a"), Granted)  # b granted; its client cancels before it sees the grant
    assert g.request_id == rid
    (rel,) = notices(sim(Cancel(group=G, job="b", request_id=rid, reason="timeout")), Released)
    assert (rel.job, rel.epoch, rel.request_id) == ("b", g.epoch, rid)
    assert sim.rec.holder is None and sim.rec.state is GroupState.IDLE_YIELDED


def test_cancel_of_a_waiter_dequeues_it_and_the_next_waiter_keeps_its_place() -> None:
    sim = Sim()
    sim.hold("a")
    rb, rc = sim.rid("b"), sim.rid("c")
    sim.acquire("b", rb)
    sim.acquire("c", rc)
    (d,) = notices(sim(Cancel(group=G, job="b", request_id=rb)), Dequeued)
    assert (d.job, d.request_id) == ("b", rb)
    (g,) = notices(sim.release("a"), Granted)
    assert g.request_id == rc


def test_waiter_timeout_and_lost_waiter_are_dequeued() -> None:
    sim = Sim()
    sim.hold("a")
    sim.acquire("b", timeout_ms=1_000, waiter_ttl_ms=5_000)
    sim.acquire("c", timeout_ms=60_000, waiter_ttl_ms=2_000)
    ds = notices(sim.tick(dt=1_000), Dequeued)
    assert [(d.job, d.reason) for d in ds] == [("b", "timeout")]
    sim.renew("a")
    ds = notices(sim.tick(dt=1_000), Dequeued)
    assert [(d.job, d.reason) for d in ds] == [("c", "waiter lost (no renewal)")]
    assert sim.rec.queue == ()


def test_waiter_renewal_keeps_it_alive_and_unknown_requests_are_told() -> None:
    sim = Sim()
    sim.hold("a")
    rid = sim.rid("b")
    sim.acquire("b", rid, waiter_ttl_ms=1_000)
    sim(Renew(group=G, job="b", request_id=rid), dt=900)
    assert notices(sim.tick(dt=900)) == []
    (d,) = notices(sim(Renew(group=G, job="b", request_id="nope")), Dequeued)
    assert d.reason == "not waiting"


def test_second_acquire_of_a_waiter_replaces_its_request_and_keeps_its_place() -> None:
    sim = Sim()
    sim.hold("a")
    sim.acquire("b")
    sim.acquire("c", dt=10)
    r2 = sim.rid("b")
    sim.acquire("b", r2, dt=10)
    assert [(w.job, w.request_id) for w in sim.rec.queue] == [("b", r2), ("c", "c-3")]
    assert sim.rec.queue[0].enqueued_at_ms == T0


def test_invalid_acquire_is_refused() -> None:
    sim = Sim()
    (r,) = notices(sim.acquire("a", lease_ms=10), Refused)
    assert r.code is ErrorCode.INVALID and "lease_ms" in r.message
    assert sim.rec.queue == () and sim.rec.holder is None


def test_late_op_result_of_an_older_epoch_changes_nothing() -> None:
    sim, snap, restore = Sim.a_releasing_to_b()
    sim.result(snap)
    sim.result(restore)  # b holds at epoch 2
    sim.renew("b")
    sim.acquire("a")
    snap3, _restore3 = commands(sim.release("b"))  # epoch 3: snapshot b, then restore a
    before = sim.rec
    for late in (snap, restore):  # answers of epoch 2, again
        sim.result(late, ok=False)
        assert sim.rec is before
    forged = OpResult(group=G, op_id=snap3.op_id, node="n1", job="b", kind=OpKind.SNAPSHOT, epoch=2, ok=False)
    sim(forged)
    assert sim.rec is before, "an answer carrying an old epoch never touches the current switch"


def test_reapplying_an_applied_event_is_a_no_op() -> None:
    sim = Sim()
    ev = Acquire(group=G, job="a", request_id="r1")
    sim(ev)
    rec = sim.rec
    new, actions = apply(rec, ev, sim.now + 100_000, rec.last_seq)
    assert new is rec and actions == []


def test_next_deadline() -> None:
    sim = Sim()
    assert next_deadline(sim.rec) is None
    sim.acquire("a", confirm_ms=1_000)
    sim.acquire("b", waiter_ttl_ms=500, timeout_ms=100)
    assert next_deadline(sim.rec) == sim.now + 100


# --------------------------------------------------------------------------- regressions found by the state machine


def test_release_by_the_incoming_job_before_its_grant_dequeues_it_with_a_notice() -> None:
    sim = Sim()
    sim.register("a", "n1")
    rid = sim.rid("a")
    (restore,) = commands(sim.acquire("a", rid))  # a is the incoming job of a switch
    # A release naming another request (an old one, retried) does not touch the wait.
    (r,) = notices(sim(Release(group=G, job="a", request_id="a-old", epoch=0)), Refused)
    assert r.code is ErrorCode.NOT_HOLDER and sim.rec.switch is not None and sim.rec.switch.to is not None
    # Releasing the pending request itself: the caller gave up; it is told so.
    (d,) = notices(sim(Release(group=G, job="a", request_id=rid, epoch=1)), Dequeued)
    assert (d.job, d.request_id) == ("a", rid)
    assert notices(sim.result(restore)) == []  # the switch finishes without a grant
    assert sim.rec.holder is None


def test_a_job_cannot_cancel_another_jobs_request() -> None:
    sim = Sim()
    g = sim.hold("a")
    rid_b = sim.rid("b")
    sim.acquire("b", rid_b)
    assert notices(sim(Cancel(group=G, job="c", request_id=g.request_id))) == []
    assert notices(sim(Cancel(group=G, job="c", request_id=rid_b))) == []
    assert sim.rec.holder is not None and sim.rec.holder.job == "a" and [w.job for w in sim.rec.queue] == ["b"]


def test_incoming_job_registering_on_a_new_node_mid_restore_is_restored_there_too() -> None:
    sim = Sim()
    sim.register("a", "n1")
    (r1,) = commands(sim.acquire("a"))
    (r2,) = commands(sim.register("a", "n2"))
    assert isinstance(r2, Restore) and (r2.job, r2.node, r2.epoch) == ("a", "n2", 1) and r2.op_id != r1.op_id
    assert notices(sim.result(r1)) == []  # not granted while n2 is still restoring
    (g,) = notices(sim.result(r2), Granted)
    assert g.context_restored and sim.rec.loaded == {"n1": "a", "n2": "a"}


def test_clearing_the_incoming_jobs_fault_mid_switch_does_not_grant_it() -> None:
    sim = Sim()
    sim.register("a", "n1")
    sim.register("a", "n2")
    r1, r2 = commands(sim.acquire("a"))
    (r,) = notices(sim.result(r1, ok=False), Refused)  # told at once, not when the switch ends
    assert (r.job, r.code) == ("a", ErrorCode.JOB_FAULTED)
    sim(ClearFault(group=G, job="a"))
    assert notices(sim.result(r2)) == [], "a restore failed on n1: no grant for this request"
    assert sim.rec.holder is None and sim.rec.state is GroupState.IDLE


def test_job_leaving_mid_snapshot_ends_the_operation_without_faulting_it() -> None:
    """A job whose process ends while it is being snapshotted leaves nothing to save: the switch goes on and
    the job is not faulted (it may register again and must not need a clear-fault first)."""
    sim, snap, restore = Sim.a_releasing_to_b()
    assert (restore.job, restore.node) == ("b", "n1")
    assert commands(sim(JobUnregistered(group=G, job="a", node="n1"))) == []
    assert sim.rec.faulted == {} and "a" not in sim.rec.saved and "a" not in sim.rec.placements
    (g,) = notices(sim.result(restore), Granted)
    assert g.job == "b"
    # Its late answer is fenced off; when it comes back it registers and acquires like any job.
    before = sim.rec
    sim.result(snap, ok=False)
    assert sim.rec is before
    sim.register("a", "n1")
    assert notices(sim.acquire("a")) == [Contended(group=G, job="b", epoch=2, waiters=1)]
    assert [w.job for w in sim.rec.queue] == ["a"]


def test_waiter_leaving_mid_switch_lets_its_issued_restore_finish_without_a_grant() -> None:
    """The restore goes out with the snapshot; if the waiter then leaves, the restore still completes (the
    agent may be running it) and the context counts as loaded there; the next switch snapshots it."""
    sim = Sim()
    for job in ("a", "b", "c"):
        sim.register(job, "n1")
    sim.hold("a")
    rb = sim.rid("b")
    sim.acquire("b", rb, timeout_ms=60_000, waiter_ttl_ms=600_000)
    snap, restore = commands(sim.release("a"))
    (d,) = notices(sim(Cancel(group=G, job="b", request_id=rb)), Dequeued)
    assert d.job == "b" and sim.rec.switch is not None and sim.rec.switch.to is None
    sim.result(snap)
    assert notices(sim.result(restore)) == []
    assert sim.rec.switch is None and sim.rec.holder is None and sim.rec.loaded == {"n1": "b"}
    assert sim.rec.saved == {"a": ("n1",)}
    snap_b, restore_c = commands(sim.acquire("c"))
    assert (snap_b.job, restore_c.job, restore_c.after) == ("b", "c", (snap_b.op_id,))  # type: ignore[union-attr]


def _one_node_switch(
    out: str = "a", incoming: str = "b", **acquire: Any
) -> tuple[Sim, Snapshot | Restore, Snapshot | Restore]:
    """Jobs a and b registered on n1; ``out`` holds, ``incoming`` waits, ``out`` releases: the switch's snapshot
    and restore (queued after it on n1)."""
    sim = Sim()
    for job in ("a", "b"):
        sim.register(job, "n1")
    sim.hold(out)
    sim.acquire(incoming, **acquire)
    snap, restore = commands(sim.release(out))
    return sim, snap, restore


def test_agent_lost_while_a_restore_waits_behind_a_snapshot_there() -> None:
    """A restore queued behind a snapshot on a node whose agent is then lost never started: nothing of its job is
    saved there, so the job is not faulted. It is granted (nothing restored) once the snapshot before it is known,
    here at the snapshot's deadline, which faults the outgoing job."""
    sim, _snap, restore = _one_node_switch(timeout_ms=60_000, waiter_ttl_ms=600_000)
    assert notices(sim(AgentLost(group=G, node="n1")), Granted) == []
    assert "b" not in sim.rec.faulted and "a" not in sim.rec.faulted
    (g,) = notices(sim.tick(dt=10_000), Granted)
    assert g.job == "b" and not g.context_restored
    assert "b" not in sim.rec.faulted and "timed out" in sim.rec.faulted["a"]
    before = sim.rec
    sim.result(restore)  # a late answer is fenced off
    assert sim.rec is before


def test_an_agent_announcing_a_job_mid_switch_is_sent_its_pending_operations_again() -> None:
    """A restarted agent announces its jobs and has forgotten the commands it had taken: the switch's operations
    still pending for the announced job on that node go out again, unchanged (the restore still after the
    snapshot pending there), and the switch ends with the answers to them as usual."""
    sim, snap, restore = _one_node_switch()
    assert isinstance(snap, Snapshot) and isinstance(restore, Restore) and restore.after == (snap.op_id,)
    assert commands(sim.register("a", "n1")) == [snap]
    assert commands(sim.register("b", "n1")) == [restore]
    assert commands(sim.register("a", "n2")) == []  # a node with nothing pending for the job
    sim.result(snap, ok=False)  # the restarted agent recovered a as FAULTED: its snapshot fails
    assert commands(sim.register("b", "n1")) == [msgspec.structs.replace(restore, after=())]  # nothing before it
    (g,) = notices(sim.result(restore), Granted)
    assert g.job == "b" and "b" not in sim.rec.faulted and "a" in sim.rec.faulted
    assert commands(sim.register("b", "n1")) == []  # no switch: nothing to send


def test_agent_lost_while_a_restore_waits_there_faults_a_job_whose_context_is_saved_there() -> None:
    sim, snap, restore = _one_node_switch("b", "a")
    sim.result(snap)
    sim.result(restore)  # a holds; b's context is saved on n1
    sim.renew("a")
    sim.acquire("b")
    snap, restore = commands(sim.release("a"))
    assert sim.rec.saved == {"b": ("n1",)}
    (r,) = notices(sim(AgentLost(group=G, node="n1")), Refused)
    assert r.job == "b" and r.code is ErrorCode.JOB_FAULTED and "saved on node n1" in r.message
    assert sim.rec.holder is None and sim.rec.switch is not None and sim.rec.switch.to is None
    sim.tick(dt=10_000)  # a's snapshot is still pending (its state there is unknown) until its deadline
    assert sim.rec.holder is None and sim.rec.switch is None


def _claim(sim: Sim, job: str, epoch: int) -> Acquire:
    return Acquire(group=G, job=job, request_id=sim.rid(job), timeout_ms=0, claim_epoch=epoch)


def test_a_claim_after_an_unwaited_release_is_granted_at_the_claimed_epoch() -> None:
    sim = Sim()
    sim.register("a", "n1")
    first = sim.hold("a")
    (rel,) = notices(sim.release("a"), Released)
    assert rel.pending_waiters == 0
    sim.tick(dt=400_000)  # non-job events may come in between: time, agents, cleared faults
    sim(ClearFault(group=G, job="b"))
    sim.register("a", "n2")
    ev = _claim(sim, "a", first.epoch + 1)
    actions = sim(ev)
    (g,) = notices(actions, Granted)
    assert (g.job, g.epoch, g.request_id, g.waited_ms, g.context_restored) == (
        "a",
        first.epoch + 1,
        ev.request_id,
        0,
        False,
    )
    assert commands(actions) == [] and sim.rec.holder is not None and not sim.rec.holder.confirmed


def test_a_claim_the_core_cannot_honour_is_refused_and_revoked() -> None:
    """Unreachable through the stream's sequence check; should it happen, the claimed hold is revoked."""
    sim = Sim()
    first = sim.hold("a")
    sim.release("a")
    sim.acquire("b")  # a request in between: the stream would have refused a's claim
    ev = _claim(sim, "a", first.epoch + 1)
    actions = sim(ev)
    (ref,) = notices(actions, Refused)
    (rev,) = notices(actions, Revoked)
    assert ref.request_id == ev.request_id and ref.code is ErrorCode.INVALID and "not honoured" in ref.message
    assert (rev.job, rev.epoch) == ("a", first.epoch + 1) and "holds the group" in rev.reason
    assert sim.rec.holder is not None and sim.rec.holder.job == "b"
    assert notices(actions, Granted) == [] and [w.job for w in sim.rec.queue] == []
    sim.release("b")
    (rev2,) = notices(sim(_claim(sim, "a", sim.rec.epoch + 1)), Revoked)
    assert "the active job is 'b'" in rev2.reason
    sim2 = Sim()
    g = sim2.hold("a")
    sim2.release("a")
    (rev3,) = notices(sim2(_claim(sim2, "a", g.epoch)), Revoked)  # not the next epoch
    assert "the next epoch is" in rev3.reason
