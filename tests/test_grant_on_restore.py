"""Grant on restore (``core.py``): while a switch's snapshot of the outgoing job still runs on a node, the incoming job
is granted once its restore is done, only if that restore ran beside the snapshot by the agent's room rule
(``OpResult.overlapped``). The snapshot then trails the grant (``GroupRecord.trailing``) until it ends; no switch
starts meanwhile. The record checks, the stream checker and ``timeslice check`` accept exactly this overlap."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from timeslice_cli._check import check_events
from timeslice_client.protocol import (
    AgentLost,
    Contended,
    ErrorCode,
    Granted,
    GroupRecord,
    GroupState,
    JobRegistered,
    JobUnregistered,
    OpKind,
    OpRecord,
    Refused,
    Released,
    Restore,
    Snapshot,
    SwitchRecord,
    WaiterRecord,
    encode,
    subjects,
)
from timeslice_orchestrator._op_facts import OpFacts
from timeslice_orchestrator.invariants import InvariantViolation, StreamChecker, check_record
from timeslice_orchestrator.replay import StreamEvent

from .core_sim import G, Sim, commands, grant_notice, notices
from .op_messages import AgentOp


def beside_switch(*, a_nodes: tuple[str, ...] = ("n1",)) -> tuple[Sim, list[Snapshot | Restore]]:
    """b ran first (its context is saved on n1), then a (on ``a_nodes``); b waits and a releases: the switch's
    snapshots of a and b's restore on n1 (after a's snapshot there) go out together."""
    sim = Sim()
    for node in a_nodes:
        sim.register("a", node)
    sim.register("b", "n1")
    sim.hold("b")
    sim.acquire("a")
    sim.settle(sim.release("b"))
    sim.renew("a")
    sim.acquire("b")
    return sim, commands(sim.release("a"))


def _split(cmds: list[Snapshot | Restore]) -> tuple[list[Snapshot], Restore]:
    snaps = [c for c in cmds if isinstance(c, Snapshot)]
    (restore,) = [c for c in cmds if isinstance(c, Restore)]
    return snaps, restore


def granted_on_restore() -> tuple[Sim, Snapshot]:
    """b granted on its restore beside a's snapshot on n1, which still runs; b confirmed its grant."""
    sim, cmds = beside_switch()
    (snap,), restore = _split(cmds)
    (g,) = notices(sim.result(restore, overlapped=True), Granted)
    assert g.job == "b"
    sim.renew("b")
    return sim, snap


# --------------------------------------------------------------------------- the core


def test_the_incoming_job_is_granted_on_its_restore_only_when_that_ran_beside_the_snapshot() -> None:
    sim, cmds = beside_switch()
    (snap,), restore = _split(cmds)
    assert restore.after == (snap.op_id,)
    epoch = sim.rec.epoch
    (g,) = notices(sim.result(restore, overlapped=True), Granted)
    assert (g.job, g.epoch, g.context_restored) == ("b", epoch, True)
    rec = sim.rec
    assert rec.state is GroupState.LOCKED and rec.switch is None and rec.holder is not None
    assert rec.trailing is not None and rec.trailing.epoch == epoch
    assert [(op.op_id, op.job, op.kind) for op in rec.trailing.ops] == [(snap.op_id, "a", OpKind.SNAPSHOT)]
    assert rec.loaded == {"n1": "b"} and rec.active_job == "b"
    actions = sim.result(snap)  # the trailing snapshot ends: a's state is saved, b holds on
    assert notices(actions) == [] and commands(actions) == []
    rec = sim.rec
    assert rec.trailing is None and rec.saved == {"a": ("n1",)} and not rec.faulted
    assert rec.holder is not None and rec.holder.job == "b" and rec.holder.epoch == epoch

    # The same switch, but the restore did not say it ran beside (an older agent; or the room rule said no, and
    # it ran after the snapshot): the order stays snapshot, restore, grant.
    sim, cmds = beside_switch()
    (snap,), restore = _split(cmds)
    assert notices(sim.result(restore), Granted) == []
    assert sim.rec.holder is None and sim.rec.switch is not None and sim.rec.trailing is None
    assert [op.op_id for op in sim.rec.switch.ops] == [snap.op_id]
    (g,) = notices(sim.result(snap), Granted)
    assert g.job == "b" and sim.rec.trailing is None


