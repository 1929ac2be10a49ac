"""What ``test_core_properties.CoreMachine`` checks after every event (a mixin of the state machine, as
``core_agents.BesideRules`` holds its agents' rules): the notices and commands against the model of who holds and
who waits (``check_step``, ``check_notices``), the choice of the next waiter by class with ageing, then fair share
(``check_choice``),
the minimum hold (``check_min_hold``) and the record against the model (``reconcile``). The state they read is the
machine's (``entries``, ``holder``, ``departed``, ...), set up in ``CoreMachine.__init__``."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from hypothesis import event
from timeslice_client.protocol import (
    Acquire,
    Cancel,
    Contended,
    Dequeued,
    ErrorCode,
    Granted,
    GroupRecord,
    InputEvent,
    JobRegistered,
    Notice,
    Refused,
    Release,
    Released,
    Renew,
    Reservation,
    Restore,
    Revoked,
    Snapshot,
    YieldRequested,
)
from timeslice_orchestrator._fair_share import decayed
from timeslice_orchestrator._op_facts import pending_ops
from timeslice_orchestrator._predict import switch_target
from timeslice_orchestrator.core import LIMITS, Action, Transition
from timeslice_orchestrator.invariants import check_record

from .core_agents import check_contexts, op_started, pending_epoch
from .core_sim import G, commands, notices, tag


class ModelChecks:
    """The state machine's checks; ``CoreMachine`` has the state they read."""

    rec: Any
    now: int
    entries: dict[str, Any]
    holder: Any

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
        sent_before = set(self.ops)
        check_contexts(new)
        self.check_min_hold(old, new, ev, actions)
        if new.trailing is not None and new.queue and new.holder is None:
            event("waiters wait for a trailing snapshot")
        for c in cmds:
            sw = new.switch
            pending = {op.op_id: op for op in pending_ops(new)}
            assert c.op_id in pending and c.epoch == pending_epoch(new), (c, new)
            assert new.trailing is not None or (sw is not None and c.epoch == new.epoch), (c, sw)
            if c.op_id in self.ops:  # sent again, unchanged: to the node's agent announcing that very job, or as
                first, result = self.ops[c.op_id]  # unanswered for LIMITS.resend_ms since it last went out
                announced = isinstance(ev, JobRegistered) and (ev.job, ev.node) == (c.job, c.node)
                assert announced or self.now >= self.sent_at[c.op_id] + LIMITS.resend_ms, (ev, c)
                self.sent_at[c.op_id] = self.now
                assert result == [None], f"operation {c.op_id} sent again after its result"
                assert type(c) is type(first) and (c.job, c.node, c.epoch, c.deadline_ms) == (
                    first.job,
                    first.node,
                    first.epoch,
                    first.deadline_ms,
                ), (c, first)
                if isinstance(c, Restore):
                    assert isinstance(first, Restore) and set(c.after) <= set(first.after), (c, first)
                event("operation sent again")
                continue
            assert sw is not None and new.trailing is None, "while snapshots trail, no new operation goes out"
            if isinstance(c, Restore):
                assert c.job == switch_target(sw) and c.node in new.placements[c.job], (c, sw)
            else:
                assert c.job != switch_target(sw) and new.loaded.get(c.node) == c.job, (c, sw)
            self.ops[c.op_id] = (c, [None])
            self.sent_at[c.op_id] = self.now
            if isinstance(c, Snapshot):  # the agent starts it at once (a restore: when it is answered, below)
                self.steps[-1].after.append(op_started(pending[c.op_id], c.epoch))
        self.check_notices(old, new, ev, notices(actions), [c for c in cmds if c.op_id not in sent_before])
        self.reconcile()

    def check_notices(
        self, old: GroupRecord, new: GroupRecord, ev: InputEvent, ns: list[Notice], cmds: list[Any]
    ) -> None:
        pending = (ev.job, ev.request_id) if isinstance(ev, Acquire) else None
        priority = ev.priority if isinstance(ev, Acquire) else 0
        chosen_before = old.switch.to.job if old.switch is not None and old.switch.to is not None else None
        resolved = pending is None

        def enqueue_pending() -> None:
            nonlocal resolved
            if resolved or pending is None:
                return
            resolved = True
            job, rid = pending
            cur = self.entries.get(job)
            if cur is not None:  # a second acquire replaces the request id (and class), keeping the place
                self.departed.add(cur[1])
                self.entries[job] = (cur[0], rid, priority, cur[3])
            else:
                self.entries[job] = (next(self.order), rid, priority, self.now)

        contended = [n for n in ns if isinstance(n, Contended)]
        for i, n in enumerate(ns):
            assert n.group == G
            event(f"notice {tag(n)}" + (f" {n.code}" if isinstance(n, Refused) else ""))
            if isinstance(n, Granted):
                assert self.rid_job.get(n.request_id) == n.job, f"grant for a request {n.job} never made: {n}"
                assert n.request_id not in self.departed, f"grant to a request that had left: {n}"
                if (
                    isinstance(ev, Renew)
                    and ev.epoch is None
                    and self.holder == (n.job, n.epoch, n.request_id)
                    and (ev.job, ev.request_id) == (n.job, n.request_id)
                ):
                    # The grantee still renews its wait: it has not heard of its grant, which is sent again as it was.
                    expired = ("timeout", "waiter lost (no renewal)")  # what this event's time may have dropped first
                    assert not cmds and all(
                        (isinstance(m, Dequeued) and m.request_id != n.request_id and m.reason in expired)
                        or (isinstance(m, YieldRequested) and m.job == n.job)  # the quantum may pass at that time
                        for m in ns
                        if m is not n
                    ), f"a re-sent grant comes alone (but for expiries and the holder's yield request): {ns}"
                    assert new.holder is not None and not new.holder.confirmed, "only an unconfirmed grant is re-sent"
                    assert (n.waited_ms, n.context_restored) == (new.holder.waited_ms, new.holder.restored)
                    event("grant re-sent")
                    continue
                if self.holder is not None and self.holder[:2] == (n.job, n.epoch):
                    assert pending == (n.job, n.request_id), f"re-grant without the holder asking: {n}"
                    assert not n.context_restored and n.waited_ms == 0
                    resolved = True
                    self.departed.add(self.holder[2])
                    self.holder = (n.job, n.epoch, n.request_id)
                    continue
                assert self.holder is None, f"granted {n.job} at {n.epoch} while {self.holder} holds"
                # While snapshots trail a grant on restore, only the job granted then (the active one) is granted.
                assert new.trailing is None or n.epoch == new.trailing.epoch or n.job == old.active_job, (n, old)
                if new.trailing is not None and new.trailing.epoch == n.epoch:  # a grant on restore
                    assert all((op.node, n.epoch) in self.beside and op.job != n.job for op in new.trailing.ops), (
                        f"granted {n.job} while snapshots ran with no restore of it beside them: {new.trailing}"
                    )
                    event("grant on restore")
                assert n.epoch > self.max_epoch, f"grant epoch {n.epoch} after {self.max_epoch}"
                assert i == len(ns) - 1, f"a new grant is the last notice of its event: {ns}"
                assert not cmds, "a grant never comes with new snapshot/restore commands"
                if pending is not None and (pending[1] == n.request_id or pending[0] in self.entries):
                    # This event's acquire was applied before the choice: a waiter's second acquire replaced its
                    # request and its class already.
                    enqueue_pending()
                entry = self.entries.get(n.job)
                assert entry is not None and entry[1] == n.request_id, f"{n.job} was not waiting with {n}"
                if old.reserved is not None and old.reserved.job == n.job and self.now < old.reserved.until_ms:
                    # Taken back within its minimum hold (at the window's end or past it, the reservation has
                    # expired first and the job is chosen, if at all, as any waiter).
                    assert isinstance(ev, Acquire) and new.reserved is None, ev
                    assert new.holder is not None and not new.holder.switched and not cmds
                    self.taken_back.add(n.epoch)
                    event("taken back within the minimum hold")
                elif n.job != chosen_before:  # chosen in this event (else when its switch began: checked then)
                    self.check_choice(n.job, chosen_before, new)
                del self.entries[n.job]
                restores = [r for c, r in self.ops.values() if isinstance(c, Restore) and c.epoch == n.epoch]
                # "dropped": its node's agent was lost while it waited behind a snapshot there, with nothing
                # of its job saved on that node (so nothing to bring back, and that placement is gone), or the job
                # left that node (unregistered there) while it ran.
                assert all(r in ([True], ["dropped"]) for r in restores), (
                    f"granted before every restore succeeded: {restores}"
                )
                # (A grant at once to the job a predictive restore brought back says so too: its restores ran at
                # the epoch of that switch, which granted nobody; ``PredictChecks`` checks that case.)
                ahead = old.switch is None and old.holder is None and old.restored_ahead == n.job
                assert n.context_restored == (ahead or any(r == [True] for r in restores))
                placed = set(new.placements.get(n.job, ()))
                loaded_here = {node for node, j in new.loaded.items() if j == n.job}
                assert placed == loaded_here, f"granted {n.job} with its context on {loaded_here}, not {placed}"
                assert n.lease_deadline_ms > self.now
                assert n.waiters == len(new.queue), f"a grant counts the jobs still waiting: {n}, {new.queue}"
                self.holder = (n.job, n.epoch, n.request_id)
                self.max_epoch = n.epoch
                self.grants += 1
                event("grant after restores" if restores else "grant without restore")
            elif isinstance(n, Contended):
                assert isinstance(ev, Acquire) and pending is not None and not resolved, (ev, n)
                assert self.holder is not None and self.holder[:2] == (n.job, n.epoch), (n, self.holder)
                assert n.job != ev.job, n
                assert n.waiters == 1 and new.queue[0].request_id == ev.request_id, (n, new.queue)
                assert pending[0] not in self.entries, f"a waiter's second acquire is no new contention: {n}"
            elif isinstance(n, YieldRequested):
                # Only to the holder, of its hold, once per hold, past the quantum, while someone waits.
                assert self.holder is not None and self.holder[:2] == (n.job, n.epoch), (n, self.holder)
                assert n.epoch not in self.yield_asked and n.quantum_ms == new.quantum_ms > 0, n
                assert new.holder is not None and n.held_ms == self.now - new.holder.granted_at_ms >= n.quantum_ms
                assert n.waiters == len(new.queue) + (1 if new.switch and new.switch.to else 0) > 0, (n, new)
                self.yield_asked.add(n.epoch)
                event("holder asked to yield")
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
                    if n.code is ErrorCode.JOB_FAULTED and entry is not None:
                        # A waiter's second acquire took over its place, which was then faulted (e.g. its switch
                        # found its context stranded on a lost node): the place is gone with it.
                        self.departed.add(entry[1])
                        del self.entries[n.job]
                elif n.code is ErrorCode.JOB_FAULTED:
                    assert entry is not None and entry[1] == n.request_id and n.job == job, n
                    del self.entries[n.job]
                    self.departed.add(n.request_id)
                else:
                    assert n.code in (ErrorCode.NOT_HOLDER, ErrorCode.STALE_EPOCH), n
                    assert isinstance(ev, Release | Renew), (ev, n)
        chosen = new.switch.to.job if new.switch is not None and new.switch.to is not None else None
        if chosen is not None and chosen != chosen_before:
            enqueue_pending()  # (an acquire refused or granted above resolved itself already)
            self.check_choice(chosen, chosen_before, new)
        if not resolved:
            assert pending is not None
            assert self.holder is None or self.holder[0] != pending[0], "holder's acquire went unanswered"
            # The first job to wait while another holds tells the holder (WorkloadChannel.suspend_early). (A
            # grant that the same event makes after the enqueue counts the new waiter in Granted.waiters.)
            fresh = pending[0] not in self.entries and not any(isinstance(n, Granted) for n in ns)
            first = fresh and self.holder is not None and len(new.queue) == 1
            assert len(contended) == (1 if first else 0), (ev, ns, self.holder, new.queue)
            enqueue_pending()
        else:
            assert not contended, f"contention notice without a new waiter: {ns}"

    def check_min_hold(self, old: GroupRecord, new: GroupRecord, ev: InputEvent, actions: list[Action]) -> None:
        """A release keeps the group exactly when its hold came through a switch (not one taken back within a
        minimum hold), ended before the minimum hold, and others wait; a kept group is never kept past its window."""
        h = old.holder
        (rel,) = [n for n in notices(actions, Released) if isinstance(ev, Release)] or [None]
        if rel is not None and h is not None and rel.epoch == h.epoch:
            until = h.granted_at_ms + old.min_hold_ms
            due = old.min_hold_ms > 0 and h.switched and self.now < until and rel.pending_waiters > 0
            assert new.reserved == (Reservation(job=h.job, epoch=h.epoch, until_ms=until) if due else None), (h, new)
            assert not due or (h.epoch not in self.taken_back and rel.snapshot_deferred), (h, rel)
            if due:
                event("kept within the minimum hold")
        elif new.reserved is not None:
            assert new.reserved == old.reserved, (old.reserved, new.reserved)
        if new.reserved is not None:
            assert self.now < new.reserved.until_ms, "a group is never kept past its job's window"
        elif old.reserved is not None and self.now >= old.reserved.until_ms:
            event("minimum hold ran out")

    def check_choice(self, job: str, excluded: str | None, rec: GroupRecord) -> None:
        """``job`` was the waiter the group passed to: the highest class plus ageing, then, with fair shares set, the
        least recent held time per share (``rec``'s: the usage the choice saw), then the first to ask."""

        def key(j: str) -> tuple[int, Fraction, int, int]:
            order, _, prio, enq = self.entries[j]
            u = rec.usage.get(j) if rec.shares else None
            load = Fraction(decayed(u, self.now, LIMITS.usage_half_life_ms) if u else 0, rec.shares.get(j, 1))
            return (prio + (self.now - enq) // LIMITS.priority_ageing_ms, -load, -enq, -order)

        rivals = [j for j in self.entries if j not in (job, excluded)]
        better = [j for j in rivals if key(j) > key(job)]
        assert not better, f"passed to {job} {key(job)} while {[(j, key(j)) for j in better]} came first"
        earlier = [j for j in rivals if key(j)[2:] > key(job)[2:]]
        tied = [j for j in rivals if key(j)[0] == key(job)[0]]
        if rec.shares and tied:
            assert rec.picked is not None and (rec.picked.job, rec.picked.at_ms) == (job, self.now), rec.picked
        event(
            "passed by fair share"
            if any(j in tied for j in earlier)
            else "passed by class"
            if earlier
            else "passed in order"
        )

    def reconcile(self) -> None:
        rec = self.rec
        to = rec.switch.to if rec.switch and rec.switch.to else None
        waiting = ([to] if to else []) + list(rec.queue)
        rest = sorted((kv for kv in self.entries.items() if to is None or kv[0] != to.job), key=lambda kv: kv[1][0])
        model = ([(to.job, self.entries[to.job][1])] if to and to.job in self.entries else []) + [
            (j, e[1]) for j, e in rest
        ]
        assert [(w.job, w.request_id) for w in waiting] == model, (
            f"waiters (in arrival order) differ from the model: {waiting} {self.entries}"
        )
        assert [w.priority for w in rec.queue] == [e[2] for _, e in rest], "classes differ from the model"
        h = rec.holder
        if h is not None and rec.quantum_ms and waiting and self.now >= h.granted_at_ms + rec.quantum_ms:
            assert h.epoch in self.yield_asked, f"holder {h.job} held past the quantum while others wait, not asked"
        if self.holder is None:
            assert rec.holder is None, rec.holder
        else:
            assert rec.holder is not None
            assert (rec.holder.job, rec.holder.epoch, rec.holder.request_id) == self.holder
        assert rec.epoch >= self.max_epoch
