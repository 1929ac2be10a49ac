"""The record-level invariants of one :class:`GroupRecord` (``check_record``), re-exported by ``invariants``.

One holder at most, fencing epochs, a sane queue, a state that matches the fields, only the holder's context on
the accelerators while it holds (snapshots trailing a grant on restore are the one co-residency allowed), no
waiter stranded while nothing moves. Pure (no I/O, no clock). Apart from the stream checker
(``invariants.StreamChecker``), which checks every record its fold produces with it, because these rules read
one record alone: a newcomer finds what a valid record is here, and how a stream is folded there.
"""

from __future__ import annotations

from collections.abc import Callable

from timeslice_client.protocol import GroupRecord, GroupState, OpKind

from ._errors import InvariantViolation
from ._op_facts import pending_ops

__all__ = ["check_record"]


def _expected_state(rec: GroupRecord) -> GroupState:
    if rec.holder is not None:
        return GroupState.LOCKED
    if rec.switch is not None or (rec.trailing is not None and rec.queue):
        return GroupState.SWITCHING
    if rec.active_job is not None:
        return GroupState.IDLE_YIELDED
    return GroupState.IDLE


def check_record(rec: GroupRecord) -> None:
    """Raise :class:`InvariantViolation` unless ``rec`` satisfies every record-level invariant."""

    def fail(rule: str, detail: str, **values: object) -> InvariantViolation:
        return InvariantViolation(rule, detail, group=rec.group, values=values)

    def only_loaded(job: str, detail: str, **values: object) -> None:
        """No context but ``job``'s is loaded on any node (rule ``loaded-exclusive``)."""
        others = {n: j for n, j in rec.loaded.items() if j != job}
        if others:
            raise fail("loaded-exclusive", detail, **values, others=others)

    if rec.epoch < 0 or rec.last_seq < 0:
        raise fail("counters", "epoch and last_seq are never negative", epoch=rec.epoch, last_seq=rec.last_seq)
    expected = _expected_state(rec)
    if rec.state != expected:
        raise fail(
            "state",
            f"state is {rec.state} but holder/switch/active_job say {expected}",
            state=rec.state,
            holder=rec.holder,
            switch=rec.switch,
            active_job=rec.active_job,
        )

    queued = [w.job for w in rec.queue]
    if len(set(queued)) != len(queued):
        raise fail("queue-unique-job", "a job waits at most once", queue=queued)
    rids = [w.request_id for w in rec.queue]
    if len(set(rids)) != len(rids):
        raise fail("queue-unique-request", "a request id waits at most once", queue=rids)
    faulted_waiters = sorted(set(queued) & rec.faulted.keys())
    if faulted_waiters:
        raise fail(
            "queue-faulted", "faulted jobs do not wait in the queue", faulted=faulted_waiters, faults=rec.faulted
        )

    h = rec.holder
    if h is not None:
        if rec.switch is not None:
            raise fail("holder-switch", "a group is never both held and switching", holder=h, switch=rec.switch)
        if rec.active_job != h.job:
            raise fail(
                "holder-active", "the holder's context is the active one", holder=h.job, active_job=rec.active_job
            )
        if h.epoch != rec.epoch:
            raise fail("holder-epoch", "the holder holds the current epoch", holder_epoch=h.epoch, epoch=rec.epoch)
        if h.job in queued:
            raise fail("holder-queued", "the holder does not also wait in the queue", holder=h.job, queue=queued)
        if h.job in rec.faulted:
            raise fail("holder-faulted", "a faulted job never holds", holder=h.job, fault=rec.faulted[h.job])
        if h.lease_ms <= 0:
            raise fail("holder-lease", "a holder has a positive lease", holder=h)
        only_loaded(h.job, "while a job holds the group, no other job's context is on its accelerators", holder=h.job)
    elif rec.switch is None:
        if rec.queue and rec.trailing is None and rec.reserved is None:
            raise fail(
                "idle-with-waiters",
                "nobody holds and no switch runs, yet jobs wait (no grant would ever come)",
                queue=queued,
                state=rec.state,
            )
        if rec.active_job is not None:
            active = rec.active_job
            only_loaded(active, "an idle-yielded group has only its active job's context loaded", active_job=active)

    sw = rec.switch
    if sw is not None:
        if sw.epoch != rec.epoch:
            raise fail("switch-epoch", "a switch runs at the current epoch", switch_epoch=sw.epoch, epoch=rec.epoch)
        if not sw.ops:
            raise fail("switch-stuck", "a switch always waits for at least one operation", switch=sw)
        ids = [op.op_id for op in sw.ops]
        if len(set(ids)) != len(ids):
            raise fail("switch-ops-unique", "operation ids of a switch are unique", ops=ids)
        if sw.phase is OpKind.SNAPSHOT:
            early = [op for op in sw.ops if op.kind is OpKind.RESTORE]
            if early:
                raise fail("switch-phase", "no restore is pending before the switch issued its restores", ops=early)
        target = sw.to.job if sw.to is not None else None
        if target is not None and target in queued:
            raise fail(
                "switch-target-queued", "the switch target does not also wait in the queue", target=target, queue=queued
            )
        if any(op.kind is OpKind.SNAPSHOT and op.job == target for op in sw.ops):
            raise fail("switch-snapshot-target", "the incoming job is never snapshotted", target=target, ops=sw.ops)
        restoring = {op.job for op in sw.ops if op.kind is OpKind.RESTORE}
        if len(restoring) > 1 or (target is not None and restoring and restoring != {target}):
            raise fail("switch-restore-target", "a switch restores only the incoming job", target=target, ops=sw.ops)
        if rec.active_job is not None and rec.active_job != target:
            raise fail(
                "switch-active",
                "while switching, the active job is the incoming one or none",
                active_job=rec.active_job,
                target=target,
            )

    for job, nodes in rec.placements.items():
        if not nodes or len(set(nodes)) != len(nodes):
            raise fail("placements", "a placement names at least one node, each once", job=job, nodes=nodes)
    for node, job in rec.loaded.items():
        if node not in rec.placements.get(job, ()):
            raise fail(
                "loaded-placed",
                "a loaded context belongs to a job registered on that node",
                node=node,
                job=job,
                placements=rec.placements,
            )
    for job, nodes in rec.saved.items():
        if not nodes or not set(nodes) <= set(rec.placements.get(job, ())):
            raise fail(
                "saved-placed",
                "a saved context belongs to a job registered on that node",
                job=job,
                saved=nodes,
                placements=rec.placements.get(job, ()),
            )
        both = sorted(n for n in nodes if rec.loaded.get(n) == job)
        if both:
            raise fail("saved-loaded", "a context is either saved or loaded on a node, not both", job=job, nodes=both)
    _check_trailing(rec, fail)
    _check_reserved(rec, fail)
    pending = {(op.node, op.job) for op in pending_ops(rec) if op.kind is OpKind.SNAPSHOT}
    lost_loaded = sorted(n for n in rec.lost_nodes if n in rec.loaded and (n, rec.loaded[n]) not in pending)
    if lost_loaded:
        raise fail(
            "lost-not-loaded",
            "no context counts as loaded on a node whose agent is lost, but one whose "
            "snapshot there is still pending (it may still be on the device)",
            nodes=lost_loaded,
            loaded=rec.loaded,
        )
    pairs = {f"{n}/{j}" for j, nodes in rec.placements.items() for n in nodes}
    if set(rec.op_timeouts) != pairs:
        raise fail(
            "op-timeouts",
            "operation timeouts are kept for exactly the registered (node, job) pairs",
            op_timeouts=sorted(rec.op_timeouts),
            registered=sorted(pairs),
        )


