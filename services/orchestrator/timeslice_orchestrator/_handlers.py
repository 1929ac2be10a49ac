"""One handler per input event type: how each event changes a group's working copy (private to the core)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from timeslice_client.protocol import (
    Acquire,
    AgentLost,
    Cancel,
    ClearFault,
    Contended,
    DequeueCode,
    ErrorCode,
    Granted,
    JobRegistered,
    JobUnregistered,
    OpKind,
    OpRecord,
    OpResult,
    Phase,
    Release,
    Released,
    Renew,
    RevokeCode,
    Revoked,
    SetPolicy,
    Tick,
    WaiterRecord,
)

from ._min_hold import grant_reserved, reserve_on_release
from ._predict import note_ask, note_phase, note_release
from ._work import Limits, Work

__all__ = ["HANDLERS"]


def _on_acquire(w: Work, ev: Acquire) -> None:
    if ev.claim_epoch is not None:
        _on_claim(w, ev)
        return
    lim = w.limits
    why = _invalid(ev, lim)
    if why is not None:
        w.refuse(ev.job, ev.request_id, ErrorCode.INVALID, why)
        return
    if ev.job in w.faulted:
        w.refuse(ev.job, ev.request_id, ErrorCode.JOB_FAULTED, w.faulted[ev.job])
        return
    note_ask(w, ev.job)  # (a predictive restore planned and not started yet is dropped: a job asked first)
    now = w.now
    h = w.holder
    if h is not None and h.job == ev.job:
        # The holder asks again (a retry, or a nested acquire): same grant, and proof of life.
        w.holder = msgspec.structs.replace(
            h, request_id=ev.request_id, confirmed=True, lease_ms=ev.lease_ms, lease_deadline_ms=now + ev.lease_ms
        )
        w.notify(
            Granted(
                group=w.group,
                job=ev.job,
                request_id=ev.request_id,
                epoch=h.epoch,
                waited_ms=0,
                context_restored=False,
                lease_deadline_ms=now + ev.lease_ms,
                waiters=len(w.queue),
                min_hold_ms=w.min_hold_left(h),
            )
        )
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
        priority=ev.priority,
    )
    if grant_reserved(w, wr):  # the group was kept for it (its minimum hold): no switch, ahead of the waiters
        return
    sw = w.switch
    if sw is not None and sw.to is not None and sw.to.job == ev.job:
        w.switch = msgspec.structs.replace(sw, to=msgspec.structs.replace(wr, enqueued_at_ms=sw.to.enqueued_at_ms))
        w.touch("waiter re-acquired")
        return
    if sw is not None and sw.to is None and sw.ahead == ev.job and not w.queue:
        # The job a predictive restore brings back asks while it runs: the switch is its own now.
        w.switch = msgspec.structs.replace(sw, to=wr)
        w.touch("the predicted job asked")
        return
    i = w.waiter_index(ev.job)
    if i is not None:
        w.queue[i] = msgspec.structs.replace(wr, enqueued_at_ms=w.queue[i].enqueued_at_ms)
        w.touch("waiter re-acquired")
        return
    if h is None and sw is None and not w.queue and w.active_job == ev.job:
        # Zero cost when alone: the context never left the accelerators (or a predictive restore brought it back).
        w.grant(wr, w.epoch + 1, restored=w.restored_ahead == ev.job)
        return
    if len(w.queue) >= lim.max_queue:
        w.refuse(
            ev.job,
            ev.request_id,
            ErrorCode.QUEUE_FULL,
            f"group queue is full ({lim.max_queue} waiters)",
            limit=lim.max_queue,
        )
        return
    w.queue.append(wr)
    w.touch("enqueued")
    if h is not None and len(w.queue) == 1:
        # The first waiter: the holder's workloads may begin their suspend at its release (see
        # WorkloadChannel.suspend_early). Later waiters are no news to it, nor to a holder granted while others
        # waited (Granted.waiters).
        w.notify(Contended(group=w.group, job=h.job, epoch=h.epoch, waiters=len(w.queue)))


def _invalid(ev: Acquire, lim: Limits) -> str | None:
    """What is out of range in an acquire's durations (None: nothing)."""
    if not (lim.min_lease_ms <= ev.lease_ms <= lim.max_lease_ms):
        return f"lease_ms={ev.lease_ms} is outside [{lim.min_lease_ms}, {lim.max_lease_ms}]"
    if not (lim.min_ttl_ms <= ev.waiter_ttl_ms <= lim.max_ttl_ms and lim.min_ttl_ms <= ev.confirm_ms <= lim.max_ttl_ms):
        return f"waiter_ttl_ms/confirm_ms must lie in [{lim.min_ttl_ms}, {lim.max_ttl_ms}]"
    if not (0 <= ev.timeout_ms <= lim.max_timeout_ms):
        return f"timeout_ms={ev.timeout_ms} is out of range"
    return None


