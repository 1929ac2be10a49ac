"""``check_record`` and ``StreamChecker`` do fail on broken input (and accept real streams)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from timeslice_client.protocol import (
    Acquire,
    ClearFault,
    Granted,
    GroupRecord,
    GroupState,
    HolderRecord,
    Notice,
    OpKind,
    Released,
    Revoked,
    SwitchRecord,
    encode,
    subjects,
)
from timeslice_orchestrator.invariants import InvariantViolation, StreamChecker, check_record

from .core_sim import T0, G, Sim, grant_notice
from .op_messages import AgentOp

# --------------------------------------------------------------------------- the checkers can fail


def _locked_record() -> GroupRecord:
    sim = Sim()
    sim.register("a", "n1")
    sim.register("b", "n1")
    sim.hold("a")
    sim.acquire("b")
    return sim.rec


def _holder(rec: GroupRecord, **kw: Any) -> HolderRecord:
    assert rec.holder is not None
    return msgspec.structs.replace(rec.holder, **kw)


BROKEN: dict[str, Any] = {
    "state": lambda r: msgspec.structs.replace(r, state=GroupState.IDLE),
    "holder-active": lambda r: msgspec.structs.replace(r, active_job="b"),
    "holder-epoch": lambda r: msgspec.structs.replace(r, epoch=r.epoch + 1),
    "holder-queued": lambda r: msgspec.structs.replace(r, holder=_holder(r, job="b"), active_job="b"),
    "holder-faulted": lambda r: msgspec.structs.replace(r, faulted={"a": "x"}),
    "queue-unique-job": lambda r: msgspec.structs.replace(r, queue=r.queue + r.queue),
    "queue-faulted": lambda r: msgspec.structs.replace(r, faulted={"b": "x"}),
    "loaded-exclusive": lambda r: msgspec.structs.replace(r, loaded={"n1": "b"}),
    "loaded-placed": lambda r: msgspec.structs.replace(r, loaded={"n9": "a"}),
    "idle-with-waiters": lambda r: msgspec.structs.replace(r, holder=None, state=GroupState.IDLE_YIELDED),
    "op-timeouts": lambda r: msgspec.structs.replace(r, op_timeouts={}),
    "holder-switch": lambda r: msgspec.structs.replace(
        r, switch=SwitchRecord(to=None, epoch=r.epoch, phase=OpKind.SNAPSHOT, started_at_ms=0)
    ),
}


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_check_record_catches(rule: str) -> None:
    good = _locked_record()
    check_record(good)
    with pytest.raises(InvariantViolation) as info:
        check_record(BROKEN[rule](good))
    assert info.value.rule == rule
    assert info.value.group == G and rule in str(info.value)


def test_check_record_catches_a_stuck_switch() -> None:
    (waiter,) = _locked_record().queue  # b, switched to below
    rec = GroupRecord(
        group=G,
        epoch=1,
        state=GroupState.SWITCHING,
        switch=SwitchRecord(to=waiter, epoch=1, phase=OpKind.SNAPSHOT, started_at_ms=0),
    )
    with pytest.raises(InvariantViolation, match="switch-stuck"):
        check_record(rec)


def _scenario() -> Sim:
    """A stream with a switch, a failed snapshot, a revocation, a re-acquire and a zero-cost grant."""
    sim, snap, restore = Sim.a_releasing_to_b()
    sim.result(snap, ok=False)
    sim.result(restore)
    sim.acquire("b")  # re-acquire by the holder
    sim(ClearFault(group=G, job="a"))
    sim.acquire("a", timeout_ms=600_000, waiter_ttl_ms=600_000)
    g = sim.settle(sim.tick(dt=40_000))  # b never renewed: revoked; a gets the group
    assert g.job == "a"
    sim.renew("a")
    sim.release("a")
    sim.acquire("a", dt=5)  # zero cost
    return sim


def test_stream_checker_accepts_a_real_stream_with_duplicates_and_junk() -> None:
    sim = _scenario()
    checker = StreamChecker()
    for seq, now, subject, data in sim.stream:
        checker.feed(seq, now, subject, data)
        checker.feed(seq, now, subject, data)
    n = len(sim.stream)
    checker.feed(n + 1, sim.now, subjects.job(G, "a", "acquire"), b"not json")
    checker.feed(n + 2, sim.now, subjects.job(G, "a", "acquire"), encode(Acquire(group=G, job="b", request_id="x")))
    checker.feed(
        n + 3,
        sim.now,
        subjects.job(G, "a", "acquire"),
        b'{"type":"acquire","group":"g","job":"a","request_id":"r","surprise":1}',
    )
    checker.feed(n + 4, sim.now, "ts.v1.unknown.subject", b"whatever")
    assert checker.rejected == 3 and checker.duplicates == n and checker.ignored >= 1
    assert msgspec.structs.replace(checker.records[G], last_seq=0) == msgspec.structs.replace(sim.rec, last_seq=0)
    st_ = checker.stats[G]
    assert (st_.grants, st_.max_epoch, st_.revocations, st_.releases) == (4, 4, 1, 2)
    assert st_.repeated_grants == 1 and st_.holder == ("a", 4)
    assert checker.unpublished_grants() == []


def test_stream_checker_accepts_grants_reissued_after_a_crash() -> None:
    sim = _scenario()
    grants = [(s, t, subj, d) for s, t, subj, d in sim.stream if subj.startswith("ts.v1.notice.") and b'"granted"' in d]
    checker = StreamChecker()
    checker.feed_all(sim.stream)
    n = len(sim.stream)
    for i, (_, t, subj, d) in enumerate(grants):  # a restarted orchestrator re-publishes old grants
        checker.feed(n + 1 + i, t, subj, d)
    assert checker.stats[G].repeated_grants == 1 + len(grants)


def test_stream_checker_starts_from_stored_records() -> None:
    sim = _scenario()
    cut = len(sim.stream) // 2
    fold = StreamChecker()
    fold.feed_all(sim.stream[:cut])
    checker = StreamChecker(records=fold.records)
    checker.feed_all(sim.stream[cut:])
    assert msgspec.structs.replace(checker.records[G], last_seq=0) == msgspec.structs.replace(sim.rec, last_seq=0)


def _tampered(edit: Any) -> list[tuple[int, int, str, bytes]]:
    """The scenario's stream with one published notice replaced (or dropped) by ``edit``."""
    out = []
    for seq, now, subject, data in _scenario().stream:
        msg = (seq, now, subject, data)
        if subject.startswith("ts.v1.notice."):
            n = msgspec.json.decode(data, type=Notice)  # type: ignore[arg-type]
            changed = edit(n)
            if changed is None:
                continue
            if changed is not n:
                msg = (seq, now, subjects.notice(changed.group, changed.job), encode(changed))
        out.append(msg)
    return out


