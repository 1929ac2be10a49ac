"""The orchestrator's record of a group (KV ``groups``, key = the group id) and the parts it is made of: its holder,
its waiters, the switch under way and its operations, the snapshots trailing a grant on restore. Storage, decoded
strictly (unknown fields refused); users read :class:`~timeslice_client.GroupStatus` instead (``status()``).
``protocol`` exports them with the messages; the same schema rules apply (add fields only with defaults)."""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from ._bounds import Name
from ._codes import GroupState, OpKind
from ._policy_msgs import FairPick, Reservation, Usage

__all__ = [
    "MAX_PHASE_CUES",
    "Cycle",
    "GroupRecord",
    "HolderRecord",
    "OpRecord",
    "PhaseCue",
    "Prediction",
    "SwitchRecord",
    "TrailRecord",
    "WaiterRecord",
]


class _Rec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class HolderRecord(_Rec, frozen=True):
    job: str
    request_id: str
    epoch: int
    granted_at_ms: int
    lease_ms: int
    lease_deadline_ms: int
    confirmed: bool = False
    waiter_ttl_ms: int = 0  # an unconfirmed grant lives this long after each renewal of the wait
    waited_ms: int = 0  # what the grant said, so that a re-sent grant says the same
    restored: bool = False
    resends: int = 0  # times an unconfirmed grant was sent again on a renewal of the wait (core.Limits bounds it)
    switched: bool = False  # granted by a switch (not a zero-cost re-acquire or claim): its minimum hold applies


class WaiterRecord(_Rec, frozen=True):
    job: str
    request_id: str
    enqueued_at_ms: int
    deadline_ms: int
    alive_until_ms: int
    lease_ms: int
    waiter_ttl_ms: int
    confirm_ms: int
    # A fresh liveness window was given, once, because the check that found this wait silent came too late to tell
    # silence from a lock that could not hear (``Limits.deaf_after_ms``); a renewal clears it.
    forgiven: bool = False
    priority: int = 0  # the acquire's priority class (``Acquire.priority``)


class OpRecord(_Rec, frozen=True):
    op_id: str
    node: str
    job: str
    kind: OpKind
    deadline_ms: int
    # When the command goes out again while unanswered (0: never): a command published while the stream could not
    # store it (a NATS cluster electing the stream's leader) never reaches the agent; the agent answers a repeated
    # op id once, with the same outcome.
    resend_at_ms: int = 0


class SwitchRecord(_Rec, frozen=True):
    to: WaiterRecord | None
    epoch: int
    phase: OpKind
    started_at_ms: int
    ops: tuple[OpRecord, ...] = ()
    restored: bool = False  # a restore of the incoming job succeeded: its grant says context_restored
    beside: tuple[str, ...] = ()  # nodes where it succeeded beside the snapshots there (OpResult.overlapped)
    # A predictive restore (``_predict``): no job asked; this one is expected to ask next, so its context is brought
    # back while the group is idle. Its acquire during the switch makes it ``to``; at the end, with no ``to``, the
    # group is left idle with its context loaded (``GroupRecord.restored_ahead``).
    ahead: str | None = None


# Phase names whose cue a job's cycle keeps (``Cycle.phases``): the core keeps the ones started last; a record with
# more is refused at decoding.
MAX_PHASE_CUES: Final = 8


class PhaseCue(_Rec, frozen=True, omit_defaults=True):
    """What a phase of one job says of its next ask, for the predictive restore (``_predict``): when the job last
    started that phase while it held nothing in the group (nor waited for it), whether it asked since, and how long
    after that start its next ask came the last two times."""

    started_ms: int = -1  # its last start while away (stream time; -1: none seen)
    asked: bool = True  # the job asked since that start (then ``gap_ms`` is that start -> the ask)
    gap_ms: int = -1  # the phase's start -> the job's next ask, the last time it was measured (-1: never)
    prev_gap_ms: int = -1  # the same, the time before (-1: measured once at most)


