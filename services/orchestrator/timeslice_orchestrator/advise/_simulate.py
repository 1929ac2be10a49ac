"""Jobs' phase sequences replayed through the orchestrator's pure core, in simulated time.

Every input the live orchestrator would consume (``JobRegistered``, ``Acquire``, ``Renew``, ``Release``,
``OpResult``, ``Tick``) is fed to :func:`timeslice_orchestrator.core.apply` in time order, with the simulated time
as the event's stream timestamp and a rising sequence number, as the orchestrator applies stream events. The core's
actions drive a simulated world:

* a job runs its phases in order: off the accelerators it just takes the phase's time; on them it acquires (one
  bus pass, ``hop_s``, to the stream), waits for its ``Granted`` notice (one pass back), holds the group for the
  phase's time and releases;
* as the real client does, a job confirms each grant and keeps its lease with renewals, and keeps its place while
  it waits, so windows never lapse in a long run;
* a ``Snapshot``/``Restore`` reaches the simulated agent one pass after the core sent it; it takes the job's
  :class:`SwitchCost` (nothing for a context already where it should be, as the real agent does), and its
  ``OpResult`` enters the stream one pass after it ended. Without ``room`` a restore starts once the snapshots it
  follows (``Restore.after``) are done; with ``room`` (the node fits both contexts: the agent's room rule) it
  starts at once and says so (``OpResult.overlapped``), so the core grants on it while the snapshot still runs;
* ``Tick`` events come at the record's next deadline, as the orchestrator's timer sends them.

An hour-long run of a few jobs is a few thousand events: well under a second.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from timeslice_client.protocol import (
    Acquire,
    Granted,
    InputEvent,
    JobRegistered,
    OpKind,
    OpResult,
    Release,
    Renew,
    Restore,
    Snapshot,
    Tick,
)

from .._errors import AdviseError
from ..core import Command, Notify, apply, new_record, next_deadline
from ._model import Phase, SwitchCost

__all__ = ["AgentOp", "Log", "LogKind", "SimRun", "agent_op", "client_acquire", "simulate"]

LogKind = Literal["acquire", "grant", "release", "end"]
Log = dict[str, list[tuple[LogKind, float]]]  # per job: when it asked, was granted, released, ended (seconds)

NODE = "sim"
LEASE_MS = 24 * 3600 * 1000  # the longest lease the core takes: renewed a third of the way, as the client does
WAITER_TTL_MS = 600_000  # the longest waiter window the core takes (renewed likewise)
CONFIRM_MS = 600_000
TIMEOUT_MS = 7 * 24 * 3600 * 1000  # no simulated wait ever gives up
MAX_EVENTS = 5_000_000  # a bound on one simulation (a run this long would take minutes; the caller says too long)


def client_acquire(group: str, job: str, request_id: str, priority: int = 0) -> Acquire:
    """The ``Acquire`` a simulated job sends: the longest lease and windows the core takes, which the job keeps alive
    with renewals a third of the way (``LEASE_MS``, ``WAITER_TTL_MS``), and a wait that never gives up, so that no
    simulated run, however long, loses a hold or a place to a lapse. Shared with the bench's multi-pool simulation."""
    return Acquire(
        group=group,
        job=job,
        request_id=request_id,
        lease_ms=LEASE_MS,
        timeout_ms=TIMEOUT_MS,
        waiter_ttl_ms=WAITER_TTL_MS,
        confirm_ms=CONFIRM_MS,
        priority=priority,
    )


@dataclass(frozen=True)
class SimRun:
    log: Log
    events: int  # inputs the core applied


