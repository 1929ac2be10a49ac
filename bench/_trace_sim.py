"""Discrete-event replay of RL phase schedules through the orchestrator's pure core, in simulated time.

Every input the real orchestrator would consume (``JobRegistered``, ``Acquire``, ``Release``,
``OpResult``, ``Tick``) is fed to :func:`timeslice_orchestrator.core.apply` in time order, with the
simulated time as the event's stream timestamp and a rising sequence number, exactly as the live
orchestrator applies stream events. Its actions drive the simulated world:

* a ``Granted`` notice reaches the job one bus pass (``hop_s``) later; the job runs its accelerator
  phase, releases, and goes on with its next phase;
* a ``Snapshot``/``Restore`` command reaches the simulated agent one pass later; it takes the switch
  profile's time (nothing for a job that never ran, or whose context is already there, as the real
  agent does) and its ``OpResult`` enters the stream one pass after that; a restore starts once the
  snapshots it follows (``Restore.after``) are done, as on a real agent whose node has no room for both
  contexts (a full GPU; with room, the real agent runs them side by side, which this model leaves out);
* ``Tick`` events are scheduled at the record's next deadline, as the orchestrator's timer does.

Leases, waiter windows and confirmation windows are 10 minutes, longer than any phase here, so no
renewals are simulated (in the real client they run in the background and change no decision when
nothing expires). An hour-long trace of three jobs is a few thousand events: well under a second.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from _trace_model import Log, Step, SwitchProfile
from timeslice_client.protocol import (
    Acquire,
    Granted,
    InputEvent,
    JobRegistered,
    OpKind,
    OpResult,
    Release,
    Restore,
    Snapshot,
    Tick,
)
from timeslice_orchestrator.core import Command, Notify, apply, new_record, next_deadline

LONG_MS = 600_000
NODE = "sim"


class _Sim:
    def __init__(self, schedules: dict[str, list[Step]], switch: SwitchProfile, hop_s: float, group: str) -> None:
        self.group = group
        self.switch = switch
        self.hop = hop_s
        self.rec = new_record(group)
        self.seq = 0
        self.heap: list[tuple[float, int, str, Any]] = []
        self.order = itertools.count()
        self.phases = {j: [ph for step in s for ph in step] for j, s in schedules.items()}
        self.cursor = dict.fromkeys(schedules, 0)
        self.epoch: dict[str, int] = {}
        self.ctx = dict.fromkeys(schedules, "IDLE")  # the simulated agent's view: IDLE, RUNNING, SAVED
        self.finished_at: dict[str, float] = {}  # op id -> when the simulated agent finished it
        self.log: Log = {j: [] for j in schedules}
        self.rids = itertools.count()
        self.ticks: set[int] = set()
        self.hold_for: dict[str, float] = {}  # acquire request id -> the accelerator phase's length
        self.events = 0

    def push(self, t: float, kind: str, data: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.order), kind, data))

    def run(self) -> Log:
        for j in self.phases:
            self.push(0.0, "input", JobRegistered(group=self.group, job=j, node=NODE, backend="app_channel",
                                                  op_timeout_ms=LONG_MS))
            self.push(0.0, "next", j)
        while self.heap:
            t, _, kind, data = heapq.heappop(self.heap)
            if kind == "input":
                self._apply(t, data)
            elif kind == "next":
                self._next(t, data)
            elif kind == "granted":
                job, epoch, dur = data
                self.epoch[job] = epoch
                self.log[job].append(("grant", t))
                self.push(t + dur, "release", job)
            elif kind == "release":
                self.log[data].append(("release", t))
                self.push(t + self.hop, "input", Release(group=self.group, job=data, request_id=f"r{next(self.rids)}",
                                                         epoch=self.epoch[data]))
                self._next(t, data)
        return self.log

    def _next(self, t: float, job: str) -> None:
        i = self.cursor[job]
        if i == len(self.phases[job]):
            self.log[job].append(("end", t))
            return
        self.cursor[job] = i + 1
        _, accel, dur = self.phases[job][i]
        if not accel:
            self.push(t + dur, "next", job)
            return
        self.log[job].append(("acquire", t))
        rid = f"a{next(self.rids)}"
        self.hold_for[rid] = dur
        self.push(t + self.hop, "input", Acquire(group=self.group, job=job, request_id=rid,
                                                 lease_ms=LONG_MS, timeout_ms=6 * LONG_MS, waiter_ttl_ms=LONG_MS,
                                                 confirm_ms=LONG_MS))

    def _apply(self, t: float, ev: InputEvent) -> None:
        self.seq += 1
        self.events += 1
        now_ms = int(t * 1000)
        self.rec, actions = apply(self.rec, ev, now_ms, self.seq)
        for a in actions:
            if isinstance(a, Notify) and isinstance(a.notice, Granted):
                n = a.notice
                self.push(t + self.hop, "granted", (n.job, n.epoch, self.hold_for.pop(n.request_id)))
            elif isinstance(a, Command):
                self._agent(t, a.command)
        dl = next_deadline(self.rec)
        if dl is not None and dl not in self.ticks and dl / 1000 >= t:
            self.ticks.add(dl)
            self.push(dl / 1000, "input", Tick(group=self.group))

    def _agent(self, t: float, cmd: Snapshot | Restore) -> None:
        state = self.ctx[cmd.job]
        if isinstance(cmd, Snapshot):
            cost = self.switch.snapshot_s if state == "RUNNING" else 0.0
            self.ctx[cmd.job] = "SAVED" if state == "RUNNING" else state
            kind = OpKind.SNAPSHOT
        else:
            cost = self.switch.restore_s if state == "SAVED" else 0.0
            self.ctx[cmd.job] = "RUNNING"
            kind = OpKind.RESTORE
        start = t + self.hop
        if isinstance(cmd, Restore):  # the agent runs it once the snapshots it follows on the node are done
            start = max([start, *(self.finished_at.get(op, start) for op in cmd.after)])
        self.finished_at[cmd.op_id] = start + cost
        done = start + cost + self.hop
        self.push(done, "input", OpResult(group=self.group, op_id=cmd.op_id, node=cmd.node, job=cmd.job, kind=kind,
                                          epoch=cmd.epoch, ok=True, backend="app_channel",
                                          bytes_moved=self.switch.bytes_per_job if cost else 0,
                                          elapsed_ms=cost * 1000))


def simulate(schedules: dict[str, list[Step]], switch: SwitchProfile, hop_s: float,
             group: str = "sim") -> tuple[Log, int]:
    """Replay the schedules; returns the run's log and the number of events the core applied."""
    sim = _Sim(schedules, switch, hop_s, group)
    log = sim.run()
    return log, sim.events