def _unclaimable(w: Work, ev: Acquire) -> str | None:
    """Why a claim cannot be the zero-cost grant it assumes (None: it is exactly that)."""
    why = _invalid(ev, w.limits)
    if why is not None:
        return why
    if ev.job in w.faulted:
        return f"the job is faulted ({w.faulted[ev.job]})"
    if w.holder is not None:
        return f"job {w.holder.job!r} holds the group at epoch {w.holder.epoch}"
    if w.switch is not None:
        return "a switch is running"
    if w.queue:
        return f"{len(w.queue)} job(s) wait for the group"
    if w.active_job != ev.job:
        return f"the active job is {w.active_job!r}"
    if ev.claim_epoch != w.epoch + 1:
        return f"the next epoch is {w.epoch + 1}"
    return None


def _on_claim(w: Work, ev: Acquire) -> None:
    """A claim (``Acquire.claim_epoch``): the job released with nobody waiting and its acquire is the group's next
    job input, so it is granted at once, at the epoch the client already took. The stream's sequence check makes
    every other outcome impossible (the property tests show it); should one happen all the same, the claimed
    hold is revoked, which the client sees as a lost lease, and the stream checker reports the violation."""
    assert ev.claim_epoch is not None
    why = _unclaimable(w, ev)
    if why is None:
        note_ask(w, ev.job)
        now = w.now
        w.grant(
            WaiterRecord(
                job=ev.job,
                request_id=ev.request_id,
                enqueued_at_ms=now,
                deadline_ms=now,
                alive_until_ms=now + ev.waiter_ttl_ms,
                lease_ms=ev.lease_ms,
                waiter_ttl_ms=ev.waiter_ttl_ms,
                confirm_ms=ev.confirm_ms,
            ),
            ev.claim_epoch,
            restored=False,
        )
        return
    reason = f"claim of epoch {ev.claim_epoch} not honoured: {why}; acquire again"
    w.refuse(ev.job, ev.request_id, ErrorCode.INVALID, reason)
    w.notify(Revoked(group=w.group, job=ev.job, epoch=ev.claim_epoch, reason=reason, code=RevokeCode.CLAIM_REFUSED))
    w.touch("claim not honoured")


def _on_release(w: Work, ev: Release) -> None:
    h = w.holder
    if h is None or h.job != ev.job:
        sw = w.switch
        to = sw.to if h is None and sw is not None else None
        if sw is not None and to is not None and to.job == ev.job and to.request_id == ev.request_id:
            # Released before the grant arrived (a client that gave up): leave the switch target.
            w.dequeued(ev.job, ev.request_id, "released before grant", DequeueCode.RELEASED_BEFORE_GRANT)
            w.switch = msgspec.structs.replace(sw, to=None)
            w.touch("switch target released")
            return
        w.refuse(ev.job, ev.request_id, ErrorCode.NOT_HOLDER, f"job {ev.job!r} does not hold group {w.group!r}")
        return
    if ev.epoch != h.epoch:
        w.refuse(ev.job, ev.request_id, ErrorCode.STALE_EPOCH, f"epoch {ev.epoch} is not the current epoch {h.epoch}")
        return
    reserve_on_release(w, h)  # the group kept for it (its minimum hold: ``_min_hold``), its snapshot deferred
    _released(w, ev.job, ev.request_id, h.epoch, "released")