TAMPER: dict[str, Any] = {
    # A grant the core never decided: a different epoch.
    "grant-agrees-with-fold": lambda n: (
        msgspec.structs.replace(n, epoch=n.epoch + 10) if isinstance(n, Granted) and n.epoch == 2 else n
    ),
    # The revocation of b is never published, so a's grant overlaps it.
    "grant-exclusive": lambda n: None if isinstance(n, Revoked) else n,
    # A release for a grant that never happened.
    "notice-end-unknown": lambda n: msgspec.structs.replace(n, epoch=99) if isinstance(n, Released) else n,
}


@pytest.mark.parametrize("rule", sorted(TAMPER))
def test_stream_checker_catches(rule: str) -> None:
    with pytest.raises(InvariantViolation) as info:
        StreamChecker().feed_all(_tampered(TAMPER[rule]))
    assert info.value.rule == rule and info.value.seq is not None


def _granted(job: str, epoch: int) -> Granted:
    return grant_notice(job, epoch, f"{job}@{epoch}")


def _notices_only(*ns: Notice) -> StreamChecker:
    """A checker fed only notices, with the fold's decisions injected so that only the notice rules act."""
    checker = StreamChecker()
    view = checker._view(G)
    for n in ns:
        if isinstance(n, Granted):
            view.decided.setdefault((n.job, n.epoch), set()).add(n.request_id)
    for i, n in enumerate(ns, 1):
        checker.feed(i, T0, subjects.notice(G, n.job), encode(n))
    return checker


def test_stream_checker_notice_rules() -> None:
    released = Released(group=G, job="c", request_id="c@5", epoch=5, pending_waiters=0, snapshot_deferred=True)
    ok = _notices_only(_granted("c", 5), released, _granted("c", 5), _granted("d", 6))
    assert ok.stats[G].grants == 2 and ok.stats[G].repeated_grants == 1
    with pytest.raises(InvariantViolation, match="grant-epoch-rising"):
        _notices_only(_granted("c", 5), released, _granted("d", 3))
    with pytest.raises(InvariantViolation, match="grant-epoch-unique"):
        _notices_only(_granted("c", 5), released, _granted("d", 5))
    with pytest.raises(InvariantViolation, match="grant-exclusive"):
        _notices_only(_granted("c", 5), _granted("d", 6))
    lax = StreamChecker(check_order=False)
    lax._view(G).decided.update({("c", 5): {"c@5"}, ("d", 6): {"d@6"}})
    lax.feed(1, T0, subjects.notice(G, "c"), encode(_granted("c", 5)))
    lax.feed(2, T0, subjects.notice(G, "d"), encode(_granted("d", 6)))  # allowed without order checking


def test_stream_checker_rejects_a_grant_the_core_never_decided() -> None:
    sim = _scenario()
    checker = StreamChecker()
    checker.feed_all(sim.stream)
    with pytest.raises(InvariantViolation, match="grant-agrees-with-fold"):
        checker.feed(len(sim.stream) + 1, sim.now, subjects.notice(G, "c"), encode(_granted("c", 2)))