class Cycle(_Rec, frozen=True, omit_defaults=True):
    """What the group has seen of one job's cycle, for the predictive restore (``_predict``): when it last released,
    how long it stayed away before it asked again the last two times, how long its last switch in took, and what its
    phase starts said of its next ask (``phases``, at most ``MAX_PHASE_CUES`` names). Fields at their defaults are
    left out (``omit_defaults``): a record without phase cues is what an orchestrator older than them wrote and reads.
    """

    released_ms: int = -1  # its last release (stream time; -1: none seen)
    asked: bool = True  # it asked again since that release (then ``gap_ms`` is that time away)
    gap_ms: int = -1  # release -> its next ask, the last time it was measured (-1: never)
    prev_gap_ms: int = -1  # the same, the time before (-1: measured once at most)
    switch_in_ms: int = -1  # its last switch in: the switch's start -> its grant, a restore included (-1: none)
    phases: Annotated[dict[Name, PhaseCue], msgspec.Meta(max_length=MAX_PHASE_CUES)] = {}


class Prediction(_Rec, frozen=True, omit_defaults=True):
    """A predictive restore planned at an idle release, or at a phase start of ``job`` while the group was idle
    (``_predict``): ``job`` is expected to ask next; at ``at_ms`` its context is brought back (a switch with
    ``SwitchRecord.ahead``), unless any job asks first, which drops the plan at no cost. ``phase``: the phase whose
    start planned it (None: the cycle rule, at a release; left out then, so older readers decode it)."""

    job: str
    at_ms: int
    phase: Name | None = None


class TrailRecord(_Rec, frozen=True):
    """The outgoing job's snapshots still running after the switch of ``epoch`` granted on restore: the incoming
    job's restore on each of their nodes ran beside them by the agent's room rule and succeeded. No switch starts
    while they run (never three contexts on a device)."""

    epoch: int
    ops: tuple[OpRecord, ...]


class GroupRecord(_Rec, frozen=True):
    """The authoritative lock record of one group (KV ``groups``, key = group id)."""

    group: str
    epoch: int = 0
    state: GroupState = GroupState.IDLE
    since_ms: int = 0
    holder: HolderRecord | None = None
    active_job: str | None = None
    loaded: dict[str, str] = {}
    placements: dict[str, tuple[str, ...]] = {}
    op_timeouts: dict[str, int] = {}
    queue: tuple[WaiterRecord, ...] = ()
    switch: SwitchRecord | None = None
    faulted: dict[str, str] = {}
    saved: dict[str, tuple[str, ...]] = {}  # job -> nodes where its context is saved (snapshot done)
    lost_nodes: tuple[str, ...] = ()  # nodes whose agent was lost and has not registered a job since
    last_seq: int = 0
    trailing: TrailRecord | None = None  # snapshots of the last switch still running beside its grant
    quantum_ms: int = 0  # the group's quantum (``SetPolicy``; 0: none)
    yield_asked_epoch: int = 0  # the last hold asked to yield (``YieldRequested``: once per hold)
    min_hold_ms: int = 0  # the group's minimum hold (``SetPolicy``; 0: none)
    reserved: Reservation | None = None  # kept for a job that released within its minimum hold (``_min_hold``)
    predict: bool = False  # the group's predictive restore (``SetPolicy.predict``; ``_predict``)
    cycles: dict[str, Cycle] = {}  # each job's recent cycle (``_predict``; ``Limits.max_cycles`` jobs at most)
    plan: Prediction | None = None  # a predictive restore planned and not started yet
    restored_ahead: str | None = None  # a predictive restore brought this job's context back and it has not asked
    # Weighted fair share (``SetPolicy.shares``; empty: off): each job's weight, each job's recent held time (at most
    # ``Limits.max_usage_jobs`` of them), and why it last put a waiter first (``_fair_share``).
    shares: dict[str, int] = {}
    usage: dict[str, Usage] = {}
    picked: FairPick | None = None
