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
  granted without snapshot or restore; when it is the group's next job input after that release, the
  client sends it as a claim (``Acquire.claim_epoch``) and holds from its PubAck on: the grant at the
  claimed epoch is then the only possible decision, which the property tests check against any non-job
  events in between;
* every grant raises ``epoch``; release and renew must carry the current one;
* a holder's lease starts as a short confirmation window (``confirm_ms``) and becomes ``lease_ms``
  at the first renewal, so a waiter that died just before its grant is passed over within seconds;
* a switch snapshots every loaded context that is not the incoming job's, then restores the
  incoming job where it is registered, and grants only when every restore succeeded (and, but for a grant
  on restore, below, every snapshot ended); a failed
  operation faults that job only, and the group moves on. The restores are sent together with the
  snapshots: each names the snapshots on its node that the agent finishes first (``Restore.after``),
  so no round trip through the orchestrator sits between a snapshot and the restore after it;
* a node's agent that announces a job (``JobRegistered``; a restarted agent announces all of its jobs) is sent
  again the running switch's operations still pending for that job on that node, unchanged: a restarted agent
  has forgotten the commands it had taken, and one that did not restart answers the same op id as before;
* **no grant while an outgoing context may still be on the device**: a switch grants only once every snapshot
  of it ended with an answer (the context is off the device, or it failed and was rolled back, faulting its
  job), or its job left the node (unregistered: its processes are gone), or its deadline passed (its job is
  faulted: its state could not be known). The loss of the agent running a snapshot ends nothing: the job's own
  process may still be suspending it. ``timeslice check`` reports a grant made while a snapshot of another job
  had started and not ended (``grant-while-loaded``), but for the one exception below;
* **grant on restore**, the one exception: while a switch's snapshot of the outgoing job still runs on a node,
  the incoming job is granted once its restore is done *only* if that restore ran beside the snapshot by the
  agent's room rule and said so (``OpResult.overlapped``; an older agent never does) and succeeded, on every
  node where a snapshot still runs (``Work._beside_only``). Otherwise the order stays snapshot, restore, grant.
  Two contexts then share a device, but only one job runs: the outgoing job no longer holds (it released, or
  its client stopped holding before its hold was revoked), and its process only has its state copied out.
  Those snapshots go on as ``GroupRecord.trailing`` (at their switch's epoch), ended as any snapshot is: an
  answer, the job's unregistration, or the deadline (which faults the job); an agent's loss ends nothing. A
  trailing snapshot that fails was rolled back: its job is faulted (its context stays on the device beside the
  holder's, and a faulted job is never granted), and the holder keeps the group. No switch starts while
  snapshots trail (the group is SWITCHING if jobs wait): the next switch's restore would be a third context on
  the device;
* **time the lock could not hear does not count against a waiter**: a wait's liveness deadline found passed by
  more than ``Limits.deaf_after_ms`` when it is checked was not checked on time (nothing reached the stream: its
  leader was being elected, or no orchestrator published ticks), so the waiter's renewals may have been lost with
  everything else; it gets one fresh window (``WaiterRecord.forgiven``, cleared by its next renewal) instead of
  being dropped, and a waiter that is really gone is dropped at the end of it;
* a waiter that renews its wait after its grant has not heard of it (notices are at most once): the grant is
  sent again, unchanged, until the grantee confirms it; a renewal of a wait the core does not know is answered
  with ``Dequeued(lost=True)``, and the client waits again;
* **who is next, and when a holder is asked to yield**: the waiter with the highest priority class plus its ageing
  goes first (``_next_waiter``; one class: first come, first served), and among equals, with the group's fair shares
  set (``SetPolicy.shares``), the least recent held time per share (``_fair_share``: each hold's time is charged to its
  job's usage when it ends, decayed by a half-life); a holder that held past the group's quantum
  (``SetPolicy``) while a job waits is asked once to yield (``YieldRequested``, ``_quantum``), never revoked for it;
* **a minimum hold** (``SetPolicy.min_hold_ms``, ``_min_hold``): a job granted through a switch that releases sooner
  than that after its grant while others wait keeps the group (``GroupRecord.reserved``) until its grant time plus
  the minimum hold; its acquire within that window is granted at once, without a switch; at the window's end (or
  at once if it faults or leaves a node) the next waiter is served. Never renewed: the hold taken back is not a
  switch's;
* **the predictive restore** (``SetPolicy.predict``, ``_predict``): at a release nobody waits for, the job expected
  to ask next (from each job's recent cycle, ``GroupRecord.cycles``) is planned (``GroupRecord.plan``, named in
  ``Released.ahead``: no claim follows such a release), or at a phase start (``Phase``) of a job away from an idle
  group, from how long after that phase's start the job asked before (``Cycle.phases``; phase events change nothing
  with the policy off); any ask drops the plan; at its time, on a group still idle, a
  switch with no waiter (``SwitchRecord.ahead``) brings that job's context back, which its ask takes over or, ended,
  leaves loaded (``restored_ahead``: its next acquire is granted at once, ``context_restored``).
"""

from __future__ import annotations

from timeslice_client.protocol import GroupRecord, InputEvent

from ._handlers import HANDLERS
from ._min_hold import reserve_deadline
from ._predict import ahead_deadline
from ._quantum import ask_to_yield, yield_deadline
from ._work import LIMITS, Action, Command, Limits, Notify, Transition, Work

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


def new_record(group: str) -> GroupRecord:
    """A group comes into existence on first use: IDLE, epoch 0."""
    return GroupRecord(group=group)


def next_deadline(rec: GroupRecord) -> int | None:
    """The earliest instant at which something in ``rec`` expires, or None."""
    times: list[int] = []
    if rec.holder is not None:
        times.append(rec.holder.lease_deadline_ms)
    times.extend(min(w.deadline_ms, w.alive_until_ms) for w in rec.queue)
    ops = (rec.switch.ops if rec.switch is not None else ()) + (rec.trailing.ops if rec.trailing is not None else ())
    times.extend(op.deadline_ms for op in ops)
    times.extend(op.resend_at_ms for op in ops if op.resend_at_ms)
    if rec.switch is not None and rec.switch.to is not None:
        to = rec.switch.to
        times.append(min(to.deadline_ms, to.alive_until_ms))
    if (ask := yield_deadline(rec)) is not None:
        times.append(ask)
    if (kept := reserve_deadline(rec)) is not None:
        times.append(kept)
    if (ahead := ahead_deadline(rec)) is not None:
        times.append(ahead)
    return min(times) if times else None


def apply(
    rec: GroupRecord, ev: InputEvent, now_ms: int, seq: int, limits: Limits = LIMITS
) -> tuple[GroupRecord, list[Action]]:
    """Apply one event. Returns ``rec`` itself (same object) when nothing changed. ``limits``: the bounds the core
    holds every record to (the defaults unless a caller, e.g. a test, gives its own).

    An event at or below ``rec.last_seq`` was applied already: it is ignored (idempotence).
    """
    if seq <= rec.last_seq:
        return rec, []
    w = Work.of(rec, now_ms, limits)
    w.seq = seq
    w.expire()
    HANDLERS[type(ev)](w, ev)
    w.advance()
    w.resend_due()
    ask_to_yield(w)
    return w.finish(rec, seq)