def test_stream_checker_catches_a_notice_on_the_wrong_subject() -> None:
    sim = _scenario()
    checker = StreamChecker()
    g = grant_notice("a", 1, "r")
    with pytest.raises(InvariantViolation, match="notice-subject"):
        checker.feed(1, sim.now, subjects.notice(G, "b"), encode(g))


def _op_events(order: list[tuple[str, str, str]]) -> list[tuple[int, int, str, bytes]]:
    """A switch of a (snapshot) to b (restore) on the nodes given, its agent events in the order given:
    (node, kind, "start"|"end")."""
    sim = Sim()
    sim.register("a", "n1")
    sim.register("b", "n1")
    sim.register("b", "n2")
    sim.hold("a")
    sim.acquire("b")
    sim.release("a")
    out = list(sim.stream)
    seq, now = len(out), sim.now
    epoch = sim.rec.epoch
    for node, kind, edge in order:
        seq += 1
        job = "a" if kind == "snapshot" else "b"
        op = AgentOp(G, f"{G}:{epoch}:{kind}:{node}", node, job, OpKind(kind), epoch)
        if edge in ("start", "start-overlapped"):
            out.append((seq, now, subjects.agent_op(node), encode(op.started(overlapped=edge == "start-overlapped"))))
        else:
            out.append((seq, now, subjects.agent_event(node, G), encode(op.result())))
    return out


def test_stream_checker_catches_a_restore_started_beside_a_running_snapshot_on_its_node() -> None:
    good = _op_events(
        [
            ("n1", "snapshot", "start"),
            ("n2", "restore", "start"),
            ("n1", "snapshot", "end"),
            ("n1", "restore", "start"),
            ("n2", "restore", "end"),
            ("n1", "restore", "end"),
        ]
    )
    checker = StreamChecker()
    checker.feed_all(good)  # n2 has no snapshot: its restore may run at once
    assert checker.records[G].holder is not None and checker.records[G].holder.job == "b"
    bad = _op_events([("n1", "snapshot", "start"), ("n1", "restore", "start")])
    with pytest.raises(InvariantViolation) as info:
        StreamChecker().feed_all(bad)
    assert info.value.rule == "node-restore-after-snapshot" and info.value.values["snapshots_running"] == [
        f"{G}:2:snapshot:n1"
    ]


def test_stream_checker_admits_a_restore_beside_a_snapshot_run_again_after_it_ended() -> None:
    """A restarted agent runs again a snapshot whose answer it had published but whose settled state it had not
    stored (its command delivered again): the second start moves nothing, the context left the device at the first
    end, and a restore of the switch may start beside it (bench/chaos.py, seed 3: the restore re-sent by the
    orchestrator started 5 events after the snapshot's second start and was reported). A snapshot that never ended
    still holds the restore back."""
    again = _op_events(
        [
            ("n1", "snapshot", "start"),
            ("n1", "snapshot", "end"),
            ("n1", "snapshot", "start"),  # run again after a restart of the agent
            ("n1", "restore", "start"),
            ("n1", "snapshot", "end"),
            ("n1", "restore", "end"),
            ("n2", "restore", "start"),
            ("n2", "restore", "end"),
        ]
    )
    checker = StreamChecker()
    checker.feed_all(again)
    holder = checker.records[G].holder
    assert holder is not None and holder.job == "b"
    with pytest.raises(InvariantViolation, match="restore starts only after"):
        StreamChecker().feed_all(_op_events([("n1", "snapshot", "start"), ("n1", "restore", "start")]))


def test_stream_checker_admits_a_restore_that_says_it_overlapped_and_still_grants_after_all() -> None:
    """An agent with room starts the restore beside the snapshot (``OpStarted.overlapped``); the grant
    still comes only once both ended, whichever ends first."""
    beside = [("n1", "snapshot", "start"), ("n1", "restore", "start-overlapped")]
    n2_restore = [("n2", "restore", "start"), ("n2", "restore", "end")]
    for ended in ("restore", "snapshot"):
        checker = StreamChecker()
        checker.feed_all(_op_events([*n2_restore, *beside, ("n1", ended, "end")]))
        rec = checker.records[G]
        assert rec.holder is None and rec.switch is not None  # one operation is still running: no grant yet
    checker = StreamChecker()
    checker.feed_all(_op_events([*beside, ("n1", "restore", "end"), *n2_restore, ("n1", "snapshot", "end")]))
    holder = checker.records[G].holder
    assert holder is not None and holder.job == "b"


def test_stream_checker_catches_a_claim_not_honoured() -> None:
    sim = Sim()
    first = sim.hold("a")
    sim.release("a")
    sim.acquire("b")  # the stream's sequence check would have refused the claim below
    ok = StreamChecker()
    ok.feed_all(sim.stream)
    claim = Acquire(group=G, job="a", request_id="claim", timeout_ms=0, claim_epoch=first.epoch + 1)
    with pytest.raises(InvariantViolation, match="claim-honoured"):
        ok.feed(len(sim.stream) + 1, sim.now, subjects.job(G, "a", "acquire"), encode(claim))
