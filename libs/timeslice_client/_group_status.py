"""What ``status()`` tells a user about one group: a read-only view of the orchestrator's record of it.

The record itself (:class:`~timeslice_client.protocol.GroupRecord`, the value in KV ``groups``) is storage: it
carries request ids, per-node placements, the switch's operations and bookkeeping for the orchestrator's rules, and
it changes when the orchestrator needs it to. :class:`GroupStatus` is the part a user reads, with stable names and
the unit in each name: ``_ms`` is milliseconds, and a name ending ``_at_ms`` is a wall-clock time in milliseconds
since the Unix epoch, by the orchestrator's clock. :func:`group_status` makes one from a record."""

from __future__ import annotations

import msgspec

from ._codes import GroupState
from .protocol import GroupRecord, HolderRecord, WaiterRecord

__all__ = ["GroupStatus", "HolderStatus", "WaiterStatus", "group_status"]


class HolderStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The job that holds the group."""

    job: str
    epoch: int
    """The hold's fencing number: each grant of the group gets a higher one."""
    granted_at_ms: int
    lease_ms: int
    """How long the hold lasts without a renewal (the client renews it in the background)."""
    lease_expires_at_ms: int
    """When the hold ends unless renewed again."""
    confirmed: bool
    """The job has confirmed the grant (an unconfirmed grant is taken back when its waiter goes silent)."""
    context_restored: bool
    """The job's context was restored onto the devices for this hold (a switch brought it back)."""


class WaiterStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A job waiting for the group (``GroupStatus.waiters`` is in the order they asked)."""

    job: str
    priority: int
    """The acquire's priority class: higher goes first, and a wait gains with its age (docs/scheduling.md)."""
    enqueued_at_ms: int
    gives_up_at_ms: int
    """When the wait ends with ``AcquireTimeout`` unless granted before."""


class GroupStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One group as the orchestrator last recorded it (a group never used reads as ``IDLE`` at epoch 0).

    ``state``: ``IDLE`` (nobody holds it, no context on it), ``IDLE_YIELDED`` (nobody holds it; ``active_job``'s
    context stayed on the devices, so that job takes it back without a switch), ``LOCKED`` (``holder`` holds it) or
    ``SWITCHING`` (the devices are being handed from ``active_job`` to ``switching_to``)."""

    group: str
    epoch: int
    """The latest grant's fencing number (0: never granted)."""
    state: GroupState
    state_since_ms: int
    """When the group entered ``state`` (wall clock, ms since the Unix epoch)."""
    holder: HolderStatus | None
    active_job: str | None
    """The job whose context is on the devices, held or not."""
    switching_to: str | None
    """During a switch: the job it hands the devices to."""
    waiters: tuple[WaiterStatus, ...]
    faulted_jobs: dict[str, str]
    """Jobs refused until an operator clears them (``timeslice faults``), each with why."""
    lost_nodes: tuple[str, ...]
    """Nodes whose agent was lost and has not registered a job since."""
    quantum_ms: int
    """How long a hold may last while another job waits before it is asked to yield (0: no quantum)."""
    min_hold_ms: int = 0
    """A job granted through a switch that releases sooner than this while others wait keeps the group until its grant
    time plus this (0: no minimum hold; docs/scheduling.md)."""
    kept_for: str | None = None
    """The job the group is kept for now (its minimum hold): its next acquire is granted without a switch."""
    kept_until_ms: int | None = None
    """When the group stops being kept for ``kept_for`` (wall clock, ms since the Unix epoch)."""
    shares: dict[str, int] = {}
    """Weighted fair share: each named job's weight (the others weigh 1); empty: off, first come, first served within
    a priority class (docs/scheduling.md)."""
    stale: bool = False
    """The record did not yet reflect this client's own latest call (an acquire, release or withdrawn wait) when
    ``status()`` stopped waiting for it (``wait_s``): this is the freshest record stored by then, from before that
    call. Never set for a group this client made no calls to."""


def _holder(h: HolderRecord) -> HolderStatus:
    return HolderStatus(
        job=h.job,
        epoch=h.epoch,
        granted_at_ms=h.granted_at_ms,
        lease_ms=h.lease_ms,
        lease_expires_at_ms=h.lease_deadline_ms,
        confirmed=h.confirmed,
        context_restored=h.restored,
    )


def _waiter(w: WaiterRecord) -> WaiterStatus:
    return WaiterStatus(job=w.job, priority=w.priority, enqueued_at_ms=w.enqueued_at_ms, gives_up_at_ms=w.deadline_ms)


def group_status(rec: GroupRecord, *, stale: bool = False) -> GroupStatus:
    """The user's view of ``rec`` (``stale``: see ``GroupStatus.stale``)."""
    return GroupStatus(
        group=rec.group,
        epoch=rec.epoch,
        state=rec.state,
        state_since_ms=rec.since_ms,
        holder=_holder(rec.holder) if rec.holder else None,
        active_job=rec.active_job,
        switching_to=rec.switch.to.job if rec.switch and rec.switch.to else None,
        waiters=tuple(_waiter(w) for w in rec.queue),
        faulted_jobs=dict(rec.faulted),
        lost_nodes=rec.lost_nodes,
        quantum_ms=rec.quantum_ms,
        min_hold_ms=rec.min_hold_ms,
        kept_for=rec.reserved.job if rec.reserved else None,
        kept_until_ms=rec.reserved.until_ms if rec.reserved else None,
        shares=dict(rec.shares),
        stale=stale,
    )