def test_every_snapshot_still_running_must_have_the_grantees_restore_beside_it() -> None:
    """a runs on n1 and n3, b only on n1: b's restore beside a's snapshot on n1 does not cover a's snapshot on n3,
    where b has no restore. Nor does a failed restore that ran beside."""
    sim, cmds = beside_switch(a_nodes=("n1", "n3"))
    snaps, restore = _split(cmds)
    by_node = {s.node: s for s in snaps}
    assert sorted(by_node) == ["n1", "n3"]
    assert notices(sim.result(restore, overlapped=True), Granted) == []
    assert sim.rec.holder is None and sim.rec.switch is not None and sim.rec.switch.beside == ("n1",)
    (g,) = notices(sim.result(by_node["n3"]), Granted)  # only the snapshot beside b's restore is left
    assert g.job == "b"
    assert sim.rec.trailing is not None and [op.node for op in sim.rec.trailing.ops] == ["n1"]

    sim, cmds = beside_switch()
    _, restore = _split(cmds)
    (r,) = notices(sim.result(restore, ok=False, overlapped=True), Refused)
    assert r.code is ErrorCode.JOB_FAULTED and sim.rec.holder is None and sim.rec.trailing is None


def test_a_failed_trailing_snapshot_faults_the_outgoing_job_and_the_holder_keeps_the_group() -> None:
    """The snapshot was rolled back: a's context stays on the device beside b's, but a is faulted (refused until
    its fault is cleared), so only b, the holder, runs."""
    sim, snap = granted_on_restore()
    assert notices(sim.result(snap, ok=False)) == []
    rec = sim.rec
    assert rec.faulted == {"a": "backend said no"} and rec.trailing is None
    assert rec.holder is not None and rec.holder.job == "b" and rec.loaded == {"n1": "b"}
    assert "a" not in rec.saved and rec.state is GroupState.LOCKED
    (r,) = notices(sim.acquire("a"), Refused)
    assert r.code is ErrorCode.JOB_FAULTED


def test_a_trailing_snapshot_is_sent_again_while_unanswered_and_times_out_at_its_deadline() -> None:
    sim, snap = granted_on_restore()
    tr = sim.rec.trailing
    assert tr is not None
    op = tr.ops[0]
    (again,) = commands(sim.tick(dt=op.resend_at_ms - sim.now))
    assert again == snap  # unchanged: same op id, epoch and deadline
    sim.renew("b")
    assert notices(sim.tick(dt=op.deadline_ms - sim.now)) == []
    rec = sim.rec
    assert rec.trailing is None and "timed out" in rec.faulted["a"]
    assert rec.holder is not None and rec.holder.job == "b"


def test_no_switch_starts_while_a_snapshot_trails() -> None:
    """c waits and b releases while a's snapshot still runs on n1: c's restore there would be a third context, so
    its switch starts only once that snapshot ended (the group is SWITCHING meanwhile)."""
    sim, snap = granted_on_restore()
    sim.register("c", "n1")
    assert notices(sim.acquire("c"), Contended)
    actions = sim.release("b")
    (rel,) = notices(actions, Released)
    assert rel.pending_waiters == 1 and commands(actions) == []
    rec = sim.rec
    assert rec.state is GroupState.SWITCHING and rec.switch is None and [w.job for w in rec.queue] == ["c"]
    cmds = commands(sim.result(snap))
    assert sorted((type(c).__name__, c.job) for c in cmds) == [("Restore", "c"), ("Snapshot", "b")]
    (restore,) = [c for c in cmds if isinstance(c, Restore)]
    (snap_b,) = [c for c in cmds if isinstance(c, Snapshot)]
    assert restore.after == (snap_b.op_id,) and snap_b.epoch == restore.epoch == snap.epoch + 1