def _released(w: Work, job: str, request_id: str, epoch: int, why: str) -> None:
    """The holder lets the group go (its release, or a cancel that its grant crossed): ``Released``, with how many
    wait behind it."""
    assert w.holder is not None
    w.ended(w.holder)
    pending = len(w.queue)
    ahead = note_release(w, job)  # (with the policy on and nobody waiting: the predictive restore's plan)
    w.notify(
        Released(
            group=w.group,
            job=job,
            request_id=request_id,
            epoch=epoch,
            pending_waiters=pending,
            snapshot_deferred=pending == 0 or w.reserved is not None,
            ahead=ahead,
        )
    )
    if w.reserved is None:  # (else the reason says why it was kept)
        w.touch(why)


def _on_renew(w: Work, ev: Renew) -> None:
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
            w.queue[i] = msgspec.structs.replace(wr, alive_until_ms=now + wr.waiter_ttl_ms, forgiven=False)
            w.touch("waiter renewed")
            return
    sw = w.switch
    if sw is not None and sw.to is not None and sw.to.request_id == ev.request_id:
        to = msgspec.structs.replace(sw.to, alive_until_ms=now + sw.to.waiter_ttl_ms, forgiven=False)
        w.switch = msgspec.structs.replace(sw, to=to)
        w.touch("waiter renewed")
        return
    h = w.holder
    if h is not None and h.request_id == ev.request_id and h.job == ev.job:
        # Granted, but the grantee still renews its wait: it has not heard of the grant (the notice is on its
        # way, or it was lost: notices are at most once, and a client cut off at the grant misses it). So the
        # grant is sent again, and until it is confirmed it is still the waiter's place, kept alive by the
        # waiter's renewals like any place in the queue: a grant decided at an old stream time (a release made
        # while the orchestrator was down) is not revoked on arrival. A duplicate grant is harmless: the client
        # takes the first one for its request id and ignores the others.
        # Kept up this way only ``Limits.max_grant_resends`` times: a grantee that renews but never hears (it can
        # publish but not receive) must not keep the group until its acquire timeout; its grant then lapses at its
        # deadline and passes on.
        if not h.confirmed and h.resends < w.limits.max_grant_resends:
            w.holder = h = msgspec.structs.replace(
                h, lease_deadline_ms=max(h.lease_deadline_ms, now + h.waiter_ttl_ms), resends=h.resends + 1
            )
            w.touch("granted waiter renewed")
            w.notify_grant(h)
        return
    w.dequeued(ev.job, ev.request_id, "not waiting", DequeueCode.NOT_WAITING)


def _on_cancel(w: Work, ev: Cancel) -> None:
    for i, wr in enumerate(w.queue):
        if wr.request_id == ev.request_id and wr.job == ev.job:
            w.drop_waiter(i, DequeueCode.CANCELLED, ev.reason)
            return
    sw = w.switch
    if sw is not None and sw.to is not None and sw.to.request_id == ev.request_id and sw.to.job == ev.job:
        w.dequeued(ev.job, ev.request_id, ev.reason, DequeueCode.CANCELLED)
        w.switch = msgspec.structs.replace(sw, to=None)
        w.touch(f"waiter {ev.reason}")
        return
    h = w.holder
    if h is not None and h.request_id == ev.request_id and h.job == ev.job:
        # The grant crossed the cancel: the caller will never use it, so it is released.
        _released(w, ev.job, ev.request_id, h.epoch, f"grant {ev.reason}")
        return
    # A wait that had ended already (its deadline, a grant released since): nothing changes, but the record is
    # stored at this input all the same, so that its job's status() can read it (it waits for the record's last_seq to
    # reach its cancel's; an input that changes nothing would leave it behind). Rare: a cancel races a wait's end.
    w.touch(f"{ev.reason}: the wait had ended")


def _on_phase(w: Work, ev: Phase) -> None:
    """Phase events are facts for people and replay; they never change the lock. With the predictive restore on, a
    phase start of a job away from the group is a cue for when it asks next (``_predict.note_phase``): learned, and
    it may plan the job's restore ahead of its ask, as a release may. With the policy off: nothing."""
    note_phase(w, ev.job, ev.name, start=ev.edge == "start")


def _on_tick(w: Work, ev: Tick) -> None:
    """Expiries are evaluated for every event; a tick is an event that carries only time."""


