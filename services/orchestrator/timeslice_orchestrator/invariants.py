"""Invariant checks over lock records and over the event stream.

Two tools, both pure (no I/O, no clock):

* :func:`check_record` (``_record_invariants``) asserts the record-level invariants of one :class:`GroupRecord`:
  one holder at most, fencing epochs, a sane queue, a state that matches the fields, only the holder's context on
  the accelerators while it holds, no waiter stranded while nothing moves.
* :class:`StreamChecker` folds a ``TIMESLICE`` stream, in stream order, through the same pure core as
  the orchestrator (:func:`timeslice_orchestrator.core.apply`) and checks every record it produces. It
  also checks the notices the live orchestrator *published* in that stream on their own: grant epochs
  of a group never go backwards, no two jobs ever get the same epoch, a new grant is published only
  after the previous holder was told that its hold ended, and every published grant is one that the
  fold decided too (the live orchestrator and the pure core agree); the fold grants every claim (an
  acquire the client already took as granted, see ``Acquire.claim_epoch``) as claimed. From the agents'
  operation events it checks that on a node a restore starts only once the snapshots of the same switch
  there have ended (the orchestrator sends them together; the agent orders them).

Both raise :class:`InvariantViolation`, which names the rule and carries the values that explain it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

import msgspec
from timeslice_client.protocol import (
    Acquire,
    Granted,
    GroupRecord,
    InputEvent,
    JobUnregistered,
    OpStarted,
    Release,
    Released,
    Revoked,
    decode_input,
    decode_notice,
    subjects,
    validate_id,
)

from ._errors import InvariantViolation
from ._op_facts import OpFacts
from ._record_invariants import check_record
from ._subjects import check_names, route, subject_matches
from .core import Action, Notify, apply, new_record

__all__ = [
    "GroupStats",
    "InvariantViolation",
    "StreamChecker",
    "check_record",
    "subject_matches",
]


_op_started_decoder: Final = msgspec.json.Decoder(OpStarted)


# --------------------------------------------------------------------------- the stream checker


def _violation(rule: str, detail: str, group: str, seq: int, **values: object) -> InvariantViolation:
    """The stream breaks ``rule`` at ``seq`` in ``group``: ``detail`` says how, ``values`` show it."""
    return InvariantViolation(rule, detail, group=group, seq=seq, values=values)


_NOTICE_PATTERN: Final = "ts.v1.notice.*.*"
_OP_STARTED_PATTERN: Final = "ts.v1.agent.*.op"


@dataclass
class GroupStats:
    """What the checker saw of one group."""

    events: int = 0  # input events folded
    rejected: int = 0  # input events the orchestrator refuses (malformed, ids that do not match)
    grants: int = 0  # distinct grants published (a new (job, epoch))
    repeated_grants: int = 0  # Granted notices repeating a (job, epoch): holder re-acquire, re-issue
    unstored_grants: int = 0  # decided grants whose Granted the stream could not store (seen by their end)
    releases: int = 0
    revocations: int = 0
    max_epoch: int = 0  # the highest epoch of a published grant
    fold_grants: int = 0  # distinct grants the fold decided
    claims: int = 0  # of those, claims (re-acquires the client took at its PubAck)
    holder: tuple[str, int] | None = None  # (job, epoch) as the published notices tell it
    grants_by_job: dict[str, int] = field(default_factory=dict)


@dataclass
class _GroupView:
    stats: GroupStats = field(default_factory=GroupStats)
    epoch_owner: dict[int, str] = field(default_factory=dict)  # published grants: epoch -> job
    decided: dict[tuple[str, int], set[str]] = field(default_factory=dict)  # fold: (job, epoch) -> rids
    decided_order: list[tuple[str, int, str]] = field(default_factory=list)
    fold_max_epoch: int = 0
    published: set[tuple[str, int, str]] = field(default_factory=set)  # (job, epoch, request id)
    floor_epoch: int = 0  # grants below this epoch predate the records the checker started from


class StreamChecker:
    """Fold a stream and check it. Feed it messages in stream order with :meth:`feed`.

    ``records`` starts the fold from stored records (for a stream whose head retention discarded);
    otherwise every group starts as :func:`new_record`. With ``check_order`` (the default) a new grant
    must come after the notice that ended the previous hold (Released or Revoked); that holds as long
    as the orchestrator publishes the actions of each event in order, which it does.

    Messages at or below the last sequence fed are duplicates (redeliveries) and are skipped; subjects
    that are neither inputs nor notices are ignored; input events that the orchestrator refuses
    (malformed payloads, ids that do not match the subject) are counted in :attr:`rejected`.
    """

    def __init__(self, records: Mapping[str, GroupRecord] | None = None, *, check_order: bool = True) -> None:
        self.check_order = check_order
        self.records: dict[str, GroupRecord] = {}
        self._views: dict[str, _GroupView] = {}
        self.last_seq = 0
        self.applied = 0
        self.rejected = 0
        self.duplicates = 0
        self.ignored = 0
        self.notices = 0
        self._facts = OpFacts()  # the agents' facts: operations started and ended, what ran beside what
        for group, rec in (records or {}).items():
            check_record(rec)
            self.records[group] = rec
            view = self._view(group)
            # A running switch's grant is still to come; every other epoch up to rec.epoch is past.
            known = rec.epoch - 1 if rec.switch is not None else rec.epoch
            view.fold_max_epoch = view.stats.max_epoch = known
            view.floor_epoch = known + 1
            if rec.holder is not None:
                h = rec.holder
                view.decided[(h.job, h.epoch)] = {h.request_id}
                view.epoch_owner[h.epoch] = h.job
                view.stats.holder = (h.job, h.epoch)

    # ------------------------------------------------------------------ results

    @property
    def stats(self) -> dict[str, GroupStats]:
        return {g: v.stats for g, v in self._views.items()}

    def unpublished_grants(self) -> list[tuple[str, str, int, str]]:
        """Grants the fold decided that no notice announced (yet): (group, job, epoch, request id).

        Empty once the orchestrator has caught up with the stream; chaos tests check it at quiescence.
        """
        return [
            (g, job, epoch, rid)
            for g, v in sorted(self._views.items())
            for job, epoch, rid in v.decided_order
            if (job, epoch, rid) not in v.published
        ]

    # ------------------------------------------------------------------ feeding

    def feed_all(self, messages: Iterable[tuple[int, int, str, bytes]]) -> None:
        for seq, now_ms, subject, data in messages:
            self.feed(seq, now_ms, subject, data)

    def feed(self, seq: int, now_ms: int, subject: str, data: bytes) -> list[Action]:
        """Fold or check one stream message; returns the fold's actions for an input event."""
        if seq <= self.last_seq:
            self.duplicates += 1
            return []
        self.last_seq = seq
        if any(subject_matches(p, subject) for p in subjects.inputs):
            return self._feed_input(seq, now_ms, subject, data)
        if subject_matches(_NOTICE_PATTERN, subject):
            self._feed_notice(seq, subject, data)
            return []
        if subject_matches(_OP_STARTED_PATTERN, subject):
            self._feed_op_started(seq, data)
            return []
        self.ignored += 1
        return []

    def _feed_op_started(self, seq: int, data: bytes) -> None:
        try:
            op = _op_started_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.ignored += 1
            return
        self._facts.started(op, seq, self.records.get(op.group))

    def _view(self, group: str) -> _GroupView:
        view = self._views.get(group)
        if view is None:
            view = self._views[group] = _GroupView()
        return view

    @staticmethod
    def _decode(subject: str, data: bytes) -> tuple[str, InputEvent | None]:
        """The orchestrator's admission rules: (group, event), or (group or "", None) if refused."""
        try:
            group, _ = route(subject)
        except ValueError:
            return "", None
        try:
            ev = decode_input(data)
            check_names(subject, ev)
            for kind in ("job", "node"):
                value = getattr(ev, kind, None)
                if value is not None:
                    validate_id(kind, value)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):  # an InvalidId too
            return group, None
        return group, ev

    def _feed_input(self, seq: int, now_ms: int, subject: str, data: bytes) -> list[Action]:
        group, ev = self._decode(subject, data)
        if ev is None:
            self.rejected += 1
            if group:
                self._view(group).stats.rejected += 1
            return []
        self._facts.ended(ev)
        rec = self.records.get(group) or new_record(group)
        try:
            new, actions = apply(rec, ev, now_ms, seq)
        except Exception as exc:
            raise _violation("core-raised", f"apply() raised {exc!r}", group, seq, event=ev, record=rec) from exc
        self.applied += 1
        view = self._view(group)
        view.stats.events += 1
        self.records[group] = new
        if isinstance(ev, Acquire) and ev.claim_epoch is not None and seq > rec.last_seq:
            _check_claim(seq, ev, rec, actions)
            view.stats.claims += 1
        if new is rec:
            if actions:
                raise _violation(
                    "core-unchanged", "an unchanged record comes with no actions", group, seq, actions=actions
                )
            return actions
        try:
            check_record(new)
        except InvariantViolation as exc:
            raise exc.at(seq) from None
        if new.epoch < rec.epoch:
            raise _violation(
                "fold-epoch", "the epoch never goes down", group, seq, before=rec.epoch, after=new.epoch, event=ev
            )
        if rec.reserved is not None and new.reserved is None:
            _check_reservation_end(seq, now_ms, ev, rec, new)
        self._facts.core_ended(rec, new)
        holder = (rec.holder.job, rec.holder.epoch) if rec.holder is not None else None
        for a in actions:
            if not isinstance(a, Notify):
                continue
            n = a.notice
            if isinstance(n, Granted):
                if holder != (n.job, n.epoch):
                    self._facts.granted(n, seq)
                self._fold_grant(view, seq, n, holder)
                holder = (n.job, n.epoch)
            elif isinstance(n, Released | Revoked):
                holder = None
                if isinstance(n, Released) and isinstance(ev, Release) and view.stats.holder == (n.job, n.epoch):
                    # The holder gave the group back itself (its request is in the stream), so it knows its hold
                    # ended even when the Released answer is missing: a notice published while a NATS cluster
                    # elected the stream's leader is not stored. A revocation has no such proof: its notice counts.
                    view.stats.holder = None
        return actions

    @staticmethod
    def _fold_grant(view: _GroupView, seq: int, n: Granted, holder: tuple[str, int] | None) -> None:
        if holder != (n.job, n.epoch):  # not the holder's re-acquire, so a new grant
            if holder is not None:
                raise _violation(
                    "fold-grant-exclusive",
                    "the fold grants only when nobody holds",
                    n.group,
                    seq,
                    granted=n,
                    holder=holder,
                )
            if n.epoch <= view.fold_max_epoch:
                raise _violation(
                    "fold-grant-epoch",
                    "every new grant raises the epoch",
                    n.group,
                    seq,
                    granted=n,
                    max_epoch=view.fold_max_epoch,
                )
            view.fold_max_epoch = n.epoch
            view.stats.fold_grants += 1
        view.decided.setdefault((n.job, n.epoch), set()).add(n.request_id)
        view.decided_order.append((n.job, n.epoch, n.request_id))

    def _feed_notice(self, seq: int, subject: str, data: bytes) -> None:
        tokens = subject.split(".")
        group, job = tokens[3], tokens[4]
        try:
            notice = decode_notice(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _violation(
                "notice-malformed", f"a published notice does not decode: {exc}", group, seq, subject=subject, data=data
            ) from exc
        if notice.group != group or notice.job != job:
            raise _violation(
                "notice-subject",
                "a notice goes out on its own group and job's subject",
                group,
                seq,
                subject=subject,
                notice=notice,
            )
        self.notices += 1
        if not isinstance(notice, Granted | Released | Revoked):
            return
        view = self._view(group)
        if notice.epoch < view.floor_epoch and notice.epoch not in view.epoch_owner:
            return  # about a grant older than the records the checker started from
        if isinstance(notice, Granted):
            self._published_grant(view, seq, notice)
            return
        owner = view.epoch_owner.get(notice.epoch)
        if owner is None and (notice.job, notice.epoch) in view.decided and notice.epoch > view.stats.max_epoch:
            # The fold decided this grant, but its Granted notice is not in the stream: the notice went out while
            # the stream could not store it (a NATS cluster electing the stream's leader). The hold's end shows it.
            # The end of the hold before it may be missing the same way, so the order of notices proves nothing
            # here; the fold (the core never grants while another job holds) does.
            view.stats.unstored_grants += 1
            self._published_grant(
                view,
                seq,
                Granted(
                    group=group,
                    job=notice.job,
                    epoch=notice.epoch,
                    request_id=next(iter(view.decided[(notice.job, notice.epoch)])),
                    waited_ms=0,
                    context_restored=False,
                    lease_deadline_ms=0,
                ),
                unstored=True,
            )
            owner = notice.job
        if owner != notice.job:
            raise _violation(
                "notice-end-unknown",
                f"{type(notice).__name__} ends a hold that was never granted",
                group,
                seq,
                notice=notice,
                epoch_granted_to=owner,
            )
        st = view.stats
        if isinstance(notice, Released):
            st.releases += 1
        else:
            st.revocations += 1
        if st.holder == (notice.job, notice.epoch):
            st.holder = None

    def _published_grant(self, view: _GroupView, seq: int, n: Granted, *, unstored: bool = False) -> None:
        st = view.stats
        group = n.group
        if n.request_id not in view.decided.get((n.job, n.epoch), ()):
            at_epoch = sorted((j, e, sorted(r)) for (j, e), r in view.decided.items() if e == n.epoch)
            raise _violation(
                "grant-agrees-with-fold",
                "a published grant is one the pure core decided from the same events",
                group,
                seq,
                granted=n,
                fold_at_epoch=at_epoch,
            )
        owner = view.epoch_owner.get(n.epoch)
        if owner is not None:
            if owner != n.job:
                raise _violation(
                    "grant-epoch-unique",
                    "two jobs never get the same epoch",
                    group,
                    seq,
                    granted=n,
                    epoch_granted_before_to=owner,
                )
            st.repeated_grants += 1  # the holder's re-acquire, or a grant re-issued after a crash
        else:
            if n.epoch <= st.max_epoch:
                raise _violation(
                    "grant-epoch-rising",
                    "grant epochs never go backwards",
                    group,
                    seq,
                    granted=n,
                    max_epoch=st.max_epoch,
                )
            if self.check_order and st.holder is not None and not unstored:
                raise _violation(
                    "grant-exclusive",
                    "a new grant is published only after the previous holder was told its hold ended",
                    group,
                    seq,
                    granted=n,
                    still_holding=st.holder,
                )
            view.epoch_owner[n.epoch] = n.job
            st.max_epoch = n.epoch
            st.grants += 1
            st.grants_by_job[n.job] = st.grants_by_job.get(n.job, 0) + 1
            st.holder = (n.job, n.epoch)
        view.published.add((n.job, n.epoch, n.request_id))


def _check_reservation_end(seq: int, now_ms: int, ev: InputEvent, before: GroupRecord, after: GroupRecord) -> None:
    """A group kept for a job within its minimum hold (``_min_hold``) is passed on to nobody else before its window
    ends: the reservation ends only by that job's own grant, its window's end, its fault, or its leaving a node."""
    r = before.reserved
    assert r is not None
    if (
        (after.holder is not None and after.holder.job == r.job and after.epoch == r.epoch + 1)
        or now_ms >= r.until_ms
        or r.job in after.faulted
        or (isinstance(ev, JobUnregistered) and ev.job == r.job)
    ):
        return
    raise _violation(
        "min-hold-kept",
        "a group kept for a job within its minimum hold goes to nobody else before its window ends",
        before.group,
        seq,
        reserved=r,
        now_ms=now_ms,
        event=ev,
        holder=after.holder,
        switch=after.switch,
    )


def _check_claim(seq: int, ev: Acquire, before: GroupRecord, actions: list[Action]) -> None:
    """A claim's client holds from its PubAck on: the fold must grant exactly that (job, epoch, request)."""
    for a in actions:
        n = a.notice if isinstance(a, Notify) else None
        if isinstance(n, Granted) and (n.job, n.epoch, n.request_id) == (ev.job, ev.claim_epoch, ev.request_id):
            return
    raise _violation(
        "claim-honoured",
        "a claim (the job's next input after its release with nobody waiting) is granted at the epoch it claims",
        ev.group,
        seq,
        claim=ev,
        record_before=before,
        actions=actions,
    )
