"""The pure orchestrator core against its invariants.

* A hypothesis state machine drives ``apply()`` with random job, control and agent events (acquire,
  release, renew, cancel, ticks and time jumps, registrations, operation results both fresh and late,
  lost agents) and checks after every event: the record invariants (``check_record``), mutual
  exclusion as the notices tell it, strict FIFO among the waiters still waiting, rising grant
  epochs, no grant to a request that left, no waiter lost without a notice, grants only after every
  restore succeeded, fencing (late or forged operation results change nothing), ``next_deadline``
  (nothing expires before it, something does at it), idempotence and determinism. At the end the
  whole run is encoded as a stream and checked by :class:`StreamChecker`.
* Plain unit tests pin the semantics described in ``core.py``.
* Unit tests show that :func:`check_record` and :class:`StreamChecker` do fail on broken input.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from timeslice_client.protocol import (
    Acquire,
    AgentLost,
    Cancel,
    ClearFault,
    Dequeued,
    ErrorCode,
    Granted,
    GroupRecord,
    GroupState,
    HolderRecord,
    InputEvent,
    JobRegistered,
    JobUnregistered,
    Notice,
    OpKind,
    OpRecord,
    OpResult,
    Phase,
    Refused,
    Release,
    Released,
    Renew,
    Restore,
    Revoked,
    Snapshot,
    SwitchRecord,
    Tick,
    WaiterRecord,
    encode,
    subjects,
)
from timeslice_orchestrator.core import Action, Command, Notify, Transition, apply, new_record, next_deadline
from timeslice_orchestrator.invariants import InvariantViolation, StreamChecker, check_record

G = "g"
JOBS = ("a", "b", "c", "d")
NODES = ("n1", "n2")
T0 = 1_000_000
SEQ_GAP = 100  # the state machine's events are SEQ_GAP apart in the stream


# --------------------------------------------------------------------------- helpers


def notices(actions: list[Action], kind: type[Any] | None = None) -> list[Any]:
    out = [a.notice for a in actions if isinstance(a, Notify)]
    return [n for n in out if kind is None or isinstance(n, kind)]


def commands(actions: list[Action]) -> list[Snapshot | Restore]:
    return [a.command for a in actions if isinstance(a, Command)]


def tag(ev: msgspec.Struct) -> str:
    t = type(ev).__struct_config__.tag
    assert isinstance(t, str)
    return t


def input_subject(ev: InputEvent) -> str:
    if isinstance(ev, Acquire | Release | Renew | Cancel | Phase):
        return subjects.job(ev.group, ev.job, tag(ev))
    if isinstance(ev, Tick | ClearFault | AgentLost):
        return subjects.ctl(ev.group, tag(ev))
    return subjects.agent_event(ev.node, ev.group)


def action_message(group: str, a: Action) -> tuple[str, bytes]:
    if isinstance(a, Notify):
        return subjects.notice(group, a.notice.job), encode(a.notice)
    if isinstance(a, Command):
        return subjects.agent_cmd(a.command.node), encode(a.command)
    return subjects.group_state(group), encode(a.change)


class Sim:
    """Drives ``apply()`` by hand for one group: a clock, a sequence, every record checked."""

    def __init__(self, group: str = G) -> None:
        self.group = group
        self.rec = new_record(group)
        self.now = T0
        self.seq = 0
        self.rids = itertools.count(1)
        self.stream: list[tuple[int, int, str, bytes]] = []

    def __call__(self, ev: InputEvent, *, dt: int = 0) -> list[Action]:
        self.now += dt
        self.seq += 1
        self.rec, actions = apply(self.rec, ev, self.now, self.seq)
        check_record(self.rec)
        self.stream.append((len(self.stream) + 1, self.now, input_subject(ev), encode(ev)))
        for a in actions:
            subject, data = action_message(self.group, a)
            self.stream.append((len(self.stream) + 1, self.now, subject, data))
        return actions

    def rid(self, job: str) -> str:
        return f"{job}-{next(self.rids)}"

    def acquire(self, job: str, rid: str | None = None, *, dt: int = 0, **kw: Any) -> list[Action]:
        return self(Acquire(group=self.group, job=job, request_id=rid or self.rid(job), **kw), dt=dt)

    def release(self, job: str, epoch: int | None = None, *, dt: int = 0) -> list[Action]:
        h = self.rec.holder
        rid = h.request_id if h is not None and h.job == job else self.rid(job)
        if epoch is None:
            assert h is not None
            epoch = h.epoch
        return self(Release(group=self.group, job=job, request_id=rid, epoch=epoch), dt=dt)

    def renew(self, job: str, epoch: int | None = None, *, dt: int = 0) -> list[Action]:
        h = self.rec.holder
        assert h is not None
        return self(Renew(group=self.group, job=job, request_id=h.request_id,
                          epoch=h.epoch if epoch is None else epoch), dt=dt)

    def register(self, job: str, node: str, *, op_timeout_ms: int = 10_000) -> list[Action]:
        return self(JobRegistered(group=self.group, job=job, node=node, op_timeout_ms=op_timeout_ms))

    def result(self, cmd: Snapshot | Restore, ok: bool = True, *, dt: int = 0) -> list[Action]:
        kind = OpKind.SNAPSHOT if isinstance(cmd, Snapshot) else OpKind.RESTORE
        return self(OpResult(group=self.group, op_id=cmd.op_id, node=cmd.node, job=cmd.job, kind=kind,
                             epoch=cmd.epoch, ok=ok, error=None if ok else "backend said no"), dt=dt)

    def tick(self, *, dt: int = 0) -> list[Action]:
        return self(Tick(group=self.group), dt=dt)

    def settle(self, actions: list[Action]) -> Granted:
        """Answer every snapshot/restore (successfully) until a grant comes; return it."""
        while not notices(actions, Granted):
            cmds = commands(actions)
            assert cmds, f"neither granted nor switching: {actions}"
            for c in cmds:
                actions = self.result(c)
        (g,) = notices(actions, Granted)
        return g  # type: ignore[no-any-return]

    def hold(self, job: str) -> Granted:
        """``job`` acquires and gets the group (answering any operations), then confirms its grant."""
        g = self.settle(self.acquire(job))
        assert g.job == job
        self.renew(job)
        return g


# --------------------------------------------------------------------------- the state machine


@dataclass
class Step:
    ev: InputEvent
    now: int
    seq: int
    rec: GroupRecord
    actions: list[Action]


class CoreMachine(RuleBasedStateMachine):
    """A model of what the notices promise, checked against ``apply()`` after every event."""

    def __init__(self) -> None:
        super().__init__()
        self.rec = new_record(G)
        self.now = T0
        self.seq = 0
        self.steps: list[Step] = []
        self.rid_counter = itertools.count(1)
        self.rid_job: dict[str, str] = {}  # every acquire's request id -> its job
        self.entries: dict[str, tuple[int, str]] = {}  # waiting job -> (enqueue order, request id)
        self.order = itertools.count(1)
        self.departed: set[str] = set()  # request ids that left: dequeued, refused, superseded
        self.holder: tuple[str, int, str] | None = None  # (job, epoch, request id) per the notices
        self.max_epoch = 0
        self.grants = 0
        self.ops: dict[str, tuple[Snapshot | Restore, list[bool | None]]] = {}  # op id -> (command, [result])
        self.failed = False  # a step failed: teardown has nothing to add

    # ------------------------------------------------------------------ plumbing

    def fresh_rid(self, job: str) -> str:
        rid = f"{job}-{next(self.rid_counter)}"
        self.rid_job[rid] = job
        return rid

    def current_rid(self, job: str) -> str:
        if self.holder is not None and self.holder[0] == job:
            return self.holder[2]
        if job in self.entries:
            return self.entries[job][1]
        return f"x-{next(self.rid_counter)}"

    def step(self, ev: InputEvent) -> list[Action]:
        old = self.rec
        self.seq += SEQ_GAP  # room for the notices in the stream built at the end
        new, actions = apply(old, ev, self.now, self.seq)
        self.steps.append(Step(ev, self.now, self.seq, new, actions))
        self.rec = new
        self.failed = True
        self.check_step(old, new, ev, actions)
        self.failed = False
        return actions

    def step_inert(self, ev: InputEvent) -> None:
        """``ev`` must change nothing beyond what the mere passing of time changes."""
        as_tick = apply(self.rec, Tick(group=G), self.now, self.seq + SEQ_GAP)
        got = apply(self.rec, ev, self.now, self.seq + SEQ_GAP)
        assert got == as_tick, f"{ev} had an effect beyond a tick's"
        self.step(ev)

    # ------------------------------------------------------------------ checks

    def check_step(self, old: GroupRecord, new: GroupRecord, ev: InputEvent, actions: list[Action]) -> None:
        if new is old:
            assert actions == [], "an unchanged record comes with no actions"
        else:
            assert new.last_seq == self.seq
        check_record(new)
        assert new.epoch >= old.epoch
        changes = [a.change for a in actions if isinstance(a, Transition)]
        if new.state != old.state:
            assert len(changes) == 1, changes
            c = changes[0]
            assert (c.previous, c.state, c.epoch) == (old.state, new.state, new.epoch)
            assert c.holder == (new.holder.job if new.holder else None) and c.active_job == new.active_job
        else:
            assert changes == []
        cmds = commands(actions)
        for c in cmds:
            sw = new.switch
            assert sw is not None and c.epoch == sw.epoch == new.epoch, (c, sw)
            assert c.op_id in {op.op_id for op in sw.ops}
            assert c.op_id not in self.ops, f"operation id {c.op_id} reused"
            if isinstance(c, Restore):
                assert sw.to is not None and c.job == sw.to.job and c.node in new.placements[c.job]
            else:
                assert (sw.to is None or c.job != sw.to.job) and new.loaded.get(c.node) == c.job
            self.ops[c.op_id] = (c, [None])
        self.check_notices(new, ev, notices(actions), cmds)
        self.reconcile()

    def check_notices(self, new: GroupRecord, ev: InputEvent, ns: list[Notice], cmds: list[Any]) -> None:
        pending = (ev.job, ev.request_id) if isinstance(ev, Acquire) else None
        resolved = pending is None

        def enqueue_pending() -> None:
            nonlocal resolved
            if resolved or pending is None:
                return
            resolved = True
            job, rid = pending
            cur = self.entries.get(job)
            if cur is not None:  # a second acquire replaces the request id, keeping the place
                self.departed.add(cur[1])
                self.entries[job] = (cur[0], rid)
            else:
                self.entries[job] = (next(self.order), rid)

        for i, n in enumerate(ns):
            assert n.group == G
            event(f"notice {tag(n)}" + (f" {n.code}" if isinstance(n, Refused) else ""))
            if isinstance(n, Granted):
                assert self.rid_job.get(n.request_id) == n.job, f"grant for a request {n.job} never made: {n}"
                assert n.request_id not in self.departed, f"grant to a request that had left: {n}"
                if self.holder is not None and self.holder[:2] == (n.job, n.epoch):
                    assert pending == (n.job, n.request_id), f"re-grant without the holder asking: {n}"
                    assert not n.context_restored and n.waited_ms == 0
                    resolved = True
                    self.departed.add(self.holder[2])
                    self.holder = (n.job, n.epoch, n.request_id)
                    continue
                assert self.holder is None, f"granted {n.job} at {n.epoch} while {self.holder} holds"
                assert n.epoch > self.max_epoch, f"grant epoch {n.epoch} after {self.max_epoch}"
                assert i == len(ns) - 1, f"a new grant is the last notice of its event: {ns}"
                assert not cmds, "a grant never comes with new snapshot/restore commands"
                if pending is not None and pending[1] == n.request_id:
                    enqueue_pending()
                entry = self.entries.get(n.job)
                assert entry is not None and entry[1] == n.request_id, f"{n.job} was not waiting with {n}"
                ahead = sorted((idx, j) for j, (idx, _) in self.entries.items() if idx < entry[0])
                assert not ahead, f"FIFO: granted {n.job} while {ahead} waited longer"
                del self.entries[n.job]
                restores = [r for c, r in self.ops.values() if isinstance(c, Restore) and c.epoch == n.epoch]
                assert all(r == [True] for r in restores), f"granted before every restore succeeded: {restores}"
                assert n.context_restored == bool(restores)
                placed = set(new.placements.get(n.job, ()))
                loaded_here = {node for node, j in new.loaded.items() if j == n.job}
                assert placed == loaded_here, f"granted {n.job} with its context on {loaded_here}, not {placed}"
                assert n.lease_deadline_ms > self.now
                self.holder = (n.job, n.epoch, n.request_id)
                self.max_epoch = n.epoch
                self.grants += 1
                event("grant after restores" if restores else "grant without restore")
            elif isinstance(n, Released | Revoked):
                assert self.holder is not None and self.holder[:2] == (n.job, n.epoch), (n, self.holder)
                self.holder = None
            elif isinstance(n, Dequeued):
                job = self.rid_job.get(n.request_id)
                entry = self.entries.get(job) if job is not None else None
                if entry is not None and entry[1] == n.request_id:
                    assert n.job == job, f"dequeue notice sent to {n.job}, the waiter is {job}"
                    if isinstance(ev, Cancel) and n.reason == ev.reason:
                        assert ev.job == job, f"{ev.job} cancelled {job}'s request"
                    del self.entries[job]  # type: ignore[arg-type]
                    self.departed.add(n.request_id)
                else:
                    assert isinstance(ev, Renew) and n.reason == "not waiting", f"dequeued a non-waiter: {n}"
            elif isinstance(n, Refused):
                job = self.rid_job.get(n.request_id)
                entry = self.entries.get(job) if job is not None else None
                if pending is not None and n.request_id == pending[1]:
                    assert n.code in (ErrorCode.INVALID, ErrorCode.JOB_FAULTED), n
                    resolved = True
                    self.departed.add(n.request_id)
                elif n.code is ErrorCode.JOB_FAULTED:
                    assert entry is not None and entry[1] == n.request_id and n.job == job, n
                    del self.entries[n.job]
                    self.departed.add(n.request_id)
                else:
                    assert n.code in (ErrorCode.NOT_HOLDER, ErrorCode.STALE_EPOCH), n
                    assert isinstance(ev, Release | Renew), (ev, n)
        if not resolved:
            assert pending is not None
            assert self.holder is None or self.holder[0] != pending[0], "holder's acquire went unanswered"
            enqueue_pending()

    def reconcile(self) -> None:
        rec = self.rec
        waiting = ([rec.switch.to] if rec.switch and rec.switch.to else []) + list(rec.queue)
        model = [(j, rid) for j, (_, rid) in sorted(self.entries.items(), key=lambda kv: kv[1][0])]
        assert [(w.job, w.request_id) for w in waiting] == model, "waiters (in FIFO order) differ from the model"
        if self.holder is None:
            assert rec.holder is None, rec.holder
        else:
            assert rec.holder is not None
            assert (rec.holder.job, rec.holder.epoch, rec.holder.request_id) == self.holder
        assert rec.epoch >= self.max_epoch

    # ------------------------------------------------------------------ rules

    @initialize(regs=st.fixed_dictionaries({j: st.sampled_from([(), ("n1",), ("n2",), NODES, NODES]) for j in JOBS}))
    def setup(self, regs: dict[str, tuple[str, ...]]) -> None:
        for job, nodes in regs.items():
            for node in nodes:
                self.step(JobRegistered(group=G, job=job, node=node, op_timeout_ms=5_000))

    @rule(dt=st.sampled_from([1, 10, 100, 300, 300, 1_000, 1_000, 3_000, 5_000, 30_000, 400_000, -1, -2]))
    def wait(self, dt: int) -> None:
        """Time passes: a fixed step, or up to just before (-1) or exactly at (-2) the next deadline."""
        if dt > 0:
            self.now += dt
            return
        nd = next_deadline(self.rec)
        if nd is not None:
            self.now = max(self.now, nd + 1 + dt)

    @rule()
    def tick(self) -> None:
        self.step(Tick(group=G))

    @rule(
        job=st.sampled_from(JOBS),
        lease=st.sampled_from([1_000, 5_000, 30_000, 30_000]),
        timeout=st.sampled_from([0, 1_000, 10_000, 300_000, 300_000]),
        ttl=st.sampled_from([300, 2_000, 5_000, 5_000]),
        confirm=st.sampled_from([300, 1_000, 3_000, 3_000]),
        invalid=st.sampled_from([None] * 12 + ["lease_ms", "waiter_ttl_ms", "confirm_ms", "timeout_ms"]),
    )
    def acquire(self, job: str, lease: int, timeout: int, ttl: int, confirm: int, invalid: str | None) -> None:
        kw: dict[str, Any] = dict(lease_ms=lease, timeout_ms=timeout, waiter_ttl_ms=ttl, confirm_ms=confirm)
        if invalid is not None:
            kw[invalid] = {"lease_ms": 10, "waiter_ttl_ms": 10**9, "confirm_ms": 1, "timeout_ms": -1}[invalid]
        self.step(Acquire(group=G, job=job, request_id=self.fresh_rid(job), **kw))

    @rule(job=st.sampled_from(JOBS))
    def acquire_patient(self, job: str) -> None:
        """A waiter that stays: long timeout, long liveness window, long confirmation window."""
        self.step(Acquire(group=G, job=job, request_id=self.fresh_rid(job), lease_ms=60_000, timeout_ms=600_000,
                          waiter_ttl_ms=120_000, confirm_ms=60_000))

    @precondition(lambda self: self.holder is not None)
    @rule()
    def release(self) -> None:
        assert self.holder is not None
        job, epoch, rid = self.holder
        self.step(Release(group=G, job=job, request_id=rid, epoch=epoch))

    @rule()
    def renew_all(self) -> None:
        """A client's background renewer: the holder's lease and every waiter's place."""
        if self.holder is not None:
            job, epoch, rid = self.holder
            self.step(Renew(group=G, job=job, request_id=rid, epoch=epoch))
        for job, (_, rid) in sorted(self.entries.items()):
            self.step(Renew(group=G, job=job, request_id=rid))

    def some_rid(self, data: st.DataObject) -> str | None:
        rids = [rid for _, rid in self.entries.values()]
        if self.holder is not None:
            rids.append(self.holder[2])
        rids += sorted(self.rid_job)[-2:]
        return data.draw(st.sampled_from(rids)) if rids else None

    def some_job(self, data: st.DataObject) -> str:
        """Mostly a job involved right now (holder, switch target, being snapshotted, waiting, faulted)."""
        rec = self.rec
        involved = {j for j in (rec.active_job, rec.holder.job if rec.holder else None) if j is not None}
        if rec.switch is not None:
            involved |= {op.job for op in rec.switch.ops}
            if rec.switch.to is not None:
                involved.add(rec.switch.to.job)
        involved |= {w.job for w in rec.queue} | set(rec.faulted)
        if involved and data.draw(st.integers(0, 3)) > 0:
            return data.draw(st.sampled_from(sorted(involved)))
        return data.draw(st.sampled_from(JOBS))

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rid = self.some_rid(data)
        if rid is not None:
            self.step(Cancel(group=G, job=self.rid_job[rid], request_id=rid, reason="cancelled"))

    @rule(data=st.data())
    def cancel_foreign(self, data: st.DataObject) -> None:
        """A job cancels a request id that may not be its own (a confused or hostile client)."""
        rid = self.some_rid(data)
        if rid is not None:
            self.step(Cancel(group=G, job=self.some_job(data), request_id=rid, reason="cancelled"))

    @rule(data=st.data(), delta=st.integers(-2, 1))
    def release_other(self, data: st.DataObject, delta: int) -> None:
        """A release from some job, with its latest request id and an epoch near the current one."""
        job = self.some_job(data)
        self.step(Release(group=G, job=job, request_id=self.current_rid(job), epoch=max(0, self.rec.epoch + delta)))

    @rule(data=st.data(), delta=st.integers(-2, 1), waiter=st.booleans())
    def renew_other(self, data: st.DataObject, delta: int, waiter: bool) -> None:
        """A renewal from some job: of a lease (with an epoch near the current one) or of a waiter's place."""
        if waiter:
            rid = self.some_rid(data)
            if rid is not None:
                self.step(Renew(group=G, job=self.rid_job[rid], request_id=rid))
            return
        job = self.some_job(data)
        self.step(Renew(group=G, job=job, request_id=self.current_rid(job), epoch=max(0, self.rec.epoch + delta)))

    @rule(data=st.data())
    def clear_fault(self, data: st.DataObject) -> None:
        """An operator clears a fault: mostly of a faulted job or of the incoming job of a switch."""
        sw = self.rec.switch
        likely = sorted(set(self.rec.faulted) | ({sw.to.job} if sw is not None and sw.to is not None else set()))
        if likely and data.draw(st.integers(0, 3)) > 0:
            job = data.draw(st.sampled_from(likely))
        else:
            job = data.draw(st.sampled_from(JOBS))
        self.step(ClearFault(group=G, job=job))

    @rule(
        data=st.data(),
        kind=st.sampled_from(["register", "register", "unregister", "lost"]),
        node=st.sampled_from(NODES),
        timeout=st.sampled_from([500, 5_000, 120_000]),
    )
    def agents(self, data: st.DataObject, kind: str, node: str, timeout: int) -> None:
        if kind == "register":
            self.step(JobRegistered(group=G, job=self.some_job(data), node=node, op_timeout_ms=timeout))
        elif kind == "unregister":
            self.step(JobUnregistered(group=G, job=self.some_job(data), node=node))
        else:
            self.step(AgentLost(group=G, node=node))

    @precondition(lambda self: self.rec.switch is not None and self.rec.switch.to is not None)
    @rule(node=st.sampled_from(NODES))
    def incoming_job_registers(self, node: str) -> None:
        """The incoming job of a running switch (re)appears on a node, e.g. a worker restarted there."""
        sw = self.rec.switch
        assert sw is not None and sw.to is not None
        self.step(JobRegistered(group=G, job=sw.to.job, node=node, op_timeout_ms=5_000))

    def answer(self, op: OpRecord, epoch: int, ok: bool) -> None:
        if self.now < op.deadline_ms:  # else it times out before this answer is applied
            self.ops[op.op_id][1][0] = ok
        self.step(OpResult(group=G, op_id=op.op_id, node=op.node, job=op.job, kind=op.kind, epoch=epoch, ok=ok,
                           error=None if ok else "backend failed"))

    @precondition(lambda self: self.rec.switch is not None)
    @rule(data=st.data(), ok=st.sampled_from([True, True, False]))
    def op_result(self, data: st.DataObject, ok: bool) -> None:
        sw = self.rec.switch
        assert sw is not None
        self.answer(data.draw(st.sampled_from(sw.ops)), sw.epoch, ok)

    @precondition(lambda self: self.rec.switch is not None or self.holder is not None)
    @rule(release=st.booleans())
    def agents_answer_all(self, release: bool) -> None:
        """Responsive agents: every pending operation succeeds, phase after phase (after the holder's
        release, if ``release``): a smooth handoff."""
        if release and self.holder is not None:
            self.release()
        for _ in range(4):
            sw = self.rec.switch
            if sw is None:
                return
            for op in sw.ops:
                self.answer(op, sw.epoch, True)

    @rule(data=st.data(), kind=st.sampled_from(["late", "forged", "phase", "duplicate"]), ok=st.booleans())
    def noise(self, data: st.DataObject, kind: str, ok: bool) -> None:
        """Events that must change nothing (beyond what time changes)."""
        sw = self.rec.switch
        if kind == "phase":
            self.step_inert(Phase(group=G, job=data.draw(st.sampled_from(JOBS)), name="train", edge="start"))
        elif kind == "forged" and sw is not None:
            # A pending operation's id with an older epoch: fenced off.
            op = data.draw(st.sampled_from(sw.ops))
            self.step_inert(OpResult(group=G, op_id=op.op_id, node=op.node, job=op.job, kind=op.kind,
                                     epoch=sw.epoch - 1, ok=ok))
        elif kind == "late":
            # An answer for an operation that is no longer pending (answered, timed out, older switch).
            pending = {op.op_id for op in sw.ops} if sw is not None else set()
            old = [c for c, _ in self.ops.values() if c.op_id not in pending]
            if old:
                c = data.draw(st.sampled_from(old))
                kind_ = OpKind.SNAPSHOT if isinstance(c, Snapshot) else OpKind.RESTORE
                self.step_inert(OpResult(group=G, op_id=c.op_id, node=c.node, job=c.job, kind=kind_, epoch=c.epoch,
                                         ok=ok))
        elif kind == "duplicate" and self.rec.last_seq > 0:
            # Re-applying an event already reflected in the record: the same object, no actions.
            done = [s for s in self.steps if s.seq <= self.rec.last_seq]
            s = data.draw(st.sampled_from(done))
            seq = data.draw(st.sampled_from([s.seq, self.rec.last_seq]))
            new, actions = apply(self.rec, s.ev, self.now, seq)
            assert new is self.rec and actions == []

    # ------------------------------------------------------------------ invariants and the end

    @invariant()
    def deadlines_are_exact(self) -> None:
        """Nothing expires before ``next_deadline``; something does at it."""
        nd = next_deadline(self.rec)
        probe = self.seq + SEQ_GAP
        quiet_until = self.now + 10**9 if nd is None else nd - 1
        if quiet_until >= self.now:
            new, actions = apply(self.rec, Tick(group=G), quiet_until, probe)
            assert new is self.rec and actions == [], f"a tick before the next deadline {nd} changed the record"
        if nd is not None:
            new, _ = apply(self.rec, Tick(group=G), max(nd, self.now), probe)
            assert new is not self.rec, f"nothing expired at the next deadline {nd}"

    def teardown(self) -> None:
        if self.failed:
            return
        # Determinism: the same events give the same records and the same actions.
        rec = new_record(G)
        for s in self.steps:
            rec, actions = apply(rec, s.ev, s.now, s.seq)
            assert rec == s.rec and actions == s.actions
        # The run as a stream (inputs at their own seqs, the published actions right after them): the
        # checker's fold agrees with the notices; redeliveries and junk are tolerated.
        stream: list[tuple[int, int, str, bytes]] = []
        junk = 0
        for i, s in enumerate(self.steps):
            stream.append((s.seq, s.now, input_subject(s.ev), encode(s.ev)))
            for j, a in enumerate(s.actions, 1):
                stream.append((s.seq + j, s.now, *action_message(G, a)))
            if i % 7 == 3:
                stream.append((s.seq + SEQ_GAP - 2, s.now, subjects.job(G, "a", "acquire"), b'{"type": "acquire"}'))
                stream.append((s.seq + SEQ_GAP - 1, s.now, "ts.v1.other.thing", b"\x00"))
                junk += 1
        checker = StreamChecker()
        for k, msg in enumerate(stream):
            checker.feed(*msg)
            if k % 5 == 0:
                checker.feed(*msg)  # a redelivery
        if not self.steps:
            return
        got = checker.records[G]
        assert msgspec.structs.replace(got, last_seq=0) == msgspec.structs.replace(self.rec, last_seq=0)
        stats = checker.stats[G]
        assert (stats.grants, stats.fold_grants, stats.max_epoch) == (self.grants, self.grants, self.max_epoch)
        assert checker.unpublished_grants() == []
        assert checker.rejected == junk
        assert stats.holder == (self.holder[:2] if self.holder else None)


CoreMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCoreStateMachine = CoreMachine.TestCase


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
    assert notices(sim.acquire("b")) == []
    actions = sim.release("a")
    (rel,) = notices(actions, Released)
    assert rel.pending_waiters == 1 and not rel.snapshot_deferred
    snaps = commands(actions)
    assert [(type(c), c.job, c.node, c.epoch) for c in snaps] == [(Snapshot, "a", "n1", 2), (Snapshot, "a", "n2", 2)]
    assert sim.rec.state is GroupState.SWITCHING and sim.rec.epoch == 2

    assert commands(sim.result(snaps[0])) == []  # n2 still snapshotting: no restore yet
    restores = commands(sim.result(snaps[1]))
    assert [(type(c), c.job, c.node, c.epoch) for c in restores] == [(Restore, "b", "n1", 2), (Restore, "b", "n2", 2)]
    assert notices(sim.result(restores[1])) == []  # one restore still out: no grant
    (g,) = notices(sim.result(restores[0]), Granted)
    assert (g.job, g.epoch, g.context_restored) == ("b", 2, True)
    assert sim.rec.loaded == {"n1": "b", "n2": "b"} and sim.rec.active_job == "b"


def test_failed_snapshot_faults_that_job_and_the_waiter_still_gets_the_group() -> None:
    sim = Sim()
    sim.register("a", "n1")
    sim.register("b", "n1")
    sim.hold("a")
    sim.acquire("b")
    (snap,) = commands(sim.release("a"))
    actions = sim.result(snap, ok=False)
    assert sim.rec.faulted == {"a": "backend said no"}
    (restore,) = commands(actions)
    assert (restore.job, restore.node) == ("b", "n1")
    (g,) = notices(sim.result(restore), Granted)
    assert g.job == "b"
    # The faulted job is refused until its fault is cleared.
    (r,) = notices(sim.acquire("a"), Refused)
    assert r.code is ErrorCode.JOB_FAULTED and r.message == "backend said no"
    sim(ClearFault(group=G, job="a"))
    assert sim.rec.faulted == {}
    assert notices(sim.acquire("a")) == [] and [w.job for w in sim.rec.queue] == ["a"]


