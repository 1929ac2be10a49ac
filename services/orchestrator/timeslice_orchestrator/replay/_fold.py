"""Fold stream messages through the orchestrator's pure core and reconstruct intervals.

The fold is :class:`~timeslice_orchestrator.invariants.StreamChecker`: the same admission rules as the
orchestrator, the same :func:`~timeslice_orchestrator.core.apply`, invariants checked on the way. This
module only *watches* the fold: after each input event it compares the group's record before and after
(holder, waiters, switch, loaded/saved contexts, faults) and reads the actions the core returned
(notices, agent commands). It never decides anything itself, so a replay cannot disagree with the
orchestrator. The agent's own facts (``OpStarted``; ``OpResult``'s bytes and timings) and the jobs'
``Phase`` events only add detail to intervals the fold already determined.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

import msgspec
from timeslice_client.protocol import (
    Dequeued,
    Granted,
    GroupRecord,
    JobState,
    Notice,
    OpKind,
    OpResult,
    OpStarted,
    Phase,
    Refused,
    Revoked,
    Snapshot,
    YieldRequested,
    decode_input,
    subjects,
)

from .._fair_share import describe
from .._min_hold import reservation_change
from .._op_facts import pending_ops
from ..core import Action, Command, Notify
from ..invariants import InvariantViolation, StreamChecker, subject_matches
from ._model import (
    FairShareChoice,
    Fault,
    GroupTimeline,
    Handoff,
    HoldInterval,
    JobLane,
    MinHold,
    OpBar,
    PhaseSpan,
    Replay,
    StateInterval,
    StreamEvent,
    SwitchInterval,
    WaitInterval,
)
from ._predictions import observe_predictions
from ._summary import summarize

__all__ = ["fold_events", "group_of"]

_OP_STARTED = "ts.v1.agent.*.op"
_op_started_decoder = msgspec.json.Decoder(OpStarted)


def group_of(subject: str, data: bytes) -> str | None:
    """The group a stream message is about, or None (not a timeslice message, or undecodable)."""
    t = subject.split(".")
    if len(t) < 4 or t[0] != "ts" or t[1] != "v1":
        return None
    if t[2] in ("job", "ctl", "notice", "group"):
        return t[3]
    if t[2] == "agent" and len(t) == 6 and t[4] == "evt":
        return t[5]
    if t[2] == "agent" and len(t) == 5 and t[4] == "op":
        try:
            return _op_started_decoder.decode(data).group
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
    return None


@dataclass
class _GroupWatch:
    timeline: GroupTimeline
    hold: HoldInterval | None = None
    last_hold: HoldInterval | None = None
    waits: dict[str, WaitInterval] = field(default_factory=dict)
    switch: SwitchInterval | None = None
    lanes: set[tuple[str, str]] = field(default_factory=set)  # (node, job) lanes with an open state


def _waiting(rec: GroupRecord | None) -> dict[str, int]:
    """job -> enqueued_at_ms of every job waiting in ``rec`` (the queue and a switch's target)."""
    if rec is None:
        return {}
    out = {w.job: w.enqueued_at_ms for w in rec.queue}
    if rec.switch is not None and rec.switch.to is not None:
        out[rec.switch.to.job] = rec.switch.to.enqueued_at_ms
    return out


def _lane_states(rec: GroupRecord, early: Set[str] = frozenset()) -> dict[tuple[str, str], str]:
    """(node, job) -> the context's state as the record tells it. A restore issued with the snapshots counts
    as moving only once no snapshot is pending on its node (the agent runs it after them), unless its
    ``OpStarted`` said it overlapped them (its op id in ``early``). A snapshot trailing a grant on restore moves too."""
    ops = pending_ops(rec)
    snapshotting = {op.node for op in ops if op.kind is OpKind.SNAPSHOT}
    pending = {
        (op.node, op.job)
        for op in ops
        if op.kind is OpKind.SNAPSHOT or op.node not in snapshotting or op.op_id in early
    }
    out: dict[tuple[str, str], str] = {}
    for job, nodes in rec.placements.items():
        for node in nodes:
            key = (node, job)
            if key in pending:
                out[key] = JobState.TRANSITIONING
            elif job in rec.faulted:
                out[key] = JobState.FAULTED
            elif rec.loaded.get(node) == job:
                out[key] = JobState.RUNNING
            elif node in rec.saved.get(job, ()):
                out[key] = JobState.SAVED
            else:
                out[key] = JobState.IDLE
    for node, job in pending:
        out.setdefault((node, job), JobState.TRANSITIONING)
    return out


class _Folder:
    def __init__(self, records: Mapping[str, GroupRecord] | None, group: str | None, until_ms: int | None) -> None:
        self.checker = StreamChecker(records)
        self.only = group
        self.until_ms = until_ms
        self.groups: dict[str, _GroupWatch] = {}
        self.lanes: dict[tuple[str, str], JobLane] = {}
        self.ops: dict[str, OpBar] = {}
        self.phases: dict[str, list[PhaseSpan]] = {}
        self.open_phases: dict[tuple[str, str, str], PhaseSpan] = {}
        self.early: set[str] = set()  # op ids of restores that started beside their snapshots (overlapped)
        self.violations: list[str] = []
        self.first_ts: int | None = None
        self.last_ts: int | None = None
        self.first_seq = 0
        self.last_seq = 0
        for g, rec in (records or {}).items():
            if group is None or g == group:
                self._watch(g).hold = self._hold_of(rec, rec.since_ms)

    # ------------------------------------------------------------------ plumbing

    def _watch(self, group: str) -> _GroupWatch:
        w = self.groups.get(group)
        if w is None:
            w = self.groups[group] = _GroupWatch(GroupTimeline(group))
        return w

    def _lane(self, node: str, job: str, group: str) -> JobLane:
        lane = self.lanes.get((node, job))
        if lane is None:
            lane = self.lanes[(node, job)] = JobLane(node=node, job=job, group=group)
        return lane

    @staticmethod
    def _hold_of(rec: GroupRecord, ts: int) -> HoldInterval | None:
        h = rec.holder
        if h is None:
            return None
        return HoldInterval(job=h.job, epoch=h.epoch, start_ms=h.granted_at_ms or ts, request_id=h.request_id)

    # ------------------------------------------------------------------ feeding

    def feed(self, e: StreamEvent) -> None:
        if self.until_ms is not None and e.ts_ms > self.until_ms:
            return
        group = group_of(e.subject, e.data)
        if group is None or (self.only is not None and group != self.only):
            return
        if self.first_ts is None:
            self.first_ts, self.first_seq = e.ts_ms, e.seq
        self.last_ts, self.last_seq = e.ts_ms, max(self.last_seq, e.seq)
        if subject_matches(_OP_STARTED, e.subject):
            self._op_started(e)
            self._check(e)
            return
        if not any(subject_matches(p, e.subject) for p in subjects.inputs):
            self._check(e)  # notices and state changes: the checker compares them with the fold
            return
        before = self.checker.records.get(group)
        seq_before = self.checker.last_seq
        actions = self._check(e)
        if self.checker.last_seq == seq_before:
            return  # a duplicate
        after = self.checker.records.get(group)
        if after is None:
            return  # refused by the orchestrator's admission rules
        watch = self._watch(group)
        if after is not before:
            watch.timeline.events += 1
        try:
            ev = decode_input(e.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if isinstance(ev, OpResult):
            self._op_result(e.ts_ms, ev)  # first: the op leaves the switch in this very event
        elif isinstance(ev, Phase):
            self._phase(e.ts_ms, ev)
        self._observe(watch, e.ts_ms, before, after, actions)

    def _check(self, e: StreamEvent) -> list[Action]:
        try:
            return self.checker.feed(e.seq, e.ts_ms, e.subject, e.data)
        except InvariantViolation as exc:
            self.violations.append(str(exc))
            return []

    # ------------------------------------------------------------------ what one event changed

    def _observe(
        self, w: _GroupWatch, ts: int, before: GroupRecord | None, after: GroupRecord, actions: list[Action]
    ) -> None:
        notices = [a.notice for a in actions if isinstance(a, Notify)]
        self._observe_switch(w, ts, before, after)
        self._observe_waits(w, ts, before, after, notices)
        self._observe_hold(w, ts, after, notices)
        for n in notices:
            if isinstance(n, YieldRequested) and w.hold is not None and w.hold.epoch == n.epoch:
                w.hold.yield_requested_ms = ts
        tl = w.timeline
        observe_predictions(tl.predictions, ts, before, after, notices)
        pick = after.picked
        if pick is not None and pick != (before.picked if before is not None else None):
            tl.fair_shares.append(FairShareChoice(job=pick.job, over=pick.over, ts_ms=ts, why=describe(pick)))
        kept = reservation_change(before, after, ts)
        if kept not in (None, "kept") and tl.min_holds and tl.min_holds[-1].end_ms is None:
            tl.min_holds[-1].end_ms, tl.min_holds[-1].outcome = ts, kept
        if kept == "kept" and after.reserved is not None:
            r = after.reserved
            tl.min_holds.append(MinHold(job=r.job, epoch=r.epoch, start_ms=ts, until_ms=r.until_ms))
        old_faults = before.faulted if before is not None else {}
        for job, reason in after.faulted.items():
            if job not in old_faults:
                tl.faults.append(Fault(job=job, ts_ms=ts, reason=reason))
        for a in actions:
            if isinstance(a, Command):
                c = a.command
                kind = OpKind.SNAPSHOT if isinstance(c, Snapshot) else OpKind.RESTORE
                issued = OpBar(op_id=c.op_id, kind=str(kind), epoch=c.epoch, start_ms=ts, issued_ms=ts)
                self.ops[c.op_id] = issued
                self._lane(c.node, c.job, after.group).ops.append(issued)
        pending_after = {op.op_id for op in pending_ops(after)}  # a snapshot trailing a grant is still pending
        for op in pending_ops(before):
            bar = self.ops.get(op.op_id)
            if op.op_id not in pending_after and bar is not None and bar.end_ms is None:
                bar.end_ms, bar.ok = ts, False  # ended by the core without an answer (timeout, agent lost)
        self._observe_lanes(w, ts, after)

    def _observe_hold(self, w: _GroupWatch, ts: int, after: GroupRecord, notices: Sequence[Notice]) -> None:
        cur = w.hold
        new = (after.holder.job, after.holder.epoch) if after.holder is not None else None
        if cur is not None and (cur.job, cur.epoch) == new:
            return
        if cur is not None:
            cur.end_ms = ts
            cur.end = next((n.reason for n in notices if isinstance(n, Revoked) and n.epoch == cur.epoch), "released")
            w.last_hold = cur
            w.hold = None
        if after.holder is None:
            return
        hold = self._hold_of(after, ts)
        assert hold is not None
        hold.start_ms = ts
        grant = next((n for n in notices if isinstance(n, Granted) and n.epoch == hold.epoch), None)
        if grant is not None:
            hold.context_restored, hold.waited_ms = grant.context_restored, grant.waited_ms
        w.hold = hold
        w.timeline.holds.append(hold)
        prev = w.last_hold
        if prev is not None and prev.job != hold.job and prev.end_ms is not None:
            w.timeline.handoffs.append(
                Handoff(from_job=prev.job, to_job=hold.job, epoch=hold.epoch, released_ms=prev.end_ms, granted_ms=ts)
            )

    def _observe_waits(
        self, w: _GroupWatch, ts: int, before: GroupRecord | None, after: GroupRecord, notices: Sequence[Notice]
    ) -> None:
        now = _waiting(after)
        for job, wait in list(w.waits.items()):
            if job in now:
                continue
            wait.end_ms = ts
            h = after.holder
            if h is not None and h.job == job and h.granted_at_ms == ts:
                wait.outcome, wait.epoch = "granted", h.epoch
            else:
                wait.outcome = "left"
                for n in notices:
                    if isinstance(n, Dequeued) and n.job == job:
                        wait.outcome = str(n.code) if n.code is not None else n.reason  # the reason: older streams
                    elif isinstance(n, Refused) and n.job == job:
                        wait.outcome = f"refused: {n.code}"
            del w.waits[job]
        classes = {wr.job: wr.priority for wr in after.queue}
        for job, enqueued in now.items():
            if job not in w.waits:
                wait = WaitInterval(job=job, start_ms=enqueued, priority=classes.get(job, 0))
                w.waits[job] = wait
                w.timeline.waits.append(wait)

    def _observe_switch(self, w: _GroupWatch, ts: int, before: GroupRecord | None, after: GroupRecord) -> None:
        sw = after.switch
        cur = w.switch
        if cur is not None and (sw is None or sw.epoch != cur.epoch):
            cur.end_ms = ts
            cur.granted = after.holder is not None and after.holder.epoch == cur.epoch
            w.switch = cur = None
        if sw is None:
            return
        if cur is None:
            cur = SwitchInterval(epoch=sw.epoch, to_job=sw.to.job if sw.to else None, start_ms=sw.started_at_ms)
            w.switch = cur
            w.timeline.switches.append(cur)
        if sw.to is None:
            cur.to_job = None
        if (
            sw.phase is OpKind.RESTORE
            and cur.restore_from_ms is None
            and not any(op.kind is OpKind.SNAPSHOT for op in sw.ops)
        ):
            cur.restore_from_ms = ts  # restores are issued with the snapshots; they run once those ended
        for op in sw.ops:
            if op.kind is OpKind.SNAPSHOT and op.job not in cur.snapshotted:
                cur.snapshotted.append(op.job)

    def _observe_lanes(self, w: _GroupWatch, ts: int, after: GroupRecord) -> None:
        states = _lane_states(after, self.early)
        for key in w.lanes - states.keys():
            lane = self.lanes[key]
            lane.states[-1].end_ms = ts  # unregistered, or its agent was lost
        for key, state in states.items():
            lane = self._lane(key[0], key[1], after.group)
            last = lane.states[-1] if lane.states and lane.states[-1].end_ms is None else None
            if last is not None and last.state == state:
                continue
            if last is not None:
                last.end_ms = ts
            lane.states.append(StateInterval(state=str(state), start_ms=ts))
        w.lanes = set(states)

    # ------------------------------------------------------------------ detail from the agent and the jobs

    def _op_started(self, e: StreamEvent) -> None:
        try:
            ev = _op_started_decoder.decode(e.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        known = self.ops.get(ev.op_id)
        if known is None:  # an operation the core did not issue (standalone use of the agent)
            bar = OpBar(op_id=ev.op_id, kind=str(ev.kind), epoch=ev.epoch, start_ms=e.ts_ms, issued_ms=e.ts_ms)
            self.ops[ev.op_id] = bar
            self._lane(ev.node, ev.job, ev.group).ops.append(bar)
        else:
            bar = known
            if bar.end_ms is None:
                bar.start_ms = e.ts_ms
        bar.backend = ev.backend
        if ev.overlapped and ev.kind is OpKind.RESTORE and ev.op_id not in self.early:
            # It started beside the snapshots: its lane moves and its switch restores from now on.
            self.early.add(ev.op_id)
            rec = self.checker.records.get(ev.group)
            w = self.groups.get(ev.group)
            if rec is not None and w is not None:
                if w.switch is not None and w.switch.epoch == ev.epoch and w.switch.restore_from_ms is None:
                    w.switch.restore_from_ms = e.ts_ms
                self._observe_lanes(w, e.ts_ms, rec)

    def _op_result(self, ts: int, ev: OpResult) -> None:
        bar = self.ops.get(ev.op_id)
        if bar is None:
            return
        if bar.end_ms is None:
            bar.end_ms, bar.ok, bar.error = ts, ev.ok, ev.error
        else:  # the core had given up on it (timeout, agent lost): a late answer only adds detail
            bar.error = bar.error or f"answered after the core gave up (ok={ev.ok})"
        bar.bytes, bar.device_bytes_freed = ev.bytes_moved, ev.device_bytes_freed
        bar.elapsed_ms, bar.backend = ev.elapsed_ms, ev.backend
        bar.work_ms, bar.began_at_release = ev.work_ms, ev.began_at_release

    def _phase(self, ts: int, ev: Phase) -> None:
        key = (ev.group, ev.job, ev.name)
        if ev.edge == "start":
            span = PhaseSpan(name=ev.name, group=ev.group, start_ms=ts, epoch=ev.epoch)
            old = self.open_phases.get(key)
            if old is not None:
                old.end_ms = ts  # a start without the previous end (the job died mid-phase)
            self.open_phases[key] = span
            self.phases.setdefault(ev.job, []).append(span)
            return
        ended = self.open_phases.pop(key, None)
        if ended is not None:
            ended.end_ms = ts
            ended.error = ev.error

    # ------------------------------------------------------------------ the result

    def finish(self, since_ms: int | None, until_ms: int | None) -> Replay:
        first = self.first_ts if self.first_ts is not None else 0
        last = self.last_ts if self.last_ts is not None else first
        since = since_ms if since_ms is not None else first
        until = until_ms if until_ms is not None else max(last, since)
        groups = {g: _clip_timeline(w.timeline, since) for g, w in sorted(self.groups.items())}
        lanes = {k: _clip_lane(lane, since) for k, lane in sorted(self.lanes.items())}
        phases = {
            j: [p for p in spans if _overlaps(p.start_ms, p.end_ms, since)] for j, spans in sorted(self.phases.items())
        }
        phases = {j: spans for j, spans in phases.items() if spans}
        summary = summarize(groups, lanes, phases, since, until)
        return Replay(
            since_ms=since,
            until_ms=until,
            groups=groups,
            nodes=lanes,
            phases=phases,
            summary=summary,
            violations=self.violations,
            first_seq=self.first_seq,
            last_seq=self.last_seq,
        )


def _overlaps(start: int, end: int | None, since: int) -> bool:
    return end is None or end >= since


def _clip_timeline(tl: GroupTimeline, since: int) -> GroupTimeline:
    """The intervals that reach into the window (those that ended before it are history, not shown)."""
    return GroupTimeline(
        group=tl.group,
        holds=[h for h in tl.holds if _overlaps(h.start_ms, h.end_ms, since)],
        waits=[w for w in tl.waits if _overlaps(w.start_ms, w.end_ms, since)],
        switches=[s for s in tl.switches if _overlaps(s.start_ms, s.end_ms, since)],
        handoffs=[h for h in tl.handoffs if h.granted_ms >= since],
        faults=[f for f in tl.faults if f.ts_ms >= since],
        min_holds=[m for m in tl.min_holds if _overlaps(m.start_ms, m.end_ms, since)],
        fair_shares=[c for c in tl.fair_shares if c.ts_ms >= since],
        predictions=[p for p in tl.predictions if _overlaps(p.ts_ms, p.end_ms, since)],
        lease_expiries=sum(1 for h in tl.holds if h.end_ms is not None and h.end_ms >= since and h.end != "released"),
        events=tl.events,
    )


def _clip_lane(lane: JobLane, since: int) -> JobLane:
    return JobLane(
        node=lane.node,
        job=lane.job,
        group=lane.group,
        states=[s for s in lane.states if _overlaps(s.start_ms, s.end_ms, since)],
        ops=[o for o in lane.ops if _overlaps(o.start_ms, o.end_ms, since)],
    )


def fold_events(
    events: Iterable[StreamEvent],
    *,
    records: Mapping[str, GroupRecord] | None = None,
    group: str | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
) -> Replay:
    """Fold ``events`` (stream order) through the orchestrator's pure core and rebuild the intervals.

    ``records`` starts the fold from stored records (a stream whose head was discarded); otherwise every
    group starts empty, so pass the history *before* the window too (``read_window`` does): the window
    ``[since_ms, until_ms]`` only selects what is shown and summarised. ``group`` keeps one group.
    Events after ``until_ms`` are not folded. Invariant violations met on the way are kept in
    :attr:`Replay.violations` (a replay is how one finds out what went wrong) instead of stopping it.
    """
    folder = _Folder(records, group, until_ms)
    for e in events:
        folder.feed(e)
    return folder.finish(since_ms, until_ms)
