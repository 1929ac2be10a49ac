"""A group's minimum hold (``SetPolicy.min_hold_ms``), against thrashing: a job granted through a switch (its
context was brought in for it) that releases sooner than that after its grant while others wait does not pass the
group on yet. The group stays reserved for it (``GroupRecord.reserved``, a ``Reservation``) until its grant time plus
the minimum hold: no switch starts, its context stays loaded, and if it asks again meanwhile it is granted at once,
without a switch, ahead of the waiters (that is the point: a short phase off the accelerators does not pay a
snapshot and a restore twice). When the window ends, the next waiter is served as usual.

* Never renewed: the re-acquired hold is not a switch's (``HolderRecord.switched`` is false), so its own early
  release passes the group on at once. A waiter waits at most ``min_hold_ms`` longer per switch than without it,
  plus the one hold the reserved job takes back.
* Ended at once by a fault of the reserved job, and by its leaving a node (``JobUnregistered``: its context went with
  its process): ``Work.unreserve``, as is the window's end (``Work.expire``). Nothing else touches it (a waiter's
  cancel, renewals, the quantum: that asks holders only).
* Off (0, the default): nothing is ever reserved, and the core decides exactly as before the policy existed.

Pure, like the rest of the core: the decisions read the record and the event's time only, and ``next_deadline``
includes :func:`reserve_deadline` so that the orchestrator's timer ends the window on time."""

from __future__ import annotations

from typing import Final, Literal

from timeslice_client.protocol import GroupRecord, HolderRecord, Reservation, WaiterRecord

from ._work import Work

__all__ = ["OUTCOMES", "Outcome", "grant_reserved", "reservation_change", "reserve_deadline", "reserve_on_release"]

Outcome = Literal["kept", "reacquired", "expired", "ended"]
OUTCOMES: Final[tuple[Outcome, ...]] = ("kept", "reacquired", "expired", "ended")


def reserve_on_release(w: Work, h: HolderRecord) -> None:
    """``h`` just released the group: keep it for ``h``'s job when its hold came through a switch, ended before the
    group's minimum hold, and others wait (after ``_released``)."""
    until = h.granted_at_ms + w.min_hold_ms
    if w.min_hold_ms <= 0 or not h.switched or not w.queue or w.now >= until:
        return
    w.reserved = Reservation(job=h.job, epoch=h.epoch, until_ms=until)
    w.touch(f"min hold: released after {w.now - h.granted_at_ms} ms, kept for {h.job} until its {w.min_hold_ms} ms")


def grant_reserved(w: Work, wr: WaiterRecord) -> bool:
    """The reserved job asks again within its window: granted at once, without a switch (the reservation ends).
    Returns whether it was (False: the group is not reserved for ``wr.job``)."""
    r = w.reserved
    if r is None or r.job != wr.job or w.holder is not None or w.switch is not None:
        return False
    w.reserved = None
    w.grant(wr, w.epoch + 1, restored=False)
    w.touch(f"min hold: {wr.job} re-acquired within its window, granted without a switch")
    return True


def reserve_deadline(rec: GroupRecord) -> int | None:
    """When the reservation of ``rec`` ends by itself (None: none runs)."""
    return rec.reserved.until_ms if rec.reserved is not None else None


def reservation_change(before: GroupRecord | None, after: GroupRecord, now_ms: int) -> Outcome | None:
    """What an event at ``now_ms`` did to the group's reservation (for metrics and replay): ``kept`` (a short
    release kept the group), ``reacquired`` (its job took it back), ``expired`` (the window ended), ``ended`` (its
    job faulted or left a node); None: nothing."""
    old = before.reserved if before is not None else None
    new = after.reserved
    if old == new:
        return None
    if old is None or new is not None:
        return "kept"
    if after.holder is not None and after.holder.job == old.job and after.epoch == old.epoch + 1:
        return "reacquired"
    return "expired" if now_ms >= old.until_ms else "ended"