def test_failed_restore_faults_the_incoming_job_which_is_refused() -> None:
    sim = Sim()
    sim.register("b", "n1")
    (restore,) = commands(sim.acquire("b"))
    actions = sim.result(restore, ok=False)
    (r,) = notices(actions, Refused)
    assert (r.job, r.code) == ("b", ErrorCode.JOB_FAULTED)
    assert sim.rec.state is GroupState.IDLE and sim.rec.holder is None and "b" in sim.rec.faulted


def test_agent_lost_mid_snapshot_resolves_the_operation() -> None:
    sim = Sim()
    sim.register("a", "n1")
    sim.register("b", "n2")
    sim.hold("a")
    sim.acquire("b")
    (snap,) = commands(sim.release("a"))
    assert snap.node == "n1"
    actions = sim(AgentLost(group=G, node="n1"))
    assert "a" in sim.rec.faulted and "n1" in sim.rec.faulted["a"]
    (restore,) = commands(actions)
    assert (restore.job, restore.node) == ("b", "n2")
    (g,) = notices(sim.result(restore), Granted)
    assert g.job == "b" and sim.rec.loaded == {"n2": "b"}
    # The lost answer arriving after all changes nothing (fenced: the operation is gone).
    before = sim.rec
    sim.result(snap)
    assert sim.rec is before


