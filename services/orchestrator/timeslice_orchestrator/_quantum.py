"""A group's quantum (``SetPolicy.quantum_ms``): a holder that has held the group that long while another job waits
is asked, once per hold, to yield at its next phase boundary (a ``YieldRequested`` notice). Never a revocation: the
hold stays valid until the job releases or its lease lapses, so a job that cannot stop mid-phase loses nothing.

Pure, like the rest of the core: when to ask depends on the record and the event's time only, and
:func:`yield_deadline` tells ``next_deadline`` when the orchestrator's timer must look again."""

from __future__ import annotations

from timeslice_client.protocol import GroupRecord, YieldRequested

from ._work import Work

__all__ = ["ask_to_yield", "yield_deadline"]


def _due(quantum_ms: int, holder_epoch: int, granted_at_ms: int, asked_epoch: int, waiting: bool) -> int | None:
    if quantum_ms <= 0 or not waiting or asked_epoch >= holder_epoch:
        return None
    return granted_at_ms + quantum_ms


def ask_to_yield(w: Work) -> None:
    """Ask the holder to yield when its quantum has run out while a job waits (after the event's own changes)."""
    h = w.holder
    if h is None:
        return
    waiting = len(w.queue) + (1 if w.switch is not None and w.switch.to is not None else 0)
    due = _due(w.quantum_ms, h.epoch, h.granted_at_ms, w.yield_asked_epoch, waiting > 0)
    if due is None or w.now < due:
        return
    w.yield_asked_epoch = h.epoch
    w.touch("holder asked to yield (quantum)")
    w.notify(
        YieldRequested(
            group=w.group,
            job=h.job,
            epoch=h.epoch,
            held_ms=w.now - h.granted_at_ms,
            quantum_ms=w.quantum_ms,
            waiters=waiting,
        )
    )


def yield_deadline(rec: GroupRecord) -> int | None:
    """When the holder of ``rec`` is to be asked to yield (None: not, or asked already)."""
    h = rec.holder
    if h is None:
        return None
    waiting = bool(rec.queue) or (rec.switch is not None and rec.switch.to is not None)
    return _due(rec.quantum_ms, h.epoch, h.granted_at_ms, rec.yield_asked_epoch, waiting)