def _check_trailing(rec: GroupRecord, fail: Callable[..., InvariantViolation]) -> None:
    """Snapshots trailing a grant on restore: the one co-residency of two jobs' contexts that a record may show."""
    tr = rec.trailing
    if tr is None:
        return
    if rec.switch is not None:
        raise fail(
            "trailing-switch",
            "no switch runs while snapshots trail a grant (its restores would make a third context on a device)",
            trailing=tr,
            switch=rec.switch,
        )
    if not tr.ops or tr.epoch > rec.epoch:
        raise fail(
            "trailing-ops",
            "trailing snapshots are pending operations of an earlier (or the current) epoch",
            trailing=tr,
            epoch=rec.epoch,
        )
    nodes = [op.node for op in tr.ops]
    if len(set(nodes)) != len(nodes) or len({op.op_id for op in tr.ops}) != len(nodes):
        raise fail("trailing-one-per-node", "at most one snapshot trails on a node, each with its own id", trailing=tr)
    holder = rec.holder.job if rec.holder is not None else None
    for op in tr.ops:
        if op.kind is not OpKind.SNAPSHOT:
            raise fail("trailing-snapshots", "only snapshots trail a grant", op=op)
        if rec.active_job is None or op.job in (rec.active_job, holder) or rec.loaded.get(op.node) == op.job:
            raise fail(
                "trailing-beside",
                "a trailing snapshot's job neither holds nor is the active job nor counts "
                "as loaded: the one context beside it on its node is the active job's (a grant on restore)",
                op=op,
                active_job=rec.active_job,
                holder=holder,
                loaded=rec.loaded,
            )
        if rec.loaded.get(op.node, rec.active_job) != rec.active_job:
            raise fail(
                "trailing-beside",
                "beside a trailing snapshot, only the active job's context is loaded",
                op=op,
                active_job=rec.active_job,
                loaded=rec.loaded,
            )
        if op.node not in rec.placements.get(op.job, ()):
            raise fail(
                "trailing-placed",
                "a trailing snapshot's job is registered on its node (its unregistration ends the snapshot)",
                op=op,
                placements=rec.placements.get(op.job, ()),
            )


def _check_reserved(rec: GroupRecord, fail: Callable[..., InvariantViolation]) -> None:
    """A group kept for a job within its minimum hold (``_min_hold``): nobody holds it, no switch runs, nothing was
    granted since the reserved job's hold, and that job's context is the active one (``reserved-idle``)."""
    r = rec.reserved
    if r is None:
        return
    if rec.holder is not None or rec.switch is not None or r.epoch != rec.epoch or rec.active_job != r.job:
        raise fail(
            "reserved-idle",
            "while the group is kept for a job (its minimum hold), nobody holds it, no switch runs, no grant was made "
            "since that job's hold, and its context is the active one",
            reserved=r,
            holder=rec.holder,
            switch=rec.switch,
            epoch=rec.epoch,
            active_job=rec.active_job,
        )
    if r.job in rec.faulted:
        raise fail("reserved-job", "a group is kept only for a job that is not faulted", reserved=r, faults=rec.faulted)
