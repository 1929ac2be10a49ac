"""The working copy a single ``apply`` mutates, and the actions it produces (private to the core).

The handlers that change the working copy, one per input event type, are in ``_handlers``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import get_origin

import msgspec
from timeslice_client.protocol import (
    DEFAULT_OP_TIMEOUT_MS,
    AgentCommand,
    Cycle,
    DequeueCode,
    Dequeued,
    ErrorCode,
    FairPick,
    Granted,
    GroupRecord,
    GroupState,
    HolderRecord,
    Notice,
    OpKind,
    OpRecord,
    Prediction,
    Refused,
    Reservation,
    Restore,
    RevokeCode,
    Revoked,
    Snapshot,
    StateChanged,
    SwitchRecord,
    TrailRecord,
    Usage,
    WaiterRecord,
)

from ._fair_share import charge, choose, describe
from ._limits import LIMITS, Limits
from ._predict import ended_ahead, note_switched_in, start_ahead_due, switch_target

__all__ = ["LIMITS", "Action", "Command", "Limits", "Notify", "Transition", "Work"]


class Notify(msgspec.Struct, frozen=True):
    notice: Notice


class Command(msgspec.Struct, frozen=True):
    command: AgentCommand


class Transition(msgspec.Struct, frozen=True):
    change: StateChanged


Action = Notify | Command | Transition

# What a Work mirrors of its record: every field but the sequence number of the event last applied; the dicts
# among them are copied (the handlers change them in place).
_RECORD_FIELDS = tuple(f.name for f in msgspec.structs.fields(GroupRecord) if f.name != "last_seq")
_RECORD_DICTS = tuple(f.name for f in msgspec.structs.fields(GroupRecord) if get_origin(f.type) is dict)


@dataclass
class Work:
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
    trailing: TrailRecord | None = None
    quantum_ms: int = 0  # the group's policy (``SetPolicy``) and the last hold asked to yield (``_quantum``)
    yield_asked_epoch: int = 0
    min_hold_ms: int = 0  # the group's minimum hold (``SetPolicy``) and the job the group is kept for (``_min_hold``)
    reserved: Reservation | None = None
    predict: bool = False  # the predictive restore (``SetPolicy``, ``_predict``): its policy, history and plan
    cycles: dict[str, Cycle] = field(default_factory=dict)
    plan: Prediction | None = None
    restored_ahead: str | None = None
    shares: dict[str, int] = field(default_factory=dict)  # weighted fair share (``SetPolicy``, ``_fair_share``)
    usage: dict[str, Usage] = field(default_factory=dict)
    picked: FairPick | None = None
    actions: list[Action] = field(default_factory=list)
    changed: bool = False
    reason: str = ""
    # Decisions of this event said in its StateChanged whatever follows them (a minimum hold that ended, a waiter put
    # first by fair share), in order.
    notes: list[str] = field(default_factory=list)
    seq: int = 0
    limits: Limits = LIMITS

    @classmethod
    def of(cls, rec: GroupRecord, now: int, limits: Limits = LIMITS) -> Work:
        """A working copy of every field of ``rec`` (``finish`` sets ``last_seq``): its dicts and queue are copied, as
        the handlers change them in place and ``rec`` stays as it was read. A field added to the record but not to
        ``Work`` fails the first ``apply`` instead of being dropped silently."""
        fields = msgspec.structs.asdict(rec)
        del fields["last_seq"]
        for name in _RECORD_DICTS:
            fields[name] = dict(fields[name])
        fields["queue"] = list(rec.queue)
        return cls(now=now, limits=limits, **fields)

    def finish(self, rec: GroupRecord, seq: int) -> tuple[GroupRecord, list[Action]]:
        """The record after the event applied as ``seq`` (``rec`` itself when nothing changed) and the actions."""
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
                        reason="; then ".join([*self.notes, *([self.reason] if self.reason not in self.notes else [])]),
                    )
                )
            )
        mine = vars(self)
        fields = {name: mine[name] for name in _RECORD_FIELDS}
        fields.update(state=state, since_ms=since, queue=tuple(self.queue), last_seq=seq)
        new = GroupRecord(**fields)
        return new, self.actions

    def _derive_state(self) -> GroupState:
        if self.holder is not None:
            return GroupState.LOCKED
        if self.switch is not None or (self.trailing is not None and self.queue):
            return GroupState.SWITCHING  # (a waiter's switch starts once the trailing snapshots ended)
        if self.active_job is not None:
            return GroupState.IDLE_YIELDED
        return GroupState.IDLE

    # ------------------------------------------------------------------ helpers

    def notify(self, notice: Notice) -> None:
        self.actions.append(Notify(notice))

    def refuse(self, job: str, request_id: str, code: ErrorCode, message: str, *, limit: int = 0) -> None:
        self.notify(
            Refused(
                group=self.group,
                job=job,
                request_id=request_id,
                code=code,
                message=message,
                holder=self.holder.job if self.holder else None,
                epoch=self.epoch,
                limit=limit,
            )
        )

    def touch(self, reason: str) -> None:
        self.changed = True
        self.reason = reason

    def note(self, decision: str) -> None:
        """A decision that the StateChanged of this event says, whatever is done after it."""
        self.notes.append(decision)
        self.touch(decision)

    def ended(self, h: HolderRecord) -> None:
        """``h``'s hold ended now (released, or taken back): with fair share on, its time counts to its job's usage."""
        self.holder = None
        if self.shares:
            charge(self.usage, h.job, self.now - h.granted_at_ms, self.now, self.limits)

    def waiter_index(self, job: str) -> int | None:
        for i, wr in enumerate(self.queue):
            if wr.job == job:
                return i
        return None

    def grant(self, wr: WaiterRecord, epoch: int, restored: bool, *, switched: bool = False) -> None:
        """``switched``: by a switch (the minimum hold applies to it: ``_min_hold``)."""
        if self.reserved is not None and self.reserved.job == wr.job:
            self.reserved = None  # it took its group back
        self.epoch = epoch
        self.holder = HolderRecord(
            job=wr.job,
            request_id=wr.request_id,
            epoch=epoch,
            granted_at_ms=self.now,
            lease_ms=wr.lease_ms,
            lease_deadline_ms=self.now + min(wr.confirm_ms, wr.lease_ms),
            waiter_ttl_ms=wr.waiter_ttl_ms,
            waited_ms=max(0, self.now - wr.enqueued_at_ms),
            restored=restored,
            switched=switched,
        )
        self.active_job = wr.job
        self.restored_ahead = None
        self.plan = None
        self.notify_grant(self.holder)
        self.touch("granted")

    def notify_grant(self, h: HolderRecord) -> None:
        """Tell the holder of its grant: at the grant, and again whenever the grantee shows that it has not heard
        of it yet (a renewal of its wait: notices are at most once, a grant notice can be lost)."""
        self.notify(
            Granted(
                group=self.group,
                job=h.job,
                request_id=h.request_id,
                epoch=h.epoch,
                waited_ms=h.waited_ms,
                context_restored=h.restored,
                lease_deadline_ms=h.lease_deadline_ms,
                waiters=len(self.queue),
                min_hold_ms=self.min_hold_left(h),
            )
        )

    def min_hold_left(self, h: HolderRecord) -> int:
        """What is left of ``h``'s minimum hold now (ms; 0: none): only a hold granted through a switch has one."""
        return max(0, h.granted_at_ms + self.min_hold_ms - self.now) if h.switched and self.min_hold_ms > 0 else 0

    def dequeued(self, job: str, request_id: str, reason: str, code: DequeueCode) -> None:
        """Tell a waiter its wait ended (``Dequeued``); ``lost`` when no renewal of it came in time, or a renewal
        named a wait the group does not know (the client may simply ask again)."""
        lost = code in (DequeueCode.LOST, DequeueCode.NOT_WAITING)
        self.notify(Dequeued(group=self.group, job=job, request_id=request_id, reason=reason, lost=lost, code=code))

    def drop_waiter(self, i: int, code: DequeueCode, reason: str) -> None:
        wr = self.queue.pop(i)
        self.dequeued(wr.job, wr.request_id, reason, code)
        self.touch(f"waiter {reason}")

    def unsave(self, job: str, node: str) -> None:
        rest = tuple(n for n in self.saved.get(job, ()) if n != node)
        if rest:
            self.saved[job] = rest
        else:
            self.saved.pop(job, None)

    def unreserve(self, job: str | None, why: str) -> None:
        """End the group's reservation (``_min_hold``) if it is ``job``'s (None: whoever's): the next waiter is served
        by ``advance`` as usual."""
        r = self.reserved
        if r is not None and job in (None, r.job):
            self.reserved = None
            self.note(f"min hold of {r.job} ended: {why}")

    def fault(self, job: str, reason: str) -> None:
        if len(reason) > self.limits.max_reason:
            reason = reason[: self.limits.max_reason - 1] + "…"
        self.faulted[job] = reason
        self.touch("job faulted")
        self.unreserve(job, "faulted")
        i = self.waiter_index(job)
        if i is not None:
            self.drop_waiter(i, DequeueCode.FAULTED, f"faulted: {reason}")
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
            revoke = RevokeCode.LEASE_EXPIRED if h.confirmed else RevokeCode.GRANT_UNCONFIRMED
            self.notify(Revoked(group=self.group, job=h.job, epoch=h.epoch, reason=why, code=revoke))
            self.ended(h)
            self.touch(why)
        if self.reserved is not None and now >= self.reserved.until_ms:
            self.unreserve(None, "its window passed")
        for i in range(len(self.queue) - 1, -1, -1):
            wr = self.queue[i]
            if now >= wr.deadline_ms:
                self.drop_waiter(i, DequeueCode.TIMEOUT, "timeout")
            elif now >= wr.alive_until_ms and (fresh := self._unheard(wr)) is not None:
                self.queue[i] = fresh
            elif now >= wr.alive_until_ms:
                self.drop_waiter(i, DequeueCode.LOST, "waiter lost (no renewal)")
        for op in self.trailing.ops if self.trailing is not None else ():
            if now >= op.deadline_ms:
                self.op_done(op, ok=False, error=f"{op.kind} on node {op.node} timed out")
        sw = self.switch
        if sw is None:
            return
        if (
            sw.to is not None
            and sw.to.deadline_ms > now >= sw.to.alive_until_ms
            and (fresh := self._unheard(sw.to)) is not None
        ):
            self.switch = sw = msgspec.structs.replace(sw, to=fresh)
        if sw.to is not None and now >= min(sw.to.deadline_ms, sw.to.alive_until_ms):
            to = sw.to
            code = DequeueCode.TIMEOUT if now >= to.deadline_ms else DequeueCode.LOST
            why = "timeout" if code is DequeueCode.TIMEOUT else "waiter lost (no renewal)"
            self.dequeued(to.job, to.request_id, why, code)
            self.switch = sw = msgspec.structs.replace(sw, to=None)
            self.touch(f"waiter {why}")
        for op in sw.ops:
            if now >= op.deadline_ms:
                self.op_done(op, ok=False, error=f"{op.kind} on node {op.node} timed out")

    def _unheard(self, wr: WaiterRecord) -> WaiterRecord | None:
        """``wr`` with one fresh liveness window when its deadline passed long before this check (the lock could not
        hear: ``Limits.deaf_after_ms``) and it has had none since its last renewal; else None (it is silent)."""
        if wr.forgiven or self.now - wr.alive_until_ms <= self.limits.deaf_after_ms:
            return None
        self.touch("waiter not heard while the lock could not hear: a fresh window")
        return msgspec.structs.replace(wr, alive_until_ms=self.now + wr.waiter_ttl_ms, forgiven=True)

    # ------------------------------------------------------------------ switching

    def advance(self) -> None:
        """Move the group forward: finish a switch whose operations are done, or start the next one."""
        while True:
            sw = self.switch
            if sw is not None:
                if sw.ops and not self._beside_only(sw):
                    return
                target = switch_target(sw)
                if sw.phase is OpKind.SNAPSHOT and target is not None and target not in self.faulted:
                    self.start_restores(sw)
                    continue
                self.switch = None
                to = sw.to
                if to is not None and to.job not in self.faulted:
                    if sw.ops:  # grant on restore: the outgoing snapshots trail the grant
                        self.trailing = TrailRecord(epoch=sw.epoch, ops=sw.ops)
                    note_switched_in(self, to.job, sw.started_at_ms)
                    self.grant(to, sw.epoch, sw.restored, switched=True)
                    return
                if to is not None:
                    self.refuse(to.job, to.request_id, ErrorCode.JOB_FAULTED, self.faulted[to.job])
                if to is None and sw.ahead is not None:
                    ended_ahead(self, sw)
                else:
                    self.touch("switch ended without grant")
                continue
            if self.holder is not None or not self.queue or self.trailing is not None or self.reserved is not None:
                # (no switch while snapshots trail: its restores would make a third context; nor while reserved)
                if start_ahead_due(self):
                    continue
                return
            i, pick = choose(self.queue, self.now, self.limits, self.shares, self.usage)
            wr = self.queue.pop(i)
            self.touch("next waiter")
            if wr.job in self.faulted:
                self.refuse(wr.job, wr.request_id, ErrorCode.JOB_FAULTED, self.faulted[wr.job])
                continue
            if pick is not None:
                self.picked = pick
                self.note(describe(pick))
            self.start_switch(wr)

    def _beside_only(self, sw: SwitchRecord) -> bool:
        """Grant on restore: whether the incoming job may be granted although operations of ``sw`` are pending. Only
        when every one is a snapshot on a node where the incoming job's restore succeeded beside it, by the agent's
        room rule (``OpResult.overlapped``), and its context counts as loaded there now."""
        to = sw.to
        return (
            to is not None
            and to.job not in self.faulted
            and sw.phase is OpKind.RESTORE
            and all(
                op.kind is OpKind.SNAPSHOT and op.node in sw.beside and self.loaded.get(op.node) == to.job
                for op in sw.ops
            )
        )

    def start_switch(self, wr: WaiterRecord | None, ahead: str | None = None) -> None:
        """Snapshot every loaded context that is not the incoming job's and, in the same breath, restore the
        incoming job where it is registered: each restore names the snapshots on its own node that the agent
        finishes first (``Restore.after``), so the restores wait for no round trip through the orchestrator.
        ``ahead`` instead of a waiter: a predictive restore of that job (``_predict``), which nobody waits for."""
        incoming = wr.job if wr is not None else ahead
        assert incoming is not None
        epoch = self.epoch + 1
        self.epoch = epoch
        ops: list[OpRecord] = []
        for node, job in sorted(self.loaded.items()):
            if job != incoming:
                ops.append(self.op(OpKind.SNAPSHOT, node, job, epoch))
        if self.active_job != incoming:
            self.active_job = None
        self.restored_ahead = None
        self.switch = SwitchRecord(
            to=wr, epoch=epoch, phase=OpKind.SNAPSHOT, ops=tuple(ops), started_at_ms=self.now, ahead=ahead
        )
        self.touch("switching" if wr is not None else f"restoring {ahead} ahead of its ask")
        self.start_restores(self.switch)

    def start_restores(self, sw: SwitchRecord) -> None:
        """Issue the incoming job's restores (``phase`` becomes RESTORE: restores are issued). Snapshots still
        pending stay in the switch; a restore on a node where one runs is ordered after it."""
        job = switch_target(sw)
        assert job is not None
        stranded = [n for n in self.saved.get(job, ()) if n in self.lost_nodes]
        if stranded:
            # Its state is offloaded on a node whose agent is gone: granting now would hand it freed memory.
            self.switch = msgspec.structs.replace(sw, phase=OpKind.RESTORE)
            self.fault(
                job,
                f"its context is saved on node {stranded[0]}, whose agent was lost; restart the agent "
                "there, then clear the fault",
            )
            return
        ops = [
            self.restore_op(sw, node, job)
            for node in sorted(self.placements.get(job, ()))
            if self.loaded.get(node) != job and node not in self.lost_nodes  # a lost node's agent restores nothing
        ]
        self.switch = msgspec.structs.replace(sw, phase=OpKind.RESTORE, ops=(*sw.ops, *ops))
        self.touch("restoring")

    def resend_due(self) -> None:
        """Send again the running switch's commands that are unanswered for ``Limits.resend_ms`` (after the event's
        own changes: only operations still pending go out). A command published while the stream could not store it
        never reached its agent; one that did is answered once more with the same outcome."""
        now = self.now
        due = {op.op_id for op in self.pending_ops() if op.resend_at_ms and now >= op.resend_at_ms}
        if not due:
            return
        self._set_resend_at(due, now + self.limits.resend_ms)
        for op in self.pending_ops():
            if op.op_id in due:
                self.resend(op)
        self.touch("operations sent again")

    def pending_ops(self) -> tuple[OpRecord, ...]:
        """The running switch's operations, or the snapshots trailing the last grant (never both at once)."""
        if self.trailing is not None:
            return self.trailing.ops
        return self.switch.ops if self.switch is not None else ()

    def _set_resend_at(self, op_ids: set[str], at: int) -> None:
        def again(ops: tuple[OpRecord, ...]) -> tuple[OpRecord, ...]:
            return tuple(msgspec.structs.replace(o, resend_at_ms=at) if o.op_id in op_ids else o for o in ops)

        if self.trailing is not None:
            self.trailing = msgspec.structs.replace(self.trailing, ops=again(self.trailing.ops))
        elif self.switch is not None:
            self.switch = msgspec.structs.replace(self.switch, ops=again(self.switch.ops))

    def resend(self, op: OpRecord) -> None:
        """Send an operation of the running switch again, as it was sent (a restore after the snapshots still
        pending on its node). For an agent that registered the job anew: one that restarted has forgotten the
        commands it had taken; one that still runs the operation answers the same op id as before. Its next timed
        resend (``resend_due``) counts from now."""
        again = self.now + self.limits.resend_ms
        if op.resend_at_ms and op.resend_at_ms != again:
            self._set_resend_at({op.op_id}, again)
        tr = self.trailing
        if tr is not None:  # a trailing snapshot, at the epoch of the switch that granted on restore
            self.actions.append(self._command(op, tr.epoch))
            return
        sw = self.switch
        assert sw is not None
        after = tuple(o.op_id for o in sw.ops if o.node == op.node and o.kind is OpKind.SNAPSHOT)
        self.actions.append(self._command(op, sw.epoch, after))

    def restore_op(self, sw: SwitchRecord, node: str, job: str, suffix: str = "") -> OpRecord:
        """A restore of ``job`` on ``node``, after the switch's snapshots still pending there; its deadline
        counts from when they are due at the latest."""
        first = tuple(op for op in sw.ops if op.node == node and op.kind is OpKind.SNAPSHOT)
        start = max((op.deadline_ms for op in first), default=self.now)
        return self.op(
            OpKind.RESTORE, node, job, sw.epoch, suffix, after=tuple(op.op_id for op in first), start_ms=start
        )

    def op(
        self,
        kind: OpKind,
        node: str,
        job: str,
        epoch: int,
        suffix: str = "",
        *,
        after: tuple[str, ...] = (),
        start_ms: int | None = None,
    ) -> OpRecord:
        timeout = self.op_timeouts.get(f"{node}/{job}", DEFAULT_OP_TIMEOUT_MS)
        op = OpRecord(
            op_id=f"{self.group}:{epoch}:{kind}:{node}{suffix}",
            node=node,
            job=job,
            kind=kind,
            deadline_ms=(self.now if start_ms is None else start_ms) + timeout,
            resend_at_ms=self.now + self.limits.resend_ms,
        )
        self.actions.append(self._command(op, epoch, after))
        return op

    def _command(self, op: OpRecord, epoch: int, after: tuple[str, ...] = ()) -> Command:
        """The agent's command for ``op`` at ``epoch`` (a restore after the snapshot operations ``after`` names): one
        builder, so that an operation sent again is the command first sent."""
        make: Callable[..., AgentCommand] = Snapshot if op.kind is OpKind.SNAPSHOT else partial(Restore, after=after)
        return Command(
            make(op_id=op.op_id, group=self.group, job=op.job, node=op.node, epoch=epoch, deadline_ms=op.deadline_ms)
        )

    def op_done(self, op: OpRecord, *, ok: bool, error: str | None, fault: bool = True, beside: bool = False) -> None:
        """An operation of the running switch, or a trailing snapshot, ended. ``fault=False``: it failed because its
        job left the node (nothing is left there to move), which does not fault the job. ``beside``: a restore
        that ran beside the snapshots on its node (the agent's room rule, ``OpResult.overlapped``).

        A trailing snapshot that fails faults its job as any failed snapshot does: its context was rolled back and
        stays on the device beside the holder's, but a faulted job is never granted, so only the holder runs."""
        tr = self.trailing
        if tr is not None and any(o.op_id == op.op_id for o in tr.ops):
            left = tuple(o for o in tr.ops if o.op_id != op.op_id)
            self.trailing = msgspec.structs.replace(tr, ops=left) if left else None
        else:
            sw = self.switch
            assert sw is not None
            restored = sw.restored or (ok and op.kind is OpKind.RESTORE)  # the grant says a context came back
            near = (
                (*sw.beside, op.node)
                if ok and beside and op.kind is OpKind.RESTORE and op.node not in sw.beside
                else sw.beside
            )
            self.switch = msgspec.structs.replace(
                sw, ops=tuple(o for o in sw.ops if o.op_id != op.op_id), restored=restored, beside=near
            )
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
        if op.node in self.lost_nodes and op.node not in self.saved.get(op.job, ()):
            # The job's placement on a lost node was kept only while this operation was pending there.
            rest = tuple(n for n in self.placements.get(op.job, ()) if n != op.node)
            if rest:
                self.placements[op.job] = rest
            else:
                self.placements.pop(op.job, None)
            self.op_timeouts.pop(f"{op.node}/{op.job}", None)
        if not ok and fault:
            self.fault(op.job, error or f"{op.kind} failed on node {op.node}")
        self.touch(f"{op.kind} {'done' if ok else 'failed' if fault else 'ended: job gone'}")