class _Sim:
    def __init__(
        self,
        phases: Mapping[str, Sequence[Phase]],
        costs: Mapping[str, SwitchCost],
        hop_s: float,
        room: bool,
        group: str,
        priorities: Mapping[str, int],
    ) -> None:
        self.group, self.hop, self.room, self.costs = group, hop_s, room, costs
        self.priorities = priorities
        self.rec = new_record(group)
        self.seq = 0
        self.heap: list[tuple[float, int, str, Any]] = []
        self.order = itertools.count()
        self.phases = {j: list(p) for j, p in phases.items()}
        self.cursor = dict.fromkeys(phases, 0)
        self.epoch: dict[str, int] = {}  # the job's current hold
        self.waiting: dict[str, str] = {}  # job -> the request id it waits with
        self.ctx = dict.fromkeys(phases, "IDLE")  # the simulated agent's view: IDLE, RUNNING, SAVED
        self.finished_at: dict[str, float] = {}  # op id -> when the simulated agent finished it
        self.log: Log = {j: [] for j in phases}
        self.rids = itertools.count()
        self.ticks: set[int] = set()
        self.hold_for: dict[str, float] = {}  # acquire request id -> the accelerator phase's length
        self.events = 0

    def push(self, t: float, kind: str, data: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.order), kind, data))

    def rid(self, prefix: str) -> str:
        return f"{prefix}{next(self.rids)}"

    def run(self) -> Log:
        for j in self.phases:
            self.push(0.0, "input", JobRegistered(group=self.group, job=j, node=NODE, backend="app_channel"))
            self.push(0.0, "next", j)
        while self.heap:
            t, _, kind, data = heapq.heappop(self.heap)
            if kind == "input":
                self._apply(t, data)
            elif kind == "next":
                self._next(t, data)
            elif kind == "granted":
                self._granted(t, *data)
            elif kind == "release":
                self._release(t, data)
            elif kind == "renew_wait":
                job, rid = data
                if self.waiting.get(job) == rid:  # still waiting with it
                    self.push(t + self.hop, "input", Renew(group=self.group, job=job, request_id=rid))
                    self.push(t + WAITER_TTL_MS / 3000, "renew_wait", data)
            elif kind == "renew_hold":
                job, epoch = data
                if self.epoch.get(job) == epoch:  # still holding it
                    self.push(
                        t + self.hop, "input", Renew(group=self.group, job=job, request_id=self.rid("h"), epoch=epoch)
                    )
                    self.push(t + LEASE_MS / 3000, "renew_hold", data)
        return self.log

    def _next(self, t: float, job: str) -> None:
        i = self.cursor[job]
        if i == len(self.phases[job]):
            self.log[job].append(("end", t))
            return
        self.cursor[job] = i + 1
        phase = self.phases[job][i]
        if not phase.on_accelerator:
            self.push(t + phase.seconds, "next", job)
            return
        self.log[job].append(("acquire", t))
        rid = self.rid("a")
        self.hold_for[rid] = phase.seconds
        self.waiting[job] = rid
        self.push(t + self.hop, "input", client_acquire(self.group, job, rid, self.priorities.get(job, 0)))
        self.push(t + WAITER_TTL_MS / 3000, "renew_wait", (job, rid))

    def _granted(self, t: float, job: str, epoch: int, rid: str) -> None:
        if self.waiting.get(job) != rid:  # a duplicate notice (a grant re-sent): the job has it already
            return
        del self.waiting[job]
        self.epoch[job] = epoch
        self.log[job].append(("grant", t))
        # The client confirms the grant with its first renewal, then keeps the lease.
        self.push(t + self.hop, "input", Renew(group=self.group, job=job, request_id=self.rid("c"), epoch=epoch))
        self.push(t + LEASE_MS / 3000, "renew_hold", (job, epoch))
        self.push(t + self.hold_for.pop(rid), "release", job)

    def _release(self, t: float, job: str) -> None:
        self.log[job].append(("release", t))
        epoch = self.epoch.pop(job)
        self.push(t + self.hop, "input", Release(group=self.group, job=job, request_id=self.rid("r"), epoch=epoch))
        self._next(t, job)

    def _apply(self, t: float, ev: InputEvent) -> None:
        self.seq += 1
        self.events += 1
        if self.events > MAX_EVENTS:
            raise AdviseError(
                f"the simulation applied {MAX_EVENTS} events without finishing; shorten the "
                "window (--since/--until) or name fewer jobs"
            )
        self.rec, actions = apply(self.rec, ev, int(t * 1000), self.seq)
        for a in actions:
            if isinstance(a, Notify) and isinstance(a.notice, Granted):
                n = a.notice
                self.push(t + self.hop, "granted", (n.job, n.epoch, n.request_id))
            elif isinstance(a, Command):
                self._agent(t, a.command)
        dl = next_deadline(self.rec)
        if dl is not None and dl not in self.ticks and dl / 1000 >= t:
            self.ticks.add(dl)
            self.push(dl / 1000, "input", Tick(group=self.group))

    def _agent(self, t: float, cmd: Snapshot | Restore) -> None:
        if cmd.op_id in self.finished_at:
            return  # the core's resend of an operation under way (after resend_ms): the agent runs each op once
        cost = self.costs.get(cmd.job, SwitchCost())
        op = agent_op(cmd, self.ctx[cmd.job], cost, start=t + self.hop, finished_at=self.finished_at, room=self.room)
        self.ctx[cmd.job] = op.state
        self.finished_at[cmd.op_id] = op.end
        self.push(op.end + self.hop, "input", op.result)