def test_the_holder_reacquires_while_a_snapshot_trails_and_that_snapshot_still_counts_at_its_epoch() -> None:
    sim, snap = granted_on_restore()
    sim.release("b")
    assert sim.rec.state is GroupState.IDLE_YIELDED and sim.rec.trailing is not None
    (g,) = notices(sim.acquire("b"), Granted)  # zero cost: b's context never left
    assert g.epoch == snap.epoch + 1
    sim.result(snap)
    assert sim.rec.trailing is None and sim.rec.saved == {"a": ("n1",)}


def test_an_agent_lost_while_a_snapshot_trails_ends_nothing_and_its_successor_is_sent_the_snapshot_again() -> None:
    sim, snap = granted_on_restore()
    sim(AgentLost(group=G, node="n1"))
    rec = sim.rec
    assert rec.trailing is not None and rec.holder is not None and rec.holder.job == "b"
    assert "a" not in rec.faulted and rec.placements["a"] == ("n1",)
    (again,) = commands(sim(JobRegistered(group=G, job="a", node="n1", op_timeout_ms=10_000)))
    assert again == snap
    sim(JobRegistered(group=G, job="b", node="n1", op_timeout_ms=10_000))
    assert sim.rec.loaded == {"n1": "b"}
    sim.result(snap)
    assert sim.rec.trailing is None and not sim.rec.faulted


def test_the_outgoing_job_leaving_the_node_ends_its_trailing_snapshot_without_a_fault() -> None:
    sim, _ = granted_on_restore()
    sim(JobUnregistered(group=G, job="a", node="n1"))
    rec = sim.rec
    assert rec.trailing is None and "a" not in rec.faulted and "a" not in rec.placements
    assert rec.holder is not None and rec.holder.job == "b"


# --------------------------------------------------------------------------- the record checks


def _trailing_record(*, released: bool = False) -> GroupRecord:
    sim, _ = granted_on_restore()
    if released:
        sim.release("b")
    return sim.rec


def _op(rec: GroupRecord, **kw: Any) -> tuple[OpRecord, ...]:
    assert rec.trailing is not None
    return (msgspec.structs.replace(rec.trailing.ops[0], **kw),)


def _trail(rec: GroupRecord, **kw: Any) -> GroupRecord:
    assert rec.trailing is not None
    return msgspec.structs.replace(rec, trailing=msgspec.structs.replace(rec.trailing, **kw))


def _switching(rec: GroupRecord) -> GroupRecord:
    to = WaiterRecord(
        job="b",
        request_id="r",
        enqueued_at_ms=0,
        deadline_ms=2**40,
        alive_until_ms=2**40,
        lease_ms=30_000,
        waiter_ttl_ms=5_000,
        confirm_ms=3_000,
    )
    ops = _op(rec, op_id="other")
    return msgspec.structs.replace(
        rec,
        state=GroupState.SWITCHING,
        switch=SwitchRecord(to=to, epoch=rec.epoch, phase=OpKind.SNAPSHOT, started_at_ms=0, ops=ops),
    )


BROKEN: dict[str, Any] = {
    "trailing-switch": lambda: _switching(_trailing_record(released=True)),
    "trailing-ops": lambda: _trail(r := _trailing_record(), epoch=r.epoch + 1),
    "trailing-one-per-node": lambda: _trail(r := _trailing_record(), ops=r.trailing.ops * 2),  # type: ignore[union-attr]
    "trailing-snapshots": lambda: _trail(r := _trailing_record(), ops=_op(r, kind=OpKind.RESTORE)),
    "trailing-beside": lambda: _trail(r := _trailing_record(), ops=_op(r, job="b")),
    "trailing-placed": lambda: msgspec.structs.replace(
        r := _trailing_record(), placements={"b": r.placements["b"]}, op_timeouts={"n1/b": 10_000}
    ),
}


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_check_record_allows_no_other_trailing_snapshot(rule: str) -> None:
    check_record(_trailing_record())
    check_record(_trailing_record(released=True))
    with pytest.raises(InvariantViolation) as info:
        check_record(BROKEN[rule]())
    assert info.value.rule == rule


