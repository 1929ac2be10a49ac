"""The agents' side of the core's state machine test (``test_core_properties.py``): the facts a node agent would
publish (``OpStarted``, and whether a restore ran beside its snapshots), the co-residency rule a grant on restore
must keep, and the end-of-run check of the whole run as a stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from timeslice_client.protocol import (
    GroupRecord,
    InputEvent,
    JobRegistered,
    JobUnregistered,
    OpKind,
    OpRecord,
    OpStarted,
    Tick,
    encode,
    subjects,
)
from timeslice_orchestrator._op_facts import pending_ops
from timeslice_orchestrator.core import Action, apply, new_record
from timeslice_orchestrator.invariants import StreamChecker

from .core_sim import JOBS, SEQ_GAP, G, action_message, input_subject

Message = tuple[str, bytes]


@dataclass
class Step:
    ev: InputEvent
    now: int
    seq: int
    rec: GroupRecord
    actions: list[Action]
    before: list[Message] = field(default_factory=list)  # agents' facts published just before the event
    after: list[Message] = field(default_factory=list)  # and just after its actions


def op_started(op: OpRecord, epoch: int, *, overlapped: bool = False) -> Message:
    return subjects.agent_op(op.node), encode(
        OpStarted(
            op_id=op.op_id,
            group=G,
            job=op.job,
            node=op.node,
            kind=op.kind,
            epoch=epoch,
            backend="noop",
            overlapped=overlapped,
        )
    )


def pending_epoch(rec: GroupRecord) -> int:
    """The epoch of the operations ``rec`` waits for (the trailing snapshots', else the switch's)."""
    if rec.trailing is not None:
        return rec.trailing.epoch
    assert rec.switch is not None
    return rec.switch.epoch


def runs_beside(rec: GroupRecord, op: OpRecord) -> bool:
    """Whether a restore answered now ran beside a snapshot of its switch still pending on its node (an agent that
    answers it before that snapshot ended started it beside, by the room rule)."""
    return op.kind is OpKind.RESTORE and any(o.kind is OpKind.SNAPSHOT and o.node == op.node for o in pending_ops(rec))


def check_contexts(rec: GroupRecord) -> None:
    """At most two jobs' contexts on a node, and two only while a switch moves one off and the other on, or while a
    snapshot trails a grant on restore beside the active job's context; never two jobs running."""
    for node in {*rec.loaded, *(op.node for op in pending_ops(rec))}:
        jobs = {j for j in (rec.loaded.get(node),) if j is not None}
        jobs |= {op.job for op in pending_ops(rec) if op.node == node}
        assert len(jobs) <= 2, f"three contexts on {node}: {jobs} ({rec})"
        if len(jobs) == 2 and rec.trailing is not None:
            (trailing,) = [op.job for op in rec.trailing.ops if op.node == node]
            assert jobs == {trailing, rec.active_job}, (node, jobs, rec)
            assert rec.holder is None or rec.holder.job == rec.active_job, rec
        elif len(jobs) == 2:
            assert rec.switch is not None and rec.holder is None, (node, jobs, rec)


class BesideRules:
    """The state machine's rules that drive grants on restore and what may follow one (``CoreMachine`` has the
    plumbing: ``answer``, ``release``, ``agents``, ...)."""

    rec: GroupRecord
    holder: Any
    entries: dict[str, Any]
    now: int

    @precondition(lambda self: self.rec.trailing is not None)
    @rule(data=st.data(), ok=st.booleans())
    def trailing_result(self, data: st.DataObject, ok: bool) -> None:
        """The answer to a snapshot that trails a grant on restore: done, or failed and rolled back."""
        tr = self.rec.trailing
        assert tr is not None
        self.answer(data.draw(st.sampled_from(tr.ops)), tr.epoch, ok)  # type: ignore[attr-defined]

    @precondition(lambda self: self.holder is not None)
    @rule(data=st.data(), then=st.sampled_from(["fail", "done", "next", "lost", "late", "leave", "nothing"]))
    def handoff_beside(self, data: st.DataObject, then: str) -> None:
        """The holder releases to a (new, patient) waiter and the agents answer the restores first, beside the
        snapshots (a grant on restore where each snapshot has one beside it); then the trailing snapshot fails
        (rolled back), ends, outlives another waiter's arrival and the holder's release, loses its agent, times out,
        or its job leaves."""
        m: Any = self
        if not self.entries:
            m.acquire_patient(data.draw(st.sampled_from([j for j in JOBS if j != self.holder[0]])))
        if self.holder is None:
            return
        m.release()
        for op in [o for o in pending_ops(self.rec) if o.kind is OpKind.RESTORE]:
            if op in pending_ops(self.rec) and self.rec.switch is not None:
                m.answer(op, self.rec.switch.epoch, True)
        tr = self.rec.trailing
        if tr is None:
            return
        op = data.draw(st.sampled_from(tr.ops))
        if then in ("fail", "done"):
            m.answer(op, tr.epoch, then == "done")
        elif then == "next":
            m.acquire_patient(data.draw(st.sampled_from(JOBS)))
            if self.holder is not None:
                m.release()
            if op in pending_ops(self.rec):
                m.answer(op, tr.epoch, True)  # only now may the next switch start
        elif then == "lost":
            m.agents(data, "lost", op.node, 5_000)
            m.step(JobRegistered(group=G, job=op.job, node=op.node, op_timeout_ms=5_000))  # its agent is back
        elif then == "late":
            self.now = max(self.now, op.deadline_ms)
            m.step(Tick(group=G))
        elif then == "leave":
            m.step(JobUnregistered(group=G, job=op.job, node=op.node))


def check_run(steps: list[Step], rec: GroupRecord, grants: int, max_epoch: int, holder: tuple[str, int] | None) -> None:
    """Determinism (the same events give the same records and actions), then the run as a stream, with the agents'
    facts, through :class:`StreamChecker`: its fold agrees with the notices; redeliveries and junk are tolerated."""
    again = new_record(G)
    for s in steps:
        again, actions = apply(again, s.ev, s.now, s.seq)
        assert again == s.rec and actions == s.actions
    stream: list[tuple[int, int, str, bytes]] = []
    junk = 0
    for i, s in enumerate(steps):
        stream += [(s.seq - len(s.before) + k, s.now, *m) for k, m in enumerate(s.before)]
        stream.append((s.seq, s.now, input_subject(s.ev), encode(s.ev)))
        for j, a in enumerate(s.actions, 1):
            stream.append((s.seq + j, s.now, *action_message(G, a)))
        stream += [(s.seq + len(s.actions) + 1 + k, s.now, *m) for k, m in enumerate(s.after)]
        if i % 7 == 3:
            stream.append((s.seq + SEQ_GAP // 2, s.now, subjects.job(G, "a", "acquire"), b'{"type": "acquire"}'))
            stream.append((s.seq + SEQ_GAP // 2 + 1, s.now, "ts.v1.other.thing", b"\x00"))
            junk += 1
    assert [m[0] for m in stream] == sorted({m[0] for m in stream}), "the test's stream is in order"
    checker = StreamChecker()
    for k, msg in enumerate(stream):
        checker.feed(*msg)
        if k % 5 == 0:
            checker.feed(*msg)  # a redelivery
    if not steps:
        return
    got = checker.records[G]
    assert msgspec.structs.replace(got, last_seq=0) == msgspec.structs.replace(rec, last_seq=0)
    stats = checker.stats[G]
    assert (stats.grants, stats.fold_grants, stats.max_epoch) == (grants, grants, max_epoch)
    assert checker.unpublished_grants() == []
    assert checker.rejected == junk
    assert stats.holder == holder
