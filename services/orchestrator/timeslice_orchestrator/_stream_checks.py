"""Checks of a ``TIMESLICE`` stream from what it shows alone, for ``timeslice check``.

:class:`~timeslice_orchestrator.invariants.StreamChecker` folds the stream through the pure core and checks
that the orchestrator's notices agree with the fold. :class:`StreamChecks` here trusts neither: it reads the
notices the orchestrator published (grants, hold ends, dequeues), the jobs' inputs and the agents'
operation events, and reports, per group:

* ``overlapping-holds``: a new grant while another job's hold was not yet ended (Released / Revoked);
* ``epoch-duplicate`` / ``epoch-regression``: a new grant at an epoch already granted to another job, or
  below the group's highest granted epoch;
* ``grant-to-departed``: a grant to a request that had left: cancelled (``Cancel``), dequeued
  (``Dequeued``: timeout, lost waiter, released before grant), or decided after its acquire's deadline;
* ``stuck-group``: a job waiting while nothing moves (no grant, no hold ending, no dequeue, no agent
  operation starting or ending, no renewal by the holder) for longer than a threshold, in stream time; an
  agent operation still running within its timeout counts as moving;
* ``grant-while-loaded``: a new grant to job B while the stream shows job A's context possibly still on a
  node of the group: A's snapshot there started (``OpStarted``) with no ``OpResult`` yet, or ended
  ``ok=False`` while A was neither unregistered from that node nor faulted (the fold's record says whether
  it is); a second answer ``ok=False`` to a snapshot that had ended ``ok``, with no start of it open (a restarted
  agent refusing the command delivered again as stale), moved nothing and does not count. The one exception is a
  grant on restore: B's restore of the same switch on that node ended ``ok`` saying
  it ran beside A's snapshot (``OpResult.overlapped``, the agent's room rule) while that snapshot still ran; B
  (and only B) may then be granted before it ends.

A grant that repeats a (job, epoch) already granted (the holder's re-acquire, a grant re-sent to a waiter
that had not heard it, a restarted orchestrator re-publishing) is not a new grant and is not checked again.
Every rule is keyed on message types, enums and ids, never on message text.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, TypeVar

import msgspec
from timeslice_client.protocol import (
    DEFAULT_OP_TIMEOUT_MS,
    Acquire,
    Cancel,
    Dequeued,
    ErrorCode,
    Granted,
    InputEvent,
    JobRegistered,
    JobUnregistered,
    Notice,
    OpKind,
    OpResult,
    OpStarted,
    Refused,
    Release,
    Released,
    Renew,
    Revoked,
    decode_input,
    decode_notice,
)

from .replay._model import StreamEvent

_T = TypeVar("_T")

__all__ = ["DEFAULT_LEASE_MS", "STUCK_MARGIN_MS", "Kind", "StreamChecks", "Violation"]

DEFAULT_LEASE_MS: Final = 30_000  # Acquire.lease_ms's default: the threshold's base before any acquire
STUCK_MARGIN_MS: Final = 10_000  # added to the lease (and to an operation's timeout) before a group is stuck
MAX_ANSWERED: Final = 65_536  # snapshot op ids remembered as answered ok, per group (a late refusal of one)
_LEAVING_CODES: Final = frozenset({ErrorCode.INVALID, ErrorCode.JOB_FAULTED})  # a refused acquire never waited

_op_started: Final = msgspec.json.Decoder(OpStarted)


class Kind(enum.StrEnum):
    """What a violation is."""

    OVERLAPPING_HOLDS = "overlapping-holds"
    EPOCH_REGRESSION = "epoch-regression"
    EPOCH_DUPLICATE = "epoch-duplicate"
    GRANT_TO_DEPARTED = "grant-to-departed"
    STUCK_GROUP = "stuck-group"
    GRANT_WHILE_LOADED = "grant-while-loaded"
    INVARIANT = "invariant"  # a rule of the fold (invariants.StreamChecker); ``rules`` names it


# The fold's rules that say what one of the stream-only kinds says (reported once, under the kind).
FOLD_RULE_KIND: Final[Mapping[str, Kind]] = {
    "grant-exclusive": Kind.OVERLAPPING_HOLDS,
    "fold-grant-exclusive": Kind.OVERLAPPING_HOLDS,
    "grant-epoch-unique": Kind.EPOCH_DUPLICATE,
    "grant-epoch-rising": Kind.EPOCH_REGRESSION,
    "fold-grant-epoch": Kind.EPOCH_REGRESSION,
}


@dataclass(frozen=True)
class Violation:
    """One violation: where it shows (``seq``, ``ts_ms``), the epochs and jobs it is about, and the stream
    events that show it, in stream order."""

    kind: Kind
    group: str
    seq: int
    ts_ms: int
    detail: str
    epochs: tuple[int, ...] = ()
    jobs: tuple[str, ...] = ()
    events: tuple[StreamEvent, ...] = ()
    rules: tuple[str, ...] = ()  # the fold's rules that saw it too (Kind.INVARIANT: the rule itself)


@dataclass
class _Snap:
    failed: bool
    events: list[StreamEvent]
    epoch: int = -1  # its switch's (-1: unknown)


@dataclass
class _Op:
    started: StreamEvent
    node: str
    job: str
    budgets: int = 1  # operation timeouts it may take: a restore's deadline follows its switch's snapshots' (2)


@dataclass
class _Group:
    holder: tuple[str, int, StreamEvent] | None = None  # job, epoch, its Granted, as the notices tell it
    owners: dict[int, tuple[str, StreamEvent]] = field(default_factory=dict)  # epoch -> job, its first Granted
    max_epoch: int = 0
    max_event: StreamEvent | None = None
    acquires: dict[str, tuple[Acquire, StreamEvent]] = field(default_factory=dict)  # request id -> latest
    departed: dict[str, StreamEvent] = field(default_factory=dict)  # request id -> the event it left by
    waiters: dict[str, tuple[str, StreamEvent]] = field(default_factory=dict)  # job -> request id, its Acquire
    stall_from: int = 0  # stream ms since which nothing moved (valid while waiters)
    last_progress: StreamEvent | None = None
    stuck_reported: bool = False
    max_lease_ms: int = 0
    snapshots: dict[tuple[str, str], _Snap] = field(default_factory=dict)  # (node, job) -> unfinished snapshot
    ops: dict[str, _Op] = field(default_factory=dict)  # op id -> started and not ended
    op_timeouts: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, job) -> ms
    gone: set[tuple[str, str]] = field(default_factory=set)  # (node, job) unregistered and not registered again
    left: set[str] = field(default_factory=set)  # op ids started before their job left the node, not yet answered
    # node -> (epoch, job) of the latest restore there that succeeded beside its switch's snapshots (a grant on
    # restore). Kept apart from the snapshots: the agent may publish a snapshot's OpStarted after that restore's
    # OpResult (it starts both at once), and a restarted agent begins the same snapshot again.
    beside: dict[str, tuple[int, str]] = field(default_factory=dict)
    # Snapshot op ids answered ok, newest last (bounded): a later refusal of the same command moved nothing.
    snapshots_ok: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)


class StreamChecks:
    """Feed every stream message in order with :meth:`feed`; :attr:`violations` collects what was found.

    ``stuck_after_ms`` None: a group is stuck after its largest acquire lease plus :data:`STUCK_MARGIN_MS`.
    ``faulted(group)``: the jobs the fold's record says are faulted (a failed snapshot of a faulted job is
    not a context left loaded). ``since_seq``/``since_ms``: report only what shows at or after them (the
    messages before are still read, to know the state there).
    """

    def __init__(
        self,
        *,
        stuck_after_ms: int | None = None,
        faulted: Callable[[str], Mapping[str, str]] = lambda _g: {},
        since_seq: int = 0,
        since_ms: int | None = None,
    ) -> None:
        self.stuck_after_ms = stuck_after_ms
        self._faulted = faulted
        self._since_seq = since_seq
        self._since_ms = since_ms
        self.violations: list[Violation] = []
        self._groups: dict[str, _Group] = {}
        self._waiting: set[str] = set()  # groups with waiters
        self._decided_at: dict[tuple[str, str, int, str], int] = {}  # the fold: grant -> stream ms decided

    # ------------------------------------------------------------------ inputs from the command

    def decided(self, grant: Granted, ts_ms: int) -> None:
        """The fold decided ``grant`` at the input event of stream time ``ts_ms`` (the time the core judged it)."""
        self._decided_at.setdefault((grant.group, grant.job, grant.epoch, grant.request_id), ts_ms)

    def feed(self, ev: StreamEvent) -> None:
        t = ev.subject.split(".")
        if len(t) >= 5 and t[:3] == ["ts", "v1", "notice"]:
            if (notice := _decoded(decode_notice, ev.data)) is not None:
                self._notice(ev, notice)
        elif len(t) == 5 and t[:2] == ["ts", "v1"] and t[2] == "agent" and t[4] == "op":
            if (op := _decoded(_op_started.decode, ev.data)) is not None:
                self._op_started(ev, op)
        elif (
            len(t) >= 4
            and t[:2] == ["ts", "v1"]
            and t[2] in ("job", "ctl", "agent")
            and (inp := _decoded(decode_input, ev.data)) is not None
        ):
            self._input(ev, inp)
        self._check_stuck(ev)

    # ------------------------------------------------------------------ the rules

    def _group(self, name: str) -> _Group:
        g = self._groups.get(name)
        if g is None:
            g = self._groups[name] = _Group()
        return g

    def _report(self, v: Violation) -> None:
        if v.seq >= self._since_seq and (self._since_ms is None or v.ts_ms >= self._since_ms):
            self.violations.append(v)

    def _progress(self, g: _Group, ev: StreamEvent) -> None:
        g.stall_from = ev.ts_ms
        g.last_progress = ev
        g.stuck_reported = False

    def _wait(self, name: str, g: _Group, job: str, rid: str, ev: StreamEvent) -> None:
        if not g.waiters:
            g.stall_from = ev.ts_ms
            g.stuck_reported = False
            self._waiting.add(name)
        g.waiters[job] = (rid, ev)

    def _unwait(self, name: str, g: _Group, job: str, rid: str | None = None) -> None:
        w = g.waiters.get(job)
        if w is not None and (rid is None or w[0] == rid):
            del g.waiters[job]
            if not g.waiters:
                self._waiting.discard(name)

    def _input(self, ev: StreamEvent, inp: InputEvent) -> None:
        name = inp.group
        g = self._group(name)
        if isinstance(inp, Acquire):
            g.acquires[inp.request_id] = (inp, ev)
            g.departed.pop(inp.request_id, None)
            g.max_lease_ms = max(g.max_lease_ms, inp.lease_ms)
            if g.holder is not None and g.holder[0] == inp.job:
                self._progress(g, ev)  # the holder asks again: proof of life
            else:
                self._wait(name, g, inp.job, inp.request_id, ev)
        elif isinstance(inp, Cancel):
            g.departed.setdefault(inp.request_id, ev)
            self._unwait(name, g, inp.job, inp.request_id)
        elif isinstance(inp, Renew):
            if inp.epoch is not None and g.holder is not None and g.holder[:2] == (inp.job, inp.epoch):
                self._progress(g, ev)  # a live hold
        elif isinstance(inp, Release):
            if g.holder is not None and g.holder[:2] == (inp.job, inp.epoch):
                # The holder gave the group back (its request is in the stream). The orchestrator's Released answer
                # may be missing: a notice published while a NATS cluster elected the stream's leader is not stored.
                g.holder = None
                self._progress(g, ev)
        elif isinstance(inp, OpResult):
            ends_a_start = g.ops.pop(inp.op_id, None) is not None
            self._progress(g, ev)
            key = (inp.node, inp.job)
            left = inp.op_id in g.left
            g.left.discard(inp.op_id)
            if inp.kind is OpKind.RESTORE and inp.ok and inp.overlapped:
                g.beside[inp.node] = (inp.epoch, inp.job)
            if inp.kind is OpKind.SNAPSHOT:
                if inp.ok:
                    g.snapshots_ok[inp.op_id] = None
                    g.snapshots_ok.move_to_end(inp.op_id)
                    while len(g.snapshots_ok) > MAX_ANSWERED:
                        g.snapshots_ok.popitem(last=False)
                if not inp.ok and not ends_a_start and inp.op_id in g.snapshots_ok:
                    # A second answer to a snapshot that ended ok, with no start of it open: a restarted agent
                    # refused the command delivered again (its epoch older than the job's), moving nothing. The
                    # orchestrator takes the first answer only; so does this check.
                    pass
                elif inp.ok or key in g.gone or left:
                    # A job whose processes ended mid-snapshot is unregistered first, then its snapshot answered as
                    # failed (the agent's order): its context went with its processes. So did that of a snapshot
                    # started before its job left, answered after other processes registered as the job.
                    g.snapshots.pop(key, None)
                else:
                    snap = g.snapshots.setdefault(key, _Snap(failed=True, events=[]))
                    snap.failed = True
                    snap.events.append(ev)
        elif isinstance(inp, JobUnregistered):
            g.snapshots.pop((inp.node, inp.job), None)  # the job's process left the node, its context with it
            g.left.update(i for i, op in g.ops.items() if (op.node, op.job) == (inp.node, inp.job))
            g.op_timeouts.pop((inp.node, inp.job), None)
            g.gone.add((inp.node, inp.job))
        elif isinstance(inp, JobRegistered):
            g.op_timeouts[(inp.node, inp.job)] = inp.op_timeout_ms
            g.gone.discard((inp.node, inp.job))

    def _op_started(self, ev: StreamEvent, op: OpStarted) -> None:
        g = self._group(op.group)
        g.ops[op.op_id] = _Op(ev, op.node, op.job, budgets=2 if op.kind is OpKind.RESTORE else 1)
        self._progress(g, ev)
        if op.kind is OpKind.SNAPSHOT:
            g.snapshots[(op.node, op.job)] = _Snap(failed=False, events=[ev], epoch=op.epoch)

    def _notice(self, ev: StreamEvent, n: Notice) -> None:
        name = n.group
        g = self._group(name)
        if isinstance(n, Granted):
            self._progress(g, ev)
            self._unwait(name, g, n.job)
            owner = g.owners.get(n.epoch)
            if owner is None or owner[0] != n.job:
                self._new_grant(name, g, ev, n)
        elif isinstance(n, Released | Revoked):
            self._progress(g, ev)
            if g.holder is not None and g.holder[:2] == (n.job, n.epoch):
                g.holder = None
        elif isinstance(n, Dequeued):
            self._progress(g, ev)
            g.departed.setdefault(n.request_id, ev)
            self._unwait(name, g, n.job, n.request_id)
        elif isinstance(n, Refused) and n.code in _LEAVING_CODES:
            self._unwait(name, g, n.job, n.request_id)

    def _new_grant(self, name: str, g: _Group, ev: StreamEvent, n: Granted) -> None:
        owner = g.owners.get(n.epoch)
        if owner is not None:
            self._report(
                Violation(
                    Kind.EPOCH_DUPLICATE,
                    name,
                    ev.seq,
                    ev.ts_ms,
                    f"epoch {n.epoch} granted to job {n.job!r} was granted to job {owner[0]!r} "
                    f"before (seq {owner[1].seq})",
                    (n.epoch,),
                    (owner[0], n.job),
                    (owner[1], ev),
                )
            )
        elif n.epoch <= g.max_epoch and g.max_event is not None:
            self._report(
                Violation(
                    Kind.EPOCH_REGRESSION,
                    name,
                    ev.seq,
                    ev.ts_ms,
                    f"job {n.job!r} was granted epoch {n.epoch}, below epoch {g.max_epoch} granted "
                    f"before (seq {g.max_event.seq})",
                    (n.epoch, g.max_epoch),
                    (_job_of(g.max_event), n.job),
                    (g.max_event, ev),
                )
            )
        h = g.holder
        if h is not None and h[0] != n.job:
            self._report(
                Violation(
                    Kind.OVERLAPPING_HOLDS,
                    name,
                    ev.seq,
                    ev.ts_ms,
                    f"job {n.job!r} was granted epoch {n.epoch} while job {h[0]!r} still held epoch "
                    f"{h[1]} (granted at seq {h[2].seq}, never released or revoked)",
                    (h[1], n.epoch),
                    (h[0], n.job),
                    (h[2], ev),
                )
            )
        self._departed(name, g, ev, n)
        self._loaded(name, g, ev, n)
        if owner is None:
            g.owners[n.epoch] = (n.job, ev)
        if n.epoch > g.max_epoch:
            g.max_epoch, g.max_event = n.epoch, ev
        g.holder = (n.job, n.epoch, ev)

    def _departed(self, name: str, g: _Group, ev: StreamEvent, n: Granted) -> None:
        left = g.departed.get(n.request_id)
        acq = g.acquires.get(n.request_id)
        decided = self._decided_at.pop((name, n.job, n.epoch, n.request_id), ev.ts_ms)
        why = ""  # none: it had not departed
        shown: tuple[StreamEvent, ...] = ()
        if left is not None:
            how = "cancelled" if left.subject.startswith("ts.v1.job.") else "dequeued"
            shown = (acq[1], left, ev) if acq is not None and acq[1].seq < left.seq else (left, ev)
            why = f", which had {how} (seq {left.seq}) and did not acquire again"
        elif acq is not None and acq[0].claim_epoch is None:
            a, aev = acq
            deadline = aev.ts_ms + a.timeout_ms
            if decided >= deadline and decided > aev.ts_ms:
                shown = (aev, ev)
                why = (
                    f" at stream time {decided}, {decided - deadline} ms after its acquire's "
                    f"deadline (timeout_ms={a.timeout_ms}): the waiter had timed out"
                )
        if why:
            self._report(
                Violation(
                    Kind.GRANT_TO_DEPARTED,
                    name,
                    ev.seq,
                    ev.ts_ms,
                    f"job {n.job!r} was granted epoch {n.epoch} for request {n.request_id!r}{why}",
                    (n.epoch,),
                    (n.job,),
                    shown,
                )
            )

    def _loaded(self, name: str, g: _Group, ev: StreamEvent, n: Granted) -> None:
        faulted = self._faulted(name)
        for (node, job), snap in sorted(g.snapshots.items()):
            if (
                job == n.job
                or (snap.failed and job in faulted)
                or (not snap.failed and g.beside.get(node) == (snap.epoch, n.job))
            ):
                continue  # (the last: a grant on restore, the snapshot trailing it)
            timeout = g.op_timeouts.get((node, job), DEFAULT_OP_TIMEOUT_MS)
            if not snap.failed and job in faulted and ev.ts_ms >= snap.events[0].ts_ms + timeout:
                continue  # unanswered past its deadline: the job was faulted, its state unknown (the core's rule)
            why = (
                (
                    f"its snapshot there failed (seq {snap.events[-1].seq}) and the job was neither unregistered "
                    "from the node nor faulted"
                )
                if snap.failed
                else f"its snapshot there started (seq {snap.events[0].seq}) and had not ended"
            )
            self._report(
                Violation(
                    Kind.GRANT_WHILE_LOADED,
                    name,
                    ev.seq,
                    ev.ts_ms,
                    f"job {n.job!r} was granted epoch {n.epoch} while the context of job {job!r} may "
                    f"still be loaded on node {node!r}: {why}",
                    (n.epoch,),
                    (job, n.job),
                    (*snap.events, ev),
                )
            )
        for key in [k for k in g.snapshots if k[1] == n.job]:
            del g.snapshots[key]  # the grantee's own context is where it belongs

    def _threshold(self, g: _Group) -> int:
        if self.stuck_after_ms is not None:
            return self.stuck_after_ms
        return (g.max_lease_ms or DEFAULT_LEASE_MS) + STUCK_MARGIN_MS

    def _check_stuck(self, ev: StreamEvent) -> None:
        now = ev.ts_ms
        for name in sorted(self._waiting):
            g = self._groups[name]
            if g.stuck_reported or now - g.stall_from <= self._threshold(g):
                continue
            if any(
                now
                <= op.started.ts_ms
                + op.budgets * g.op_timeouts.get((op.node, op.job), DEFAULT_OP_TIMEOUT_MS)
                + STUCK_MARGIN_MS
                for op in g.ops.values()
            ):
                continue  # an operation still runs within its timeout: the switch is moving
            g.stuck_reported = True
            waiting = sorted(g.waiters.items(), key=lambda kv: kv[1][1].seq)
            shown = [w[1] for _, w in waiting]
            if g.last_progress is not None:
                shown.append(g.last_progress)
            if ev not in shown:
                shown.append(ev)
            holder = f"job {g.holder[0]!r} holds epoch {g.holder[1]}" if g.holder else "nobody holds it"
            since = f"seq {g.last_progress.seq}" if g.last_progress is not None else "the first waiter"
            self._report(
                Violation(
                    Kind.STUCK_GROUP,
                    name,
                    ev.seq,
                    ev.ts_ms,
                    f"{len(waiting)} job(s) waited ({', '.join(j for j, _ in waiting)}) for "
                    f"{(now - g.stall_from) / 1000:.1f} s of stream time with nothing moving since {since} (no grant, "
                    f"no hold ending, no dequeue, no agent operation, no renewal by a holder; threshold "
                    f"{self._threshold(g) / 1000:.1f} s); {holder}",
                    (g.holder[1],) if g.holder else ((g.max_epoch,) if g.max_epoch else ()),
                    tuple(j for j, _ in waiting),
                    tuple(sorted(shown, key=lambda e: e.seq)),
                )
            )

    # ------------------------------------------------------------------ results

    @property
    def groups(self) -> list[str]:
        return sorted(self._groups)


def _job_of(ev: StreamEvent) -> str:
    t = ev.subject.split(".")
    return t[4] if len(t) > 4 else "?"


def _decoded(decode: Callable[[bytes], _T], data: bytes) -> _T | None:
    """``decode(data)``, or None where it does not decode: the checks read what they can of the stream."""
    try:
        return decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
