"""The pure core of the orchestrator: ``apply(record, event, now_ms, seq) -> (record, actions)``.

No I/O, no clock, no randomness: time enters only as ``now_ms``, the stream timestamp of the event
being applied, so the orchestrator, ``timeslice replay`` and the invariant checker reach exactly the
same decisions from the same events. Expiries (leases, waiter liveness, acquire deadlines, agent
operation deadlines) are evaluated at the start of every event; the orchestrator publishes ``Tick``
events at :func:`next_deadline` so that they also fire when nothing else happens.

Semantics, per group:

* strict FIFO among waiters; a job waits at most once (a second acquire replaces its request id);
* the holder re-acquiring gets its grant back at once (same epoch);
* release with no waiter keeps the context loaded (``IDLE_YIELDED``); the same job's next acquire is
  granted without snapshot or restore;
* every grant raises ``epoch``; release and renew must carry the current one;
* a holder's lease starts as a short confirmation window (``confirm_ms``) and becomes ``lease_ms``
  at the first renewal, so a waiter that died just before its grant is passed over within seconds;
* a switch snapshots every loaded context that is not the incoming job's, then restores the
  incoming job where it is registered, and grants only when every restore succeeded; a failed
  operation faults that job only, and the group moves on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from timeslice_client.protocol import (
    Acquire,
    AgentCommand,
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
    StateChanged,
    SwitchRecord,
    Tick,
    WaiterRecord,
)

__all__ = [
    "LIMITS",
    "Action",
    "Command",
    "Limits",
    "Notify",
    "Transition",
    "apply",
    "new_record",
    "next_deadline",
]


class Notify(msgspec.Struct, frozen=True):
    notice: Notice


class Command(msgspec.Struct, frozen=True):
    command: AgentCommand


class Transition(msgspec.Struct, frozen=True):
    change: StateChanged


Action = Notify | Command | Transition


class Limits(msgspec.Struct, frozen=True):
    """Bounds on client-chosen durations; requests outside them are refused as INVALID."""

    min_lease_ms: int = 1_000
    max_lease_ms: int = 24 * 3600 * 1000
    min_ttl_ms: int = 300
    max_ttl_ms: int = 600_000
    max_timeout_ms: int = 7 * 24 * 3600 * 1000
    max_queue: int = 10_000


LIMITS = Limits()


def new_record(group: str) -> GroupRecord:
    """A group comes into existence on first use: IDLE, epoch 0."""
    return GroupRecord(group=group)


def next_deadline(rec: GroupRecord) -> int | None:
    """The earliest instant at which something in ``rec`` expires, or None."""
    times: list[int] = []
    if rec.holder is not None:
        times.append(rec.holder.lease_deadline_ms)
    times.extend(min(w.deadline_ms, w.alive_until_ms) for w in rec.queue)
    if rec.switch is not None:
        times.extend(op.deadline_ms for op in rec.switch.ops)
        if rec.switch.to is not None:
            to = rec.switch.to
            times.append(min(to.deadline_ms, to.alive_until_ms))
    return min(times) if times else None


def apply(rec: GroupRecord, ev: InputEvent, now_ms: int, seq: int) -> tuple[GroupRecord, list[Action]]:
    """Apply one event. Returns ``rec`` itself (same object) when nothing changed.

    An event at or below ``rec.last_seq`` was applied already: it is ignored (idempotence).
    """
    if seq <= rec.last_seq:
        return rec, []
    w = _Work.of(rec, now_ms)
    w.seq = seq
    w.expire()
    _HANDLERS[type(ev)](w, ev)
    w.advance()
    return w.finish(rec, seq)


@dataclass
class _Work:
    """A mutable working copy of a record for the duration of one ``apply``."""

    group: str
    now: int
    epoch: int
    state: GroupState
    since_ms: int
    holder: HolderRecord | None
    active_job: str | None
    loaded: dict[str, str]
    placements: dict[str, tuple[str, ...]]
    op_timeouts: dict[str, int]
    queue: list[WaiterRecord]
    switch: SwitchRecord | None
    faulted: dict[str, str]
    saved: dict[str, tuple[str, ...]]
    lost_nodes: tuple[str, ...]
    actions: list[Action] = field(default_factory=list)
    changed: bool = False
    reason: str = ""
    seq: int = 0

    @classmethod
    def of(cls, rec: GroupRecord, now: int) -> _Work:
        return cls(
            group=rec.group,
            now=now,
            epoch=rec.epoch,
            state=rec.state,
            since_ms=rec.since_ms,
            holder=rec.holder,
            active_job=rec.active_job,
            loaded=dict(rec.loaded),
            placements=dict(rec.placements),
            op_timeouts=dict(rec.op_timeouts),
            queue=list(rec.queue),
            switch=rec.switch,
            faulted=dict(rec.faulted),
            saved=dict(rec.saved),
            lost_nodes=rec.lost_nodes,
        )

    def finish(self, rec: GroupRecord, seq: int) -> tuple[GroupRecord, list[Action]]:
        if not self.changed and not self.actions:
            return rec, []
        state = self._derive_state()
        since = self.since_ms
        if state != rec.state:
            since = self.now
            self.actions.append(
                Transition(
                    StateChanged(
                        group=self.group,
                        state=state,
                        previous=rec.state,
                        epoch=self.epoch,
                        holder=self.holder.job if self.holder else None,
                        active_job=self.active_job,
                        reason=self.reason or "",
                    )
                )
            )
        new = GroupRecord(
            group=self.group,
            epoch=self.epoch,
            state=state,
            since_ms=since,
            holder=self.holder,
            active_job=self.active_job,
            loaded=self.loaded,
            placements=self.placements,
            op_timeouts=self.op_timeouts,
            queue=tuple(self.queue),
            switch=self.switch,
            faulted=self.faulted,
            saved=self.saved,
            lost_nodes=self.lost_nodes,
            last_seq=seq,
        )
        return new, self.actions

    def _derive_state(self) -> GroupState:
        if self.holder is not None:
            return GroupState.LOCKED
        if self.switch is not None:
            return GroupState.SWITCHING
        if self.active_job is not None:
            return GroupState.IDLE_YIELDED
        return GroupState.IDLE

    # ------------------------------------------------------------------ helpers

    def notify(self, notice: Notice) -> None:
        self.actions.append(Notify(notice))

    def refuse(self, job: str, request_id: str, code: ErrorCode, message: str) -> None:
        self.notify(
            Refused(
                group=self.group,
                job=job,
                request_id=request_id,
                code=code,
                message=message,
                holder=self.holder.job if self.holder else None,
                epoch=self.epoch,
            )
        )

    def touch(self, reason: str) -> None:
        self.changed = True
        self.reason = reason

    def waiter_index(self, job: str) -> int | None:
        for i, wr in enumerate(self.queue):
            if wr.job == job:
                return i
        return None

    def grant(self, wr: WaiterRecord, epoch: int, restored: bool) -> None:
        self.epoch = epoch
        self.holder = HolderRecord(
            job=wr.job,
            request_id=wr.request_id,
            epoch=epoch,
            granted_at_ms=self.now,
            lease_ms=wr.lease_ms,
            lease_deadline_ms=self.now + min(wr.confirm_ms, wr.lease_ms),
            waiter_ttl_ms=wr.waiter_ttl_ms,
        )
        self.active_job = wr.job
        self.notify(
            Granted(
                group=self.group,
                job=wr.job,
                request_id=wr.request_id,
                epoch=epoch,
                waited_ms=max(0, self.now - wr.enqueued_at_ms),
                context_restored=restored,
                lease_deadline_ms=self.holder.lease_deadline_ms,
            )
        )
        self.touch("granted")

    def drop_waiter(self, i: int, reason: str) -> None:
        wr = self.queue.pop(i)
        self.notify(Dequeued(group=self.group, job=wr.job, request_id=wr.request_id, reason=reason))
        self.touch(f"waiter {reason}")

    def unsave(self, job: str, node: str) -> None:
        rest = tuple(n for n in self.saved.get(job, ()) if n != node)
        if rest:
            self.saved[job] = rest
        else:
            self.saved.pop(job, None)

    def fault(self, job: str, reason: str) -> None:
        self.faulted[job] = reason
        self.touch("job faulted")
        i = self.waiter_index(job)
        if i is not None:
            self.drop_waiter(i, f"faulted: {reason}")
        sw = self.switch
        if sw is not None and sw.to is not None and sw.to.job == job:
            # The incoming job will not be granted this switch, even if its fault is cleared meanwhile.
            self.refuse(job, sw.to.request_id, ErrorCode.JOB_FAULTED, reason)
            self.switch = msgspec.structs.replace(sw, to=None)

    # ------------------------------------------------------------------ expiries

    def expire(self) -> None:
        now = self.now
        h = self.holder
        if h is not None and now >= h.lease_deadline_ms:
            why = "lease expired" if h.confirmed else "grant not confirmed in time"
            self.notify(Revoked(group=self.group, job=h.job, epoch=h.epoch, reason=why))
            self.holder = None
            self.touch(why)
        for i in range(len(self.queue) - 1, -1, -1):
            wr = self.queue[i]
            if now >= wr.deadline_ms:
                self.drop_waiter(i, "timeout")
            elif now >= wr.alive_until_ms:
                self.drop_waiter(i, "waiter lost (no renewal)")
        sw = self.switch
        if sw is None:
            return
        if sw.to is not None and now >= min(sw.to.deadline_ms, sw.to.alive_until_ms):
            to = sw.to
            why = "timeout" if now >= to.deadline_ms else "waiter lost (no renewal)"
            self.notify(Dequeued(group=self.group, job=to.job, request_id=to.request_id, reason=why))
            self.switch = sw = msgspec.structs.replace(sw, to=None)
            self.touch(f"waiter {why}")
        for op in sw.ops:
            if now >= op.deadline_ms:
                self.op_done(op, ok=False, error=f"{op.kind} on node {op.node} timed out")

    # ------------------------------------------------------------------ switching

    def advance(self) -> None:
        """Move the group forward: finish a switch whose operations are done, or start the next one."""
        while True:
            sw = self.switch
            if sw is not None:
                if sw.ops:
                    return
                if sw.phase is OpKind.SNAPSHOT and sw.to is not None and sw.to.job not in self.faulted:
                    self.start_restores(sw)
                    continue
                self.switch = None
                to = sw.to
                if to is not None and to.job not in self.faulted:
                    self.grant(to, sw.epoch, sw.restored)
                    return
                if to is not None:
                    self.refuse(to.job, to.request_id, ErrorCode.JOB_FAULTED, self.faulted[to.job])
                self.touch("switch ended without grant")
                continue
            if self.holder is not None or not self.queue:
                return
            wr = self.queue.pop(0)
            self.touch("next waiter")
            if wr.job in self.faulted:
                self.refuse(wr.job, wr.request_id, ErrorCode.JOB_FAULTED, self.faulted[wr.job])
                continue
            self.start_switch(wr)

    def start_switch(self, wr: WaiterRecord) -> None:
        epoch = self.epoch + 1
        self.epoch = epoch
        ops: list[OpRecord] = []
        for node, job in sorted(self.loaded.items()):
            if job != wr.job:
                ops.append(self.op(OpKind.SNAPSHOT, node, job, epoch))
        if self.active_job != wr.job:
            self.active_job = None
        self.switch = SwitchRecord(to=wr, epoch=epoch, phase=OpKind.SNAPSHOT, ops=tuple(ops), started_at_ms=self.now)
        self.touch("switching")

    def start_restores(self, sw: SwitchRecord) -> None:
        assert sw.to is not None
        job = sw.to.job
        stranded = [n for n in self.saved.get(job, ()) if n in self.lost_nodes]
        if stranded:
            # Its state is offloaded on a node whose agent is gone: granting now would hand it freed memory.
            self.switch = msgspec.structs.replace(sw, phase=OpKind.RESTORE, ops=())
            self.fault(job, f"its context is saved on node {stranded[0]}, whose agent was lost; restart the agent "
                            "there, then clear the fault")
            return
        ops = [
            self.op(OpKind.RESTORE, node, job, sw.epoch)
            for node in sorted(self.placements.get(job, ()))
            if self.loaded.get(node) != job
        ]
        self.switch = msgspec.structs.replace(sw, phase=OpKind.RESTORE, ops=tuple(ops), restored=bool(ops))
        self.touch("restoring")

    def op(self, kind: OpKind, node: str, job: str, epoch: int, suffix: str = "") -> OpRecord:
        timeout = self.op_timeouts.get(f"{node}/{job}", 120_000)
        op = OpRecord(
            op_id=f"{self.group}:{epoch}:{kind}:{node}{suffix}", node=node, job=job, kind=kind,
            deadline_ms=self.now + timeout,
        )
        cls = Snapshot if kind is OpKind.SNAPSHOT else Restore
        self.actions.append(
            Command(cls(op_id=op.op_id, group=self.group, job=job, node=node, epoch=epoch, deadline_ms=op.deadline_ms))
        )
        return op

    def op_done(self, op: OpRecord, *, ok: bool, error: str | None) -> None:
        sw = self.switch
        assert sw is not None
        self.switch = msgspec.structs.replace(sw, ops=tuple(o for o in sw.ops if o.op_id != op.op_id))
        if op.kind is OpKind.SNAPSHOT or not ok:
            if self.loaded.get(op.node) == op.job:
                del self.loaded[op.node]
        else:
            self.loaded[op.node] = op.job
        nodes = self.saved.get(op.job, ())
        if op.kind is OpKind.SNAPSHOT and ok and op.node not in nodes:
            self.saved[op.job] = (*nodes, op.node)
        elif op.kind is OpKind.RESTORE and ok and op.node in nodes:
            self.unsave(op.job, op.node)
        if not ok:
            self.fault(op.job, error or f"{op.kind} failed on node {op.node}")
        self.touch(f"{op.kind} {'done' if ok else 'failed'}")


# ---------------------------------------------------------------------- event handlers


def _on_acquire(w: _Work, ev: Acquire) -> None:
    lim = LIMITS
    if not (lim.min_lease_ms <= ev.lease_ms <= lim.max_lease_ms):
        w.refuse(ev.job, ev.request_id, ErrorCode.INVALID,
                 f"lease_ms={ev.lease_ms} is outside [{lim.min_lease_ms}, {lim.max_lease_ms}]")
        return
    if not (lim.min_ttl_ms <= ev.waiter_ttl_ms <= lim.max_ttl_ms and lim.min_ttl_ms <= ev.confirm_ms <= lim.max_ttl_ms):
        w.refuse(ev.job, ev.request_id, ErrorCode.INVALID,
                 f"waiter_ttl_ms/confirm_ms must lie in [{lim.min_ttl_ms}, {lim.max_ttl_ms}]")
        return
    if not (0 <= ev.timeout_ms <= lim.max_timeout_ms):
        w.refuse(ev.job, ev.request_id, ErrorCode.INVALID, f"timeout_ms={ev.timeout_ms} is out of range")
        return
    if ev.job in w.faulted:
        w.refuse(ev.job, ev.request_id, ErrorCode.JOB_FAULTED, w.faulted[ev.job])
        return
    now = w.now
    h = w.holder
    if h is not None and h.job == ev.job:
        # The holder asks again (a retry, or a nested acquire): same grant, and proof of life.
        w.holder = msgspec.structs.replace(
            h, request_id=ev.request_id, confirmed=True, lease_ms=ev.lease_ms, lease_deadline_ms=now + ev.lease_ms
        )
        w.notify(Granted(group=w.group, job=ev.job, request_id=ev.request_id, epoch=h.epoch, waited_ms=0,
                         context_restored=False, lease_deadline_ms=now + ev.lease_ms))
        w.touch("re-acquired by holder")
        return
    wr = WaiterRecord(
        job=ev.job,
        request_id=ev.request_id,
        enqueued_at_ms=now,
        deadline_ms=now + ev.timeout_ms,
        alive_until_ms=now + ev.waiter_ttl_ms,
        lease_ms=ev.lease_ms,
        waiter_ttl_ms=ev.waiter_ttl_ms,
        confirm_ms=ev.confirm_ms,
    )
    sw = w.switch
    if sw is not None and sw.to is not None and sw.to.job == ev.job:
        w.switch = msgspec.structs.replace(sw, to=msgspec.structs.replace(wr, enqueued_at_ms=sw.to.enqueued_at_ms))
        w.touch("waiter re-acquired")
        return
    i = w.waiter_index(ev.job)
    if i is not None:
        w.queue[i] = msgspec.structs.replace(wr, enqueued_at_ms=w.queue[i].enqueued_at_ms)
        w.touch("waiter re-acquired")
        return
    if h is None and sw is None and not w.queue and w.active_job == ev.job:
        # Zero cost when alone: the context never left the accelerators.
        w.grant(wr, w.epoch + 1, restored=False)
        return
    if len(w.queue) >= lim.max_queue:
        w.refuse(ev.job, ev.request_id, ErrorCode.INVALID, f"group queue is full ({lim.max_queue} waiters)")
        return
    w.queue.append(wr)
    w.touch("enqueued")


def _on_release(w: _Work, ev: Release) -> None:
    h = w.holder
    if h is None or h.job != ev.job:
        sw = w.switch
        to = sw.to if h is None and sw is not None else None
        if sw is not None and to is not None and to.job == ev.job and to.request_id == ev.request_id:
            # Released before the grant arrived (a client that gave up): leave the switch target.
            w.notify(Dequeued(group=w.group, job=ev.job, request_id=ev.request_id, reason="released before grant"))
            w.switch = msgspec.structs.replace(sw, to=None)
            w.touch("switch target released")
            return
        w.refuse(ev.job, ev.request_id, ErrorCode.NOT_HOLDER,
                 f"job {ev.job!r} does not hold group {w.group!r}")
        return
    if ev.epoch != h.epoch:
        w.refuse(ev.job, ev.request_id, ErrorCode.STALE_EPOCH,
                 f"epoch {ev.epoch} is not the current epoch {h.epoch}")
        return
    w.holder = None
    pending = len(w.queue)
    w.notify(Released(group=w.group, job=ev.job, request_id=ev.request_id, epoch=h.epoch,
                      pending_waiters=pending, snapshot_deferred=pending == 0))
    w.touch("released")


def _on_renew(w: _Work, ev: Renew) -> None:
    now = w.now
    if ev.epoch is not None:
        h = w.holder
        if h is not None and h.job == ev.job and h.epoch == ev.epoch:
            w.holder = msgspec.structs.replace(h, confirmed=True, lease_deadline_ms=now + h.lease_ms)
            w.touch("lease renewed")
        elif h is not None and h.job == ev.job:
            w.refuse(ev.job, ev.request_id, ErrorCode.STALE_EPOCH, f"epoch {ev.epoch} is not {h.epoch}")
        else:
            w.refuse(ev.job, ev.request_id, ErrorCode.NOT_HOLDER, f"job {ev.job!r} no longer holds the group")
        return
    for i, wr in enumerate(w.queue):
        if wr.request_id == ev.request_id:
            w.queue[i] = msgspec.structs.replace(wr, alive_until_ms=now + wr.waiter_ttl_ms)
            w.touch("waiter renewed")
            return
    sw = w.switch
    if sw is not None and sw.to is not None and sw.to.request_id == ev.request_id:
        to = msgspec.structs.replace(sw.to, alive_until_ms=now + sw.to.waiter_ttl_ms)
        w.switch = msgspec.structs.replace(sw, to=to)
        w.touch("waiter renewed")
        return
    h = w.holder
    if h is not None and h.request_id == ev.request_id:
        # Granted meanwhile; the grant notice is on its way. Until the grant is confirmed it is still the
        # waiter's place, kept alive by the waiter's renewals like any place in the queue: a grant decided
        # at an old stream time (a release made while the orchestrator was down) is not revoked on arrival.
        if not h.confirmed and now + h.waiter_ttl_ms > h.lease_deadline_ms:
            w.holder = msgspec.structs.replace(h, lease_deadline_ms=now + h.waiter_ttl_ms)
            w.touch("granted waiter renewed")
        return
    w.notify(Dequeued(group=w.group, job=ev.job, request_id=ev.request_id, reason="not waiting"))


def _on_cancel(w: _Work, ev: Cancel) -> None:
    for i, wr in enumerate(w.queue):
        if wr.request_id == ev.request_id and wr.job == ev.job:
            w.drop_waiter(i, ev.reason)
            return
    sw = w.switch
    if sw is not None and sw.to is not None and sw.to.request_id == ev.request_id and sw.to.job == ev.job:
        w.notify(Dequeued(group=w.group, job=ev.job, request_id=ev.request_id, reason=ev.reason))
        w.switch = msgspec.structs.replace(sw, to=None)
        w.touch(f"waiter {ev.reason}")
        return
    h = w.holder
    if h is not None and h.request_id == ev.request_id and h.job == ev.job:
        # The grant crossed the cancel: the caller will never use it, so it is released.
        w.holder = None
        pending = len(w.queue)
        w.notify(Released(group=w.group, job=ev.job, request_id=ev.request_id, epoch=h.epoch,
                          pending_waiters=pending, snapshot_deferred=pending == 0))
        w.touch(f"grant {ev.reason}")


def _on_phase(w: _Work, ev: Phase) -> None:
    """Phase events are facts for people and replay; they do not change the lock."""


def _on_tick(w: _Work, ev: Tick) -> None:
    """Expiries are evaluated for every event; a tick is an event that carries only time."""


def _on_clear_fault(w: _Work, ev: ClearFault) -> None:
    if w.faulted.pop(ev.job, None) is not None:
        w.touch("fault cleared")


def _on_registered(w: _Work, ev: JobRegistered) -> None:
    nodes = w.placements.get(ev.job, ())
    if ev.node not in nodes:
        w.placements[ev.job] = (*nodes, ev.node)
    w.op_timeouts[f"{ev.node}/{ev.job}"] = ev.op_timeout_ms
    if ev.node in w.lost_nodes:  # the agent is back
        w.lost_nodes = tuple(n for n in w.lost_nodes if n != ev.node)
    if w.active_job == ev.job and ev.node not in w.loaded:
        w.loaded[ev.node] = ev.job
    sw = w.switch
    if (sw is not None and sw.phase is OpKind.RESTORE and sw.to is not None and sw.to.job == ev.job
            and w.loaded.get(ev.node) != ev.job and all(op.node != ev.node for op in sw.ops)):
        # The incoming job appeared on one more node while its restores run: restore it there too.
        op = w.op(OpKind.RESTORE, ev.node, ev.job, sw.epoch, suffix=f":{w.seq}")  # unique if re-registered
        w.switch = msgspec.structs.replace(sw, ops=(*sw.ops, op), restored=True)
    w.touch("job registered")


def _on_unregistered(w: _Work, ev: JobUnregistered) -> None:
    nodes = tuple(n for n in w.placements.get(ev.job, ()) if n != ev.node)
    if nodes:
        w.placements[ev.job] = nodes
    else:
        w.placements.pop(ev.job, None)
    w.op_timeouts.pop(f"{ev.node}/{ev.job}", None)
    w.unsave(ev.job, ev.node)
    if w.loaded.get(ev.node) == ev.job:
        del w.loaded[ev.node]
    _fail_ops(w, lambda op: op.node == ev.node and op.job == ev.job, f"job unregistered from node {ev.node}")
    w.touch("job unregistered")


def _on_op_result(w: _Work, ev: OpResult) -> None:
    sw = w.switch
    if sw is None or sw.epoch != ev.epoch:
        return  # a late answer from an earlier switch: fenced off
    for op in sw.ops:
        if op.op_id == ev.op_id:
            w.op_done(op, ok=ev.ok, error=ev.error)
            return


def _on_agent_lost(w: _Work, ev: AgentLost) -> None:
    _fail_ops(w, lambda op: op.node == ev.node, f"agent on node {ev.node} was lost during the operation")
    if ev.node not in w.lost_nodes:
        w.lost_nodes = (*w.lost_nodes, ev.node)
        w.touch("agent lost")
    for job, nodes in list(w.placements.items()):
        if ev.node in nodes and ev.node not in w.saved.get(job, ()):
            # A job whose context is saved there keeps the placement: that context still has to come back.
            rest = tuple(n for n in nodes if n != ev.node)
            if rest:
                w.placements[job] = rest
            else:
                del w.placements[job]
            w.op_timeouts.pop(f"{ev.node}/{job}", None)
            w.touch("agent lost")
    if w.loaded.pop(ev.node, None) is not None:
        w.touch("agent lost")


def _fail_ops(w: _Work, pred: Callable[[OpRecord], bool], error: str) -> None:
    sw = w.switch
    if sw is None:
        return
    for op in sw.ops:
        if pred(op):
            w.op_done(op, ok=False, error=error)


_HANDLERS: dict[type[Any], Callable[[_Work, Any], None]] = {
    Acquire: _on_acquire,
    Release: _on_release,
    Renew: _on_renew,
    Cancel: _on_cancel,
    Phase: _on_phase,
    Tick: _on_tick,
    ClearFault: _on_clear_fault,
    JobRegistered: _on_registered,
    JobUnregistered: _on_unregistered,
    OpResult: _on_op_result,
    AgentLost: _on_agent_lost,
}