def _on_set_policy(w: Work, ev: SetPolicy) -> None:
    """A field left out (None) stays as it is. A minimum hold set lower (or off) leaves a running reservation as it
    was given: it ends at its own time."""
    if ev.quantum_ms is not None and ev.quantum_ms != w.quantum_ms:
        w.quantum_ms = ev.quantum_ms
        w.touch(f"policy set: quantum {ev.quantum_ms} ms")
    if ev.min_hold_ms is not None and ev.min_hold_ms != w.min_hold_ms:
        w.min_hold_ms = ev.min_hold_ms
        w.touch(f"policy set: min hold {ev.min_hold_ms} ms")
    if ev.predict is not None and ev.predict != w.predict:
        w.predict = ev.predict
        w.plan = None  # (on: the next idle release plans; off: a plan not started yet is dropped)
        if not ev.predict:
            w.cycles.clear()  # the history is kept only while the policy is on
        w.touch(f"policy set: predictive restore {'on' if ev.predict else 'off'}")
    shares = dict(sorted(ev.shares.items())) if ev.shares is not None else w.shares
    if shares != w.shares:  # (replaced by others: the usage stays; turned off: it is forgotten)
        w.shares = shares
        if not shares:
            w.usage.clear()
            w.picked = None
        w.touch(
            f"policy set: fair share, {len(shares)} job(s) with a share" if shares else "policy set: fair share off"
        )


def _on_clear_fault(w: Work, ev: ClearFault) -> None:
    if w.faulted.pop(ev.job, None) is not None:
        w.touch("fault cleared")


def _on_registered(w: Work, ev: JobRegistered) -> None:
    nodes = w.placements.get(ev.job, ())
    if ev.node not in nodes:
        if sum(len(n) for n in w.placements.values()) >= w.limits.max_placements:
            return  # the record is at its bound: the job runs on that node with the lock alone (no switch there)
        w.placements[ev.job] = (*nodes, ev.node)
    w.op_timeouts[f"{ev.node}/{ev.job}"] = ev.op_timeout_ms
    if ev.node in w.lost_nodes:  # the agent is back
        w.lost_nodes = tuple(n for n in w.lost_nodes if n != ev.node)
    if w.active_job == ev.job and ev.node not in w.loaded:
        w.loaded[ev.node] = ev.job
    sw = w.switch
    # The job's operations still pending on that node (the switch's, or snapshots trailing a grant) are sent again:
    # an agent announces its jobs when it restarts, and a restarted agent has forgotten the commands it had taken.
    # Without this, the switch would wait for their deadline, and then fault their jobs (the incoming one too) for
    # the agent's restart.
    for op in w.pending_ops():
        if op.node == ev.node and op.job == ev.job:
            w.resend(op)
    if (
        sw is not None
        and sw.phase is OpKind.RESTORE
        and sw.to is not None
        and sw.to.job == ev.job
        and w.loaded.get(ev.node) != ev.job
        and not any(op.node == ev.node and op.kind is OpKind.RESTORE for op in sw.ops)
    ):
        # The incoming job appeared on one more node while its restores run: restore it there too.
        op = w.restore_op(sw, ev.node, ev.job, suffix=f":{w.seq}")  # unique if re-registered
        w.switch = msgspec.structs.replace(sw, ops=(*sw.ops, op))
    w.touch("job registered")


def _on_unregistered(w: Work, ev: JobUnregistered) -> None:
    nodes = tuple(n for n in w.placements.get(ev.job, ()) if n != ev.node)
    if nodes:
        w.placements[ev.job] = nodes
    else:
        w.placements.pop(ev.job, None)
    w.op_timeouts.pop(f"{ev.node}/{ev.job}", None)
    w.unsave(ev.job, ev.node)
    if w.loaded.get(ev.node) == ev.job:
        del w.loaded[ev.node]
    w.unreserve(ev.job, f"it left node {ev.node}")  # its context there went with its process
    # The job left the node (its process ended or it closed its channel), so its context there is gone with
    # it: a snapshot of it ends without faulting the job (it may come back and register again). A restore of
    # the incoming job cannot bring anything back: that still faults it (it is refused, not granted empty).
    gone = f"job unregistered from node {ev.node}"
    _fail_ops(w, lambda op: op.node == ev.node and op.job == ev.job and op.kind is OpKind.SNAPSHOT, gone, fault=False)
    _fail_ops(w, lambda op: op.node == ev.node and op.job == ev.job, gone)
    w.touch("job unregistered")


