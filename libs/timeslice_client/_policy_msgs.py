"""The wire types of a group's scheduling policy: an operator sets it (``SetPolicy``), the orchestrator asks a
holder to yield once it has held past the policy's quantum while others wait (``YieldRequested``), a group stays
reserved for a job that released early within its minimum hold (``Reservation``, in ``GroupRecord.reserved``), and
fair share keeps each job's recent held time (``Usage``) and says why it put a waiter first (``FairPick``; both in the
``GroupRecord``).

Apart from ``protocol`` so that it stays within its size; ``protocol`` puts them in its unions and exports them.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from ._bounds import Count, Id, JobId, Ms

__all__ = [
    "MAX_MIN_HOLD_MS",
    "MAX_QUANTUM_MS",
    "MAX_SHARE",
    "MAX_SHARES",
    "FairPick",
    "Reservation",
    "SetPolicy",
    "Usage",
    "YieldRequested",
]

MAX_QUANTUM_MS: Final = 7 * 24 * 3600 * 1000  # a week: longer is no quantum
MAX_MIN_HOLD_MS: Final = 3600 * 1000  # an hour: the longest that waiters may be kept waiting for a job's return
MAX_SHARES: Final = 64  # jobs with a share of one group (the others weigh 1)
MAX_SHARE: Final = 1000  # the largest share (weight) of a job; the smallest is 1
Share = Annotated[int, msgspec.Meta(ge=1, le=MAX_SHARE)]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class SetPolicy(_Msg, frozen=True, tag="set_policy", omit_defaults=True):
    """An operator sets a group's scheduling policy (``ts.v1.ctl.<group>.set_policy``: the admin identity only).
    ``quantum_ms``: how long a holder holds while others wait before the orchestrator asks it to yield
    (``YieldRequested``); 0: never asked. ``min_hold_ms``: a job granted through a switch that releases sooner than
    this after its grant while others wait keeps the group reserved until then (``Reservation``); 0: never.
    ``predict``: the predictive restore (``_predict``): at a release nobody waited for, the job expected to ask next
    has its context brought back while the group is idle.
    ``shares``: weighted fair share, each named job's weight (1 to ``MAX_SHARE``; a job not named weighs 1), which
    replace the group's; among waiters of equal effective priority, the one whose recent held time divided by its
    weight is least goes first; an empty mapping turns fair share off (and forgets the held times). None (any of
    them): left as it is. The priority classes of the waiters need no setting (``Acquire.priority``). Fields left at
    None are left out on the wire (``omit_defaults``), so an orchestrator that predates one of them reads a policy
    that does not use it (decoding is strict)."""

    group: Id
    quantum_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_QUANTUM_MS)] | None = None
    min_hold_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_MIN_HOLD_MS)] | None = None
    predict: bool | None = None
    shares: Annotated[dict[JobId, Share], msgspec.Meta(max_length=MAX_SHARES)] | None = None


class Reservation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The group is kept for ``job`` until ``until_ms`` (``GroupRecord.reserved``; the minimum hold, ``_min_hold``):
    it was granted at ``epoch`` through a switch and released before the group's ``min_hold_ms`` had passed while
    others waited. No switch starts meanwhile; its next acquire is granted at once, without a switch, and ends it,
    as do ``until_ms`` (the next waiter is then served), a fault of the job, and its leaving a node."""

    job: str
    epoch: int
    until_ms: int


class Usage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A job's recent held time for fair share (``GroupRecord.usage``): ``held_ms`` as it stood at ``at_ms`` (its last
    hold's end), decayed since by the core's half-life (``_fair_share.decayed``)."""

    held_ms: int
    at_ms: int


class FairPick(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Why fair share last put a waiter first (``GroupRecord.picked``): at ``at_ms`` the group passed to ``job`` (its
    recent held time ``held_ms``, its share ``share``) ahead of ``over`` (``over_held_ms``, ``over_share``), the next
    in fair-share order among the waiters of the same effective priority: ``held_ms / share`` was the lesser, or equal
    and ``job`` asked first."""

    job: str
    at_ms: int
    held_ms: int
    share: int
    over: str
    over_held_ms: int
    over_share: int


class YieldRequested(_Msg, frozen=True, tag="yield_requested"):
    """``job`` has held the group at ``epoch`` for ``held_ms``, past the group's quantum, while ``waiters`` wait: it
    is asked to release at its next phase boundary. A request, never a revocation: the hold stays valid until it
    releases (or its lease lapses). Sent once per hold."""

    group: Id
    job: Id
    epoch: Count
    held_ms: Ms
    quantum_ms: Ms
    waiters: Count
