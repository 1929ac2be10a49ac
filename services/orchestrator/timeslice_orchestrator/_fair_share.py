"""Weighted fair share (``SetPolicy.shares``): among the waiters of the same effective priority (their class plus
their ageing, ``_next_waiter``), the group passes to the one whose recent held time divided by its share is least;
ties go to whoever asked first. A job the shares do not name weighs 1.

* **Usage**: each job's recent held time, ``GroupRecord.usage``. A hold's time, from its grant to its end (a release,
  a cancel its grant crossed, a lapsed lease or unconfirmed grant: ``charge``), is added to its job's usage when the
  hold ends; a hold still running counts nothing yet. The time the group is kept for a job (its minimum hold,
  ``_min_hold``) is not held time.
* **Decay**: usage halves every ``Limits.usage_half_life_ms``, in eight steps of 2^(-1/8) on a grid of stream time
  (``decayed``): integers only, so that the orchestrator, ``timeslice replay`` and the checkers compute the same
  numbers; a job's usage is stored as it stood at its last hold's end and decayed from there when read.
* **Bounds**: at most ``MAX_SHARES`` shares (``SetPolicy``), each 1 to ``MAX_SHARE``; usage of at most
  ``Limits.max_usage_jobs`` jobs: past that, the job with the least usage now is forgotten (it counts as none, which
  is what it nearly had).
* **Off** (no shares, the default): no usage is kept and the core decides exactly as before fair share existed (first
  come, first served within a class). Shares set to nothing turn it off and forget the usage; shares replaced by others
  keep it.
* **No starvation**: fair share orders only waiters whose effective priority is equal, and a waiter's effective
  priority rises with its wait (``Limits.priority_ageing_ms``). A waiter of class ``c`` that asked at ``t`` is ahead
  of every request made from ``t + (MAX_PRIORITY - c + 1)`` ageing periods on (it has aged more than
  ``MAX_PRIORITY - c`` periods longer than such a request, whose class is at most ``MAX_PRIORITY``), so from that
  moment on it waits at most for the hold running and one hold (with its switch) of each other job that was waiting
  then: with ``J`` jobs and holds of at most ``H``, it is granted by ``t + (MAX_PRIORITY - c + 1) * ageing +
  (J - 1) * H``, whatever the shares and the usage (``tests/test_fair_share_properties.py`` checks that bound). The
  minimum hold adds its window per switch, as it does without fair share.

Pure, like the rest of the core: the choice reads the record and the event's time only. Each choice it made is
stored (``GroupRecord.picked``, a ``FairPick``), said in the group's ``StateChanged`` reason when the state changes,
and listed by ``timeslice replay``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Final

from timeslice_client.protocol import FairPick, Usage, WaiterRecord

from ._limits import Limits
from ._next_waiter import effective_priority, next_waiter

__all__ = ["charge", "choose", "decayed", "describe"]

_STEPS: Final = 8  # a half-life is decayed in this many steps
# 2^(-j/8) for j = 0..7 in 32-bit fixed point (round(2**32 * 2 ** (-j / 8))): written out, so that no float
# arithmetic of any platform enters the core's numbers.
_STEP_FACTORS: Final = (4294967296, 3938502376, 3611622603, 3311872529, 3037000500, 2784941738, 2553802834, 2341847524)
_MOST_MS: Final = 2**53  # a usage is capped here (far beyond any real one; keeps it an exact number in JSON)


def decayed(u: Usage, now_ms: int, half_life_ms: int) -> int:
    """``u``'s held time at ``now_ms``: halved for every half-life since ``u.at_ms``, by eighths of one on a grid of
    stream time (so that decaying in two goes gives what one go gives, but for rounding). ``half_life_ms`` <= 0: no
    decay."""
    if half_life_ms <= 0:
        return u.held_ms
    step = max(1, half_life_ms // _STEPS)
    k = max(0, now_ms // step - u.at_ms // step)
    halves, rest = divmod(k, _STEPS)
    if halves >= 64:
        return 0
    return ((u.held_ms >> halves) * _STEP_FACTORS[rest]) >> 32


def charge(usage: dict[str, Usage], job: str, held_ms: int, now_ms: int, limits: Limits) -> None:
    """Add a hold of ``held_ms`` that ended at ``now_ms`` to ``job``'s usage (in place); past
    ``Limits.max_usage_jobs`` jobs, forget the one with the least usage now (ties: the one charged longest ago, then
    by name)."""
    old = usage.get(job)
    base = decayed(old, now_ms, limits.usage_half_life_ms) if old is not None else 0
    usage[job] = Usage(held_ms=min(_MOST_MS, base + max(0, held_ms)), at_ms=now_ms)
    while len(usage) > max(1, limits.max_usage_jobs):
        least = min(usage, key=lambda j: (decayed(usage[j], now_ms, limits.usage_half_life_ms), usage[j].at_ms, j))
        del usage[least]


def _held(usage: Mapping[str, Usage], job: str, now_ms: int, half_life_ms: int) -> int:
    u = usage.get(job)
    return decayed(u, now_ms, half_life_ms) if u is not None else 0


def choose(
    queue: Sequence[WaiterRecord],
    now_ms: int,
    limits: Limits,
    shares: Mapping[str, int],
    usage: Mapping[str, Usage],
) -> tuple[int, FairPick | None]:
    """The index in ``queue`` (non-empty, in the order the waiters asked) of the waiter the group passes to next, and
    why fair share put it first (None: fair share is off, or no other waiter had its effective priority)."""
    ageing, half_life = limits.priority_ageing_ms, limits.usage_half_life_ms
    if not shares:
        return next_waiter(queue, now_ms, ageing), None

    def load(job: str) -> Fraction:  # its usage now over its share: the least goes first
        return Fraction(_held(usage, job, now_ms, half_life), shares.get(job, 1))

    i = next_waiter(queue, now_ms, ageing, load)
    rest = [wr for k, wr in enumerate(queue) if k != i]
    if not rest:
        return i, None
    # The runner-up: the waiter fair share would pass to were the chosen one gone.
    chosen, over = queue[i], rest[next_waiter(rest, now_ms, ageing, load)]
    if effective_priority(over, now_ms, ageing) != effective_priority(chosen, now_ms, ageing):
        return i, None  # its class and ageing alone put it first
    return i, FairPick(
        job=chosen.job,
        at_ms=now_ms,
        held_ms=_held(usage, chosen.job, now_ms, half_life),
        share=shares.get(chosen.job, 1),
        over=over.job,
        over_held_ms=_held(usage, over.job, now_ms, half_life),
        over_share=shares.get(over.job, 1),
    )


def describe(p: FairPick) -> str:
    """One line for people: why ``p.job`` went first (a ``StateChanged`` reason, ``timeslice replay``)."""
    return (
        f"fair share: {p.job} first ({_s(p.held_ms)} held recently / share {p.share}), "
        f"ahead of {p.over} ({_s(p.over_held_ms)} / share {p.over_share})"
    )


def _s(ms: int) -> str:
    return f"{ms / 1000:.1f} s"