def _on_op_result(w: Work, ev: OpResult) -> None:
    sw, tr = w.switch, w.trailing
    epoch = tr.epoch if tr is not None else sw.epoch if sw is not None else None
    if epoch != ev.epoch:
        return  # a late answer from an earlier switch: fenced off
    for op in w.pending_ops():
        # The node and job must be the operation's too: an agent answers only for its own node's operations (its
        # subject names its node, which the bus checked), never for another node's by naming its op id.
        if op.op_id == ev.op_id and op.node == ev.node and op.job == ev.job:
            w.op_done(op, ok=ev.ok, error=ev.error, beside=ev.overlapped)
            return


def _on_agent_lost(w: Work, ev: AgentLost) -> None:
    """The node's agent is gone (its liveness key expired or was deleted).

    A snapshot it was running stays pending: the outgoing job's context may still be on the device (its own
    process may still be suspending it, with nobody left to say when it is done), and granting now would put two
    contexts on it at once. The snapshot ends when an agent on that node answers it (a restarted agent announces
    the job, is sent the snapshot again and answers once the job's state is off the device), or at its deadline,
    which faults the job: its state could not be known. A restore on that node cannot run: it ends, faulting its
    job unless it never started (queued behind a snapshot there) and nothing of the job is saved on that node. A
    snapshot trailing a grant on restore stays pending in the same way, and the holder keeps the group."""
    ops = w.pending_ops()
    snapshotting = {op.node for op in ops if op.kind is OpKind.SNAPSHOT}
    queued = [op for op in ops if op.node == ev.node and op.kind is OpKind.RESTORE and op.node in snapshotting]
    _fail_ops(
        w,
        lambda op: op.node == ev.node and op.kind is OpKind.RESTORE and op not in queued,
        f"agent on node {ev.node} was lost during the operation",
    )
    for op in queued:
        stranded = ev.node in w.saved.get(op.job, ())
        w.op_done(
            op,
            ok=False,
            fault=stranded,
            error=(
                f"its context is saved on node {ev.node}, whose agent was lost; restart the agent there, "
                "then clear the fault"
            )
            if stranded
            else f"agent on node {ev.node} was lost",
        )
    if ev.node not in w.lost_nodes:
        w.lost_nodes = (*w.lost_nodes, ev.node)[-w.limits.max_lost_nodes :]  # the oldest loss is forgotten first
        w.touch("agent lost")
    snapshotting_jobs = {op.job for op in w.pending_ops() if op.node == ev.node}
    for job, nodes in list(w.placements.items()):
        if ev.node in nodes and ev.node not in w.saved.get(job, ()) and job not in snapshotting_jobs:
            # A job whose context is saved there keeps the placement: that context still has to come back; so does
            # one whose snapshot there is still pending.
            rest = tuple(n for n in nodes if n != ev.node)
            if rest:
                w.placements[job] = rest
            else:
                del w.placements[job]
            w.op_timeouts.pop(f"{ev.node}/{job}", None)
            w.touch("agent lost")
    if ev.node in w.loaded and w.loaded[ev.node] not in snapshotting_jobs:
        del w.loaded[ev.node]
        w.touch("agent lost")


def _fail_ops(w: Work, pred: Callable[[OpRecord], bool], error: str, *, fault: bool = True) -> None:
    for op in w.pending_ops():
        if pred(op):
            w.op_done(op, ok=False, error=error, fault=fault)


HANDLERS: dict[type[Any], Callable[[Work, Any], None]] = {
    Acquire: _on_acquire,
    Release: _on_release,
    Renew: _on_renew,
    Cancel: _on_cancel,
    Phase: _on_phase,
    Tick: _on_tick,
    ClearFault: _on_clear_fault,
    SetPolicy: _on_set_policy,
    JobRegistered: _on_registered,
    JobUnregistered: _on_unregistered,
    OpResult: _on_op_result,
    AgentLost: _on_agent_lost,
}