@dataclass(frozen=True)
class AgentOp:
    """The simulated agent's run of one command: the context's state after it, when it ran, and its answer."""

    state: str  # IDLE, RUNNING, SAVED
    start: float
    seconds: float  # how long it took
    result: OpResult

    @property
    def end(self) -> float:
        return self.start + self.seconds


def agent_op(
    cmd: Snapshot | Restore,
    state: str,
    cost: SwitchCost,
    *,
    start: float,
    finished_at: Mapping[str, float],
    room: bool,
) -> AgentOp:
    """How the simulated agent runs ``cmd``, reaching it at ``start``, on a context in ``state`` (IDLE, RUNNING,
    SAVED): it takes ``cost`` (nothing for a context already where it should be, as the real agent does). Without
    ``room`` a restore starts once the snapshots it follows are done (``finished_at``: op id -> when it ended); with
    ``room`` it starts at once and says it overlapped a snapshot that still runs."""
    overlapped = False
    if isinstance(cmd, Snapshot):
        seconds = cost.snapshot_s if state == "RUNNING" else 0.0
        state = "SAVED" if state == "RUNNING" else state
        kind = OpKind.SNAPSHOT
    else:
        seconds = cost.restore_s if state == "SAVED" else 0.0
        state = "RUNNING"
        kind = OpKind.RESTORE
        after = max((finished_at.get(op, start) for op in cmd.after), default=start)
        if not room:
            start = max(start, after)  # the agent runs it once the snapshots it follows are done
        else:
            overlapped = after > start  # beside a snapshot that still runs
    result = OpResult(
        group=cmd.group,
        op_id=cmd.op_id,
        node=cmd.node,
        job=cmd.job,
        kind=kind,
        epoch=cmd.epoch,
        ok=True,
        backend="app_channel",
        elapsed_ms=seconds * 1000,
        overlapped=overlapped,
    )
    return AgentOp(state, start, seconds, result)


def simulate(
    phases: Mapping[str, Sequence[Phase]],
    costs: Mapping[str, SwitchCost],
    *,
    hop_s: float = 0.001,
    room: bool = False,
    group: str = "sim",
    priorities: Mapping[str, int] | None = None,
) -> SimRun:
    """Run every job's ``phases`` from time 0, all on one group; the run's log and the events the core applied.
    ``costs``: each job's switch costs (a job not named switches for free); ``priorities``: each job's priority class
    (``Acquire.priority``; default 0). Raises ``AdviseError`` past :data:`MAX_EVENTS` events."""
    if hop_s < 0:
        raise ValueError(f"hop_s must be at least 0, not {hop_s}")
    sim = _Sim(phases, costs, hop_s, room, group, priorities or {})
    log = sim.run()
    return SimRun(log=log, events=sim.events)