# --------------------------------------------------------------------------- the stream checks


def _started(sim: Sim, cmd: Snapshot | Restore, *, overlapped: bool = False) -> None:
    started = AgentOp.of(cmd).started(backend="app_channel", overlapped=overlapped)
    sim.publish(subjects.agent_op(cmd.node), encode(started))


def _inject_grant(sim: Sim, job: str, epoch: int) -> None:
    g = grant_notice(job, epoch, f"{job}-forged", restored=True)
    sim.publish(subjects.notice(G, job), encode(g))


def _events(sim: Sim) -> list[StreamEvent]:
    return [StreamEvent(q, ms, subj, data) for q, ms, subj, data in sim.stream]


def _agent_switch() -> tuple[Sim, Snapshot, Restore]:
    """``beside_switch`` with the agent's facts: a's snapshot started, b's restore started beside it."""
    sim, cmds = beside_switch()
    (snap,), restore = _split(cmds)
    _started(sim, snap)
    _started(sim, restore, overlapped=True)
    return sim, snap, restore


def test_the_checkers_accept_a_grant_on_a_restore_beside_the_snapshot_and_nothing_more() -> None:
    sim, snap, restore = _agent_switch()
    sim.result(restore, overlapped=True)  # granted: a's snapshot trails
    sim.renew("b")
    sim.result(snap)
    checker = StreamChecker()
    checker.feed_all(sim.stream)
    assert checker.records[G].holder is not None and checker.records[G].holder.job == "b"
    assert check_events(_events(sim)).violations == []

    # A grant while the snapshot runs, with a restore that did not say it ran beside: reported by both.
    sim, snap, restore = _agent_switch()
    sim.result(restore)
    _inject_grant(sim, "b", snap.epoch)
    report = check_events(_events(sim))
    kinds = {str(v.kind) for v in report.violations}
    rules = {r for v in report.violations for r in v.rules}
    assert "grant-while-loaded" in kinds and "grant-agrees-with-fold" in rules, report.violations


def test_a_grant_to_another_job_while_the_snapshot_trails_is_a_grant_while_loaded() -> None:
    sim, snap, restore = _agent_switch()
    sim.result(restore, overlapped=True)
    sim.renew("b")
    sim.release("b")
    _inject_grant(sim, "c", snap.epoch + 1)
    report = check_events(_events(sim))
    loaded = [v for v in report.violations if str(v.kind) == "grant-while-loaded"]
    assert loaded and loaded[0].jobs == ("a", "c"), report.violations


def test_a_restore_starting_where_a_snapshot_trails_is_a_third_context() -> None:
    sim, snap, restore = _agent_switch()
    sim.result(restore, overlapped=True)
    sim.register("c", "n1")
    third = Restore(
        op_id=f"{G}:{snap.epoch + 1}:restore:n1", group=G, job="c", node="n1", epoch=snap.epoch + 1, deadline_ms=2**40
    )
    _started(sim, third, overlapped=True)
    with pytest.raises(InvariantViolation) as info:
        StreamChecker().feed_all(sim.stream)
    assert info.value.rule == "restore-after-trailing" and info.value.values["snapshots_running"] == [snap.op_id]