def test_agent_lost_mid_restore_faults_the_incoming_job() -> None:
    sim = Sim()
    sim.register("b", "n1")
    commands(sim.acquire("b"))
    assert sim.rec.state is GroupState.SWITCHING
    (r,) = notices(sim(AgentLost(group=G, node="n1")), Refused)
    assert r.code is ErrorCode.JOB_FAULTED
    assert sim.rec.switch is None and sim.rec.placements == {} and sim.rec.state is GroupState.IDLE


def test_operation_timeout_resolves_the_operation() -> None:
    sim = Sim()
    sim.register("a", "n1", op_timeout_ms=2_000)
    sim.register("b", "n2")
    sim.hold("a")
    sim.acquire("b", timeout_ms=60_000, waiter_ttl_ms=600_000)
    (snap,) = commands(sim.release("a"))
    assert next_deadline(sim.rec) == snap.deadline_ms == sim.now + 2_000
    actions = sim.tick(dt=2_000)
    assert "timed out" in sim.rec.faulted["a"]
    (restore,) = commands(actions)
    assert restore.job == "b"


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
    sim = Sim()
    sim.register("a", "n1")
    sim.register("b", "n1")
    sim.hold("a")
    sim.acquire("b")
    (snap,) = commands(sim.release("a"))
    (restore,) = commands(sim.result(snap))
    sim.result(restore)  # b holds at epoch 2
    sim.renew("b")
    sim.acquire("a")
    (snap3,) = commands(sim.release("b"))  # epoch 3: snapshot b
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
        r, switch=SwitchRecord(to=None, epoch=r.epoch, phase=OpKind.SNAPSHOT, started_at_ms=0)),
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
    waiter = WaiterRecord(job="b", request_id="r", enqueued_at_ms=0, deadline_ms=10, alive_until_ms=10,
                          lease_ms=1_000, waiter_ttl_ms=1_000, confirm_ms=1_000)
    rec = GroupRecord(group=G, epoch=1, state=GroupState.SWITCHING,
                      switch=SwitchRecord(to=waiter, epoch=1, phase=OpKind.SNAPSHOT, started_at_ms=0))
    with pytest.raises(InvariantViolation, match="switch-stuck"):
        check_record(rec)


