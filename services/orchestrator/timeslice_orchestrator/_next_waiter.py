"""Which waiter a group passes to next: priority classes with ageing.

Each acquire carries a priority class (``Acquire.priority``: 0, the default, up to ``MAX_PRIORITY``). When the group
passes on, the waiter with the highest *effective* priority goes first: its class plus one for every
``Limits.priority_ageing_ms`` it has waited, so a waiter of a low class overtakes every newer waiter of a higher one
once it has waited long enough (no starvation: a waiter of class 0 waits at most ``MAX_PRIORITY`` ageing periods
longer than it would first come, first served, when the group keeps passing on). Ties go to whoever asked first, so
a group whose jobs all ask at one class is served first come, first served, exactly as before classes existed. With
weighted fair share on (``_fair_share``), ties of effective priority go to the least recent use per share first, and
only then to whoever asked first.

Pure and deterministic (the record's queue, the event's time): ``timeslice replay`` and the checkers fold the same
choice."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction

from timeslice_client.protocol import WaiterRecord

__all__ = ["effective_priority", "next_waiter"]


def effective_priority(wr: WaiterRecord, now_ms: int, ageing_ms: int) -> int:
    """``wr``'s class plus one per ``ageing_ms`` waited by ``now_ms`` (``ageing_ms`` <= 0: no ageing)."""
    waited = max(0, now_ms - wr.enqueued_at_ms)
    return wr.priority + (waited // ageing_ms if ageing_ms > 0 else 0)


def next_waiter(
    queue: Sequence[WaiterRecord], now_ms: int, ageing_ms: int, load: Callable[[str], Fraction] | None = None
) -> int:
    """The index in ``queue`` (in the order the waiters asked, non-empty) of the one the group passes to next.
    ``load``: fair share's measure of a job (its recent use per share, ``_fair_share``), the least first among equal
    effective priorities; None: fair share is off."""
    if load is None and all(wr.priority == 0 for wr in queue):
        return 0  # one class: first come, first served (and no arithmetic on the common path)

    def key(i: int) -> tuple[int, Fraction, int, int]:
        wr = queue[i]
        return (
            effective_priority(wr, now_ms, ageing_ms),
            -load(wr.job) if load else Fraction(0),
            -wr.enqueued_at_ms,
            -i,
        )

    return max(range(len(queue)), key=key)