def test_op_facts_admit_a_grant_beside_a_running_snapshot_only_after_the_grantees_restore_beside_it() -> None:
    sim, cmds = beside_switch()
    (snap,), restore = _split(cmds)
    facts = OpFacts()
    assert (snap.job, snap.node, restore.job, restore.node, restore.epoch) == ("a", "n1", "b", "n1", snap.epoch)
    facts.started(AgentOp.of(snap).started(), 1, sim.rec)
    grant = grant_notice("b", snap.epoch, "r", restored=True)
    with pytest.raises(InvariantViolation) as info:
        facts.granted(grant, 2)
    assert info.value.rule == "grant-beside-restore"
    facts.ended(AgentOp.of(restore).result(overlapped=True))
    facts.granted(grant, 3)  # beside b's restore: a grant on restore
    with pytest.raises(InvariantViolation):
        facts.granted(msgspec.structs.replace(grant, job="c", epoch=snap.epoch + 1), 4)  # nobody else


def _started_after_result(sim: Sim, snap: Snapshot, restore: Restore) -> None:
    """``snap``'s OpStarted placed right after ``restore``'s OpResult, before the grant that result decided (as a
    ten-minute chaos run showed 17 times: the agent starts both operations at once, and the snapshot's start was
    published after the restore beside it had ended)."""
    result = subjects.agent_event(restore.node, G)
    at = next(
        i
        for i, (_, _, subject, data) in enumerate(sim.stream)
        if subject == result and msgspec.json.decode(data).get("op_id") == restore.op_id
    )
    _started(sim, snap)
    moved = sim.stream.pop()
    sim.stream.insert(at + 1, moved)
    sim.stream[:] = [(i + 1, ms, subject, data) for i, (_, ms, subject, data) in enumerate(sim.stream)]


def test_the_checkers_accept_a_grant_on_restore_whose_snapshot_start_is_published_after_the_restore_ended() -> None:
    sim, cmds = beside_switch()
    (snap,), restore = _split(cmds)
    _started(sim, restore, overlapped=True)
    sim.result(restore, overlapped=True)  # granted: a's snapshot trails
    _started_after_result(sim, snap, restore)
    sim.renew("b")
    sim.release("b")
    sim.acquire("b")  # the holder's next grant, while a's snapshot still trails
    assert sim.rec.holder is not None and sim.rec.holder.epoch == snap.epoch + 1
    sim.result(snap)
    StreamChecker().feed_all(sim.stream)
    assert check_events(_events(sim)).violations == []


def test_a_grant_to_another_job_while_a_late_started_snapshot_trails_is_still_reported() -> None:
    sim, cmds = beside_switch()
    (snap,), restore = _split(cmds)
    _started(sim, restore, overlapped=True)
    sim.result(restore, overlapped=True)
    _started_after_result(sim, snap, restore)
    sim.renew("b")
    sim.release("b")
    _inject_grant(sim, "c", snap.epoch + 1)
    loaded = [v for v in check_events(_events(sim)).violations if str(v.kind) == "grant-while-loaded"]
    assert loaded and loaded[0].jobs == ("a", "c"), loaded
    with pytest.raises(InvariantViolation) as info:
        StreamChecker().feed_all(sim.stream)
    assert info.value.rule in {"grant-beside-restore", "grant-agrees-with-fold"}, info.value


def test_the_checkers_accept_a_grant_on_restore_whose_snapshot_a_restarted_agent_begins_again() -> None:
    sim, snap, restore = _agent_switch()
    sim.result(restore, overlapped=True)  # granted: a's snapshot trails
    sim.renew("b")
    sim(AgentLost(group=G, node="n1"))
    (again,) = commands(sim(JobRegistered(group=G, job="a", node="n1", op_timeout_ms=10_000)))
    sim(JobRegistered(group=G, job="b", node="n1", op_timeout_ms=10_000))
    _started(sim, again)  # the restarted agent begins the same snapshot
    sim.release("b")
    sim.acquire("b")
    assert sim.rec.holder is not None and sim.rec.holder.epoch == snap.epoch + 1
    sim.result(again)
    StreamChecker().feed_all(sim.stream)
    assert check_events(_events(sim)).violations == []