def _scenario() -> Sim:
    """A stream with a switch, a failed snapshot, a revocation, a re-acquire and a zero-cost grant."""
    sim = Sim()
    sim.register("a", "n1")
    sim.register("b", "n1")
    sim.hold("a")
    sim.acquire("b")
    (snap,) = commands(sim.release("a"))
    (restore,) = commands(sim.result(snap, ok=False))
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
    checker.feed(n + 3, sim.now, subjects.job(G, "a", "acquire"), b'{"type":"acquire","group":"g","job":"a",'
                 b'"request_id":"r","surprise":1}')
    checker.feed(n + 4, sim.now, "ts.v1.unknown.subject", b"whatever")
    assert checker.rejected == 3 and checker.duplicates == n and checker.ignored >= 1
    assert msgspec.structs.replace(checker.records[G], last_seq=0) == msgspec.structs.replace(sim.rec, last_seq=0)
    st_ = checker.stats[G]
    assert (st_.grants, st_.max_epoch, st_.revocations, st_.releases) == (4, 4, 1, 2)
    assert st_.repeated_grants == 1 and st_.holder == ("a", 4)
    assert checker.unpublished_grants() == []


def test_stream_checker_accepts_grants_reissued_after_a_crash() -> None:
    sim = _scenario()
    grants = [(s, t, subj, d) for s, t, subj, d in sim.stream if subj.startswith("ts.v1.notice.")
              and b'"granted"' in d]
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
    "grant-agrees-with-fold": lambda n: msgspec.structs.replace(n, epoch=n.epoch + 10)
    if isinstance(n, Granted) and n.epoch == 2 else n,
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
    return Granted(group=G, job=job, request_id=f"{job}@{epoch}", epoch=epoch, waited_ms=0, context_restored=False,
                   lease_deadline_ms=0)


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
    g = Granted(group=G, job="a", request_id="r", epoch=1, waited_ms=0, context_restored=False,
                lease_deadline_ms=0)
    with pytest.raises(InvariantViolation, match="notice-subject"):
        checker.feed(1, sim.now, subjects.notice(G, "b"), encode(g))
