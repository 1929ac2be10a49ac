"""trace_replay.py's multi-pool simulation: jobs spread over several pools (groups), each pool its own record folded
through the orchestrator's pure core (``timeslice_orchestrator.core.apply``), in simulated time.

``timeslice advise``'s simulation (``timeslice_orchestrator.advise.simulate``) runs every job on one group; a
disaggregated job holds a trainer pool and a sampler pool in turn, and takes one while it still holds the other. This
module runs the same world with one record per pool:

* a job runs its phases in order (``_trace_model.pool_schedule``); a phase names the pools it holds. At a phase
  boundary the job releases what the next phase does not need, keeps what it does (no release, no re-acquire: the
  hold goes on), and takes what it lacks one pool at a time in sorted order, as the client's ``acquire_all`` does.
  The order rule (``docs/multi-pool.md``: a job waits for a pool only while every pool it holds sorts before it) is
  kept: a held pool that sorts above one still to take is released first. So no mix of jobs deadlocks;
* each pool's core gets what the live orchestrator would: ``JobRegistered`` (each job on the pool's own node),
  ``Acquire``, ``Renew`` (the grant's confirmation, then the lease and the wait kept alive, as the client does),
  ``Release``, ``OpResult`` and ``Tick`` at the record's next deadline; every message takes one bus pass (``hop_s``);
* a simulated agent per pool answers each operation once (a command the core sends again while it runs is the
  same operation), and takes the cost model's time for a context it moves (nothing for a context already where
  it should be); without ``room`` a restore starts once the snapshots it follows (``Restore.after``) are done, with
  ``room`` (the node fits both contexts) beside them, and says so (``OpResult.overlapped``), so the core grants on
  the restore;
* policies: FIFO (the core's default), priority classes (``Acquire.priority``), a quantum (``SetPolicy``: a holder
  asked to yield gives back at its next phase boundary a pool it would have kept), grant on restore (``room``), a
  minimum hold (``SetPolicy.min_hold_ms``: a job switched into a pool that gives it back early while another waits
  keeps it for the window, and takes it back without a switch if it needs it again within it), the predictive
  restore (``SetPolicy.predict``), from the jobs' cycles alone or with their phase starts published too
  (``predict_phase``: each job publishes ``Phase(edge="start")`` at each phase's start on every pool it uses, as
  ``timeslice_client.phase`` does; the ends, which teach the core nothing, are left out).

The run's log is kept per pool (each job's acquire, grant, release and end, as ``_trace_model.Log``), with every
operation the simulated agents ran (:class:`OpSpan`), so that the switch time on the critical path can be split into
snapshot, restore, and the lock and bus.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import msgspec
from _trace_model import Log, PoolCost, PoolStep, switches_between
from timeslice_client.protocol import (
    Granted,
    GroupState,
    InputEvent,
    JobRegistered,
    Phase,
    Release,
    Renew,
    Restore,
    SetPolicy,
    Snapshot,
    Tick,
    YieldRequested,
)
from timeslice_orchestrator.advise import SwitchCost, agent_op, client_acquire
from timeslice_orchestrator.advise._simulate import LEASE_MS, WAITER_TTL_MS  # client_acquire's lease and window
from timeslice_orchestrator.core import Command, Notify, apply, new_record, next_deadline

MAX_EVENTS = 2_000_000  # a bound on one simulation

Policy = Literal[
    "fifo",
    "room",
    "precopy",
    "room_precopy",
    "predict",
    "room_predict",
    "predict_phase",
    "room_predict_phase",
    "priority",
    "quantum",
    "min_hold",
]
POLICIES: tuple[Policy, ...] = get_args(Policy)
POLICY_TEXT: dict[str, str] = {
    "fifo": "first come, first served; snapshot, then restore, then grant (today's default)",
    "room": "FIFO with grant on restore: the node fits both contexts, the restore runs beside the snapshot",
    "precopy": "FIFO with pre-copy: a job that gives a pool back with nobody waiting (its context stays loaded) copies "
    "its state out while idle, once it has been switched out of that pool before; the next switch only frees it",
    "room_precopy": "grant on restore and pre-copy together",
    "predict": "FIFO with the predictive restore: at a release nobody waits for, the job expected to ask next (from "
    "each job's recent cycle, in the core) has its context brought back while the pool is idle",
    "room_predict": "grant on restore, pre-copy and the predictive restore together",
    "predict_phase": "predict, and each job publishes its phase starts (``timeslice_client.phase``) on every pool it "
    "uses: a start made while away from a pool is a cue for the job's next ask there (``_predict.note_phase``)",
    "room_predict_phase": "room_predict with the phase starts published",
    "priority": "priority classes: job j0 asks at class 1, the others at 0 (ageing 1 class a minute)",
    "quantum": "FIFO with a quantum: a holder that held a pool past it while another job waits gives that pool back "
    "at its next phase boundary",
    "min_hold": "FIFO with a minimum hold: a job switched into a pool that gives it back before the minimum hold while "
    "another job waits keeps it until then, and takes it back without a switch if it asks within that window",
}


SPLIT = ("total", "snapshot", "restore", "lock_bus")  # the switch time on the critical path, and its parts


@dataclass(frozen=True)
class OpSpan:
    pool: str
    job: str
    kind: Literal["snapshot", "restore", "precopy"]
    start: float
    end: float


@dataclass
class PoolRun:
    logs: dict[str, Log]  # pool -> job -> [(kind, t)]
    ops: list[OpSpan]
    events: int
    yields: int
    ends: dict[str, float] = field(default_factory=dict)  # job -> when it finished


@dataclass
class _Job:
    phases: list[tuple[str, tuple[str, ...], float, bool]]
    cursor: int = 0
    ready: list[float] = field(default_factory=list)  # when the producer had each paced input ready
    taken: list[float] = field(default_factory=list)  # when the job took each paced input
    held: dict[str, int] = field(default_factory=dict)  # pool -> epoch
    missing: list[str] = field(default_factory=list)  # pools still to take for the current phase, in order
    seconds: float = 0.0  # the current phase's length
    waiting: tuple[str, str] | None = None  # (pool, request id)
    asked_to_yield: set[str] = field(default_factory=set)  # pools whose current hold was asked to yield


class _Sim:
    def __init__(
        self,
        schedules: Mapping[str, Sequence[PoolStep]],
        costs: Mapping[str, PoolCost],
        hop_s: float,
        policy: Policy,
        group: str,
        quantum_s: float,
        staleness: int,
        min_hold_s: float = 0.0,
    ) -> None:
        self.hop, self.costs, self.policy, self.staleness = hop_s, costs, policy, staleness
        self.room = policy in ("room", "room_precopy", "room_predict", "room_predict_phase")
        self.precopy = policy in ("precopy", "room_precopy", "room_predict", "room_predict_phase")
        self.predict = policy in ("predict", "room_predict", "predict_phase", "room_predict_phase")
        self.phase_events = policy in ("predict_phase", "room_predict_phase")
        # (pool, job) -> when the copy made while that job was idle ends; dropped when the job is granted the pool
        self.copying: dict[tuple[str, str], float] = {}
        self.switched_out: set[tuple[str, str]] = set()  # (pool, job): switched out of it once (precopy "auto")
        self.jobs = {j: _Job([ph for step in s for ph in step]) for j, s in schedules.items()}
        self.pools_of = {j: sorted({p for _, ps, _, _ in jb.phases for p in ps}) for j, jb in self.jobs.items()}
        pools = sorted({p for jb in self.jobs.values() for _, ps, _, _ in jb.phases for p in ps})
        self.group = {p: f"{group}-{p}" for p in pools}
        self.pool_of = {g: p for p, g in self.group.items()}
        self.rec = {p: new_record(self.group[p]) for p in pools}
        self.seq = dict.fromkeys(pools, 0)
        self.ticks: dict[str, set[int]] = {p: set() for p in pools}
        self.priority = {j: (1 if policy == "priority" and i == 0 else 0) for i, j in enumerate(self.jobs)}
        self.quantum_ms = int(quantum_s * 1000) if policy == "quantum" else 0
        self.min_hold_ms = int(min_hold_s * 1000) if policy == "min_hold" else 0
        self.heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.order = itertools.count()
        self.rids = itertools.count()
        self.ctx: dict[tuple[str, str], str] = {}  # (pool, job) -> IDLE, RUNNING, SAVED (the simulated agent's view)
        self.finished_at: dict[str, float] = {}
        self.holding: dict[str, str | None] = dict.fromkeys(pools, None)  # who holds each pool, by the jobs' logs
        self.logs: dict[str, Log] = {p: {j: [] for j in self.jobs} for p in pools}
        self.ops: list[OpSpan] = []
        self.events = 0
        self.yields = 0
        self.ends: dict[str, float] = {}

    def push(self, t: float, handler: Callable[..., None], *args: Any) -> None:
        """Have ``handler(t, *args)`` run at simulated time ``t`` (after what is already due then)."""
        heapq.heappush(self.heap, (t, next(self.order), handler, args))

    def rid(self, prefix: str) -> str:
        return f"{prefix}{next(self.rids)}"

    def run(self) -> PoolRun:
        for p, g in self.group.items():
            if self.quantum_ms:
                self.push(0.0, self._apply, SetPolicy(group=g, quantum_ms=self.quantum_ms))
            if self.min_hold_ms:
                self.push(0.0, self._apply, SetPolicy(group=g, min_hold_ms=self.min_hold_ms))
            if self.predict:
                self.push(0.0, self._apply, SetPolicy(group=g, predict=True))
            for j in self.jobs:
                self.push(0.0, self._apply, JobRegistered(group=g, job=j, node=f"node-{p}", backend="app_channel"))
        for j in self.jobs:
            self.push(0.0, self._next, j)
        while self.heap:
            t, _, handler, args = heapq.heappop(self.heap)
            handler(t, *args)
        return PoolRun(logs=self.logs, ops=self.ops, events=self.events, yields=self.yields, ends=self.ends)

    def _renew_wait(self, t: float, job: str, pool: str, rid: str) -> None:
        """Keep a wait alive, as the client does, while the job still waits with it."""
        if self.jobs[job].waiting == (pool, rid):
            self.push(t + self.hop, self._apply, Renew(group=self.group[pool], job=job, request_id=rid))
            self.push(t + WAITER_TTL_MS / 3000, self._renew_wait, job, pool, rid)

    def _renew_hold(self, t: float, job: str, pool: str, epoch: int) -> None:
        """Keep a hold's lease alive, as the client does, while the job still holds it."""
        if self.jobs[job].held.get(pool) == epoch:
            renew = Renew(group=self.group[pool], job=job, request_id=self.rid("h"), epoch=epoch)
            self.push(t + self.hop, self._apply, renew)
            self.push(t + LEASE_MS / 3000, self._renew_hold, job, pool, epoch)

    # ------------------------------------------------------------------ the jobs

    def _release(self, t: float, job: str, pool: str) -> None:
        jb = self.jobs[job]
        epoch = jb.held.pop(pool)
        jb.asked_to_yield.discard(pool)
        self.logs[pool][job].append(("release", t))
        if self.holding[pool] != job:
            raise AssertionError(f"{job} released {pool} held by {self.holding[pool]}")
        self.holding[pool] = None
        self.push(
            t + self.hop, self._apply, Release(group=self.group[pool], job=job, request_id=self.rid("r"), epoch=epoch)
        )

    def _next(self, t: float, job: str) -> None:
        jb = self.jobs[job]
        if jb.cursor == len(jb.phases):
            for p in sorted(jb.held, reverse=True):
                self._release(t, job, p)
            self.ends[job] = t
            for log in self.logs.values():
                log[job].append(("end", t))
            return
        name, pools, seconds, paced = jb.phases[jb.cursor]
        jb.cursor += 1
        if paced:  # wait for the producer's next input: made after the previous one, and once the job took the
            # input ``staleness`` before it (the producer runs at most that far ahead)
            k = len(jb.ready)
            begin = max(
                jb.ready[-1] if jb.ready else 0.0, jb.taken[k - 1 - self.staleness] if k > self.staleness else 0.0
            )
            jb.ready.append(begin + seconds)
            seconds = max(0.0, jb.ready[-1] - t)
            jb.taken.append(t + seconds)
        need = set(pools)
        for p in sorted(jb.held, reverse=True):  # what the phase does not need, or was asked to yield
            if p not in need or p in jb.asked_to_yield:
                self._release(t, job, p)
        missing = sorted(need - set(jb.held))
        if missing:  # the order rule: hold only pools below the first one to wait for
            for p in sorted(jb.held, reverse=True):
                if p > missing[0]:
                    self._release(t, job, p)
            missing = sorted(need - set(jb.held))
        if self.phase_events:  # the phase's start, as the job's client publishes it on each pool it uses (after the
            # releases above; the core ignores it where the job holds or waits, and learns from it where it is away)
            for p in self.pools_of[job]:
                self.push(t + self.hop, self._apply, Phase(group=self.group[p], job=job, name=name, edge="start"))
        jb.missing, jb.seconds = missing, seconds
        if not pools:
            self.push(t + seconds, self._next, job)
        else:
            self._take_or_run(t, job)

    def _take_or_run(self, t: float, job: str) -> None:
        jb = self.jobs[job]
        if not jb.missing:
            self.push(t + jb.seconds, self._next, job)
            return
        pool = jb.missing.pop(0)
        self.logs[pool][job].append(("acquire", t))
        rid = self.rid("a")
        jb.waiting = (pool, rid)
        self.push(t + self.hop, self._apply, client_acquire(self.group[pool], job, rid, self.priority[job]))
        self.push(t + WAITER_TTL_MS / 3000, self._renew_wait, job, pool, rid)

    def _granted(self, t: float, job: str, pool: str, epoch: int, rid: str) -> None:
        jb = self.jobs[job]
        if jb.waiting != (pool, rid):  # a duplicate notice: the job has it already
            return
        jb.waiting = None
        if self.holding[pool] is not None:
            raise AssertionError(f"{pool} granted to {job} while {self.holding[pool]} holds it")
        self.holding[pool] = job
        jb.held[pool] = epoch
        self.copying.pop((pool, job), None)  # the grant drops a copy made while the job was idle
        self.logs[pool][job].append(("grant", t))
        g = self.group[pool]
        self.push(t + self.hop, self._apply, Renew(group=g, job=job, request_id=self.rid("c"), epoch=epoch))
        self.push(t + LEASE_MS / 3000, self._renew_hold, job, pool, epoch)
        self._take_or_run(t, job)

    # ------------------------------------------------------------------ the cores and the agents

    def _apply(self, t: float, ev: InputEvent) -> None:
        pool = self.pool_of[ev.group]
        self.seq[pool] += 1
        self.events += 1
        if self.events > MAX_EVENTS:
            raise RuntimeError(f"the multi-pool simulation applied {MAX_EVENTS} events without finishing")
        self.rec[pool], actions = apply(self.rec[pool], ev, int(t * 1000), self.seq[pool])
        if self.precopy and isinstance(ev, Release):
            self._precopy(t, pool, ev.job)
        for a in actions:
            if isinstance(a, Notify) and isinstance(a.notice, Granted):
                n = a.notice
                self.push(t + self.hop, self._granted, n.job, pool, n.epoch, n.request_id)
            elif isinstance(a, Notify) and isinstance(a.notice, YieldRequested):
                y = a.notice
                jb = self.jobs[y.job]
                if jb.held.get(pool) == y.epoch:  # it acts on it at its next phase boundary
                    jb.asked_to_yield.add(pool)
                    self.yields += 1
            elif isinstance(a, Command):
                self._agent(t, pool, a.command)
        dl = next_deadline(self.rec[pool])
        if dl is not None and dl not in self.ticks[pool] and dl / 1000 >= t:
            self.ticks[pool].add(dl)
            self.push(dl / 1000, self._apply, Tick(group=self.group[pool]))

    def _precopy(self, t: float, pool: str, job: str) -> None:
        """After ``job``'s release of ``pool`` was applied: when nobody waited and its context stays loaded (the core
        deferred the snapshot), and it has been switched out of the pool before, its channel copies it out while idle
        (the released notice reaching the job, then the snapshot's own time)."""
        if self.rec[pool].state is GroupState.IDLE_YIELDED and (pool, job) in self.switched_out:
            self.copying[(pool, job)] = t + 2 * self.hop + self.costs.get(pool, PoolCost()).snapshot

    def _agent(self, t: float, pool: str, cmd: Snapshot | Restore) -> None:
        if cmd.op_id in self.finished_at:  # a command sent again (unanswered for Limits.resend_ms): the agent
            return  # answers it once, when it is done, as the real agent does
        key = (pool, cmd.job)
        cost = self.costs.get(pool, PoolCost())
        if isinstance(cmd, Snapshot):
            self.switched_out.add(key)
            copied = self.copying.pop(key, None)
            if copied is not None:  # the snapshot only frees: it waits for what is left of the copy
                cost = msgspec.structs.replace(cost, snapshot_s=max(0.0, copied - (t + self.hop)))
        op = agent_op(
            cmd,
            self.ctx.get(key, "IDLE"),
            SwitchCost(cost.snapshot, cost.restore),
            start=t + self.hop,
            finished_at=self.finished_at,
            room=self.room,
        )
        self.ctx[key] = op.state
        self.finished_at[cmd.op_id] = op.end
        if op.seconds:
            kind: Literal["snapshot", "restore"] = "snapshot" if isinstance(cmd, Snapshot) else "restore"
            self.ops.append(OpSpan(pool, cmd.job, kind, op.start, op.end))
        self.push(op.end + self.hop, self._apply, op.result)


def simulate_pools(
    schedules: Mapping[str, Sequence[PoolStep]],
    costs: Mapping[str, PoolCost],
    hop_s: float,
    policy: Policy = "fifo",
    group: str = "sim",
    quantum_s: float = 60.0,
    staleness: int = 0,
    min_hold_s: float = 30.0,
) -> PoolRun:
    """Run every job's schedule from time 0 over the pools its phases name; ``costs``: each pool's switch cost;
    ``staleness``: how far a paced phase's producer may run ahead of its job."""
    if hop_s < 0:
        raise ValueError(f"hop_s must be at least 0, not {hop_s}")
    return _Sim(schedules, costs, hop_s, policy, group, quantum_s, staleness, min_hold_s).run()


# ---------------------------------------------------------------------- figures


def _overlap(a0: float, a1: float, spans: Sequence[tuple[float, float]]) -> float:
    """Length of [a0, a1] covered by the union of ``spans``."""
    total, cur = 0.0, a0
    for b0, b1 in sorted(spans):
        s0, s1 = max(b0, cur), min(b1, a1)
        if s1 > s0:
            total += s1 - s0
            cur = s1
    return total


def holds(log: Log) -> dict[str, list[tuple[float, float]]]:
    """Each job's holds of one pool: (grant, release) pairs."""
    out: dict[str, list[tuple[float, float]]] = {}
    for job, ev in log.items():
        g: float | None = None
        for k, t in ev:
            if k == "grant":
                g = t
            elif k == "release" and g is not None:
                out.setdefault(job, []).append((g, t))
                g = None
    return out


def switch_windows(log: Log) -> list[tuple[float, float, str]]:
    """The switches of one pool: (another job's release, or the incoming job's acquire if later; the grant; the
    incoming job), as ``_trace_model.figures`` counts them."""
    grants: list[tuple[float, str, float]] = []
    releases: list[tuple[float, str]] = []
    for job, ev in log.items():
        acq = 0.0
        for k, t in ev:
            if k == "acquire":
                acq = t
            elif k == "grant":
                grants.append((t, job, acq))
            elif k == "release":
                releases.append((t, job))
    return switches_between(grants, releases)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def switch_parts(run: PoolRun, pool: str) -> dict[str, list[float]]:
    """Each switch of one pool on the critical path (``total``) split into snapshot (the outgoing context's copy while
    no restore ran), restore (the incoming one's, whatever ran beside it) and lock/bus (the rest: the release and the
    grant crossing the bus, the core's decisions, the agent's commands and answers)."""
    # (a precopy the switch still waited for is the outgoing copy on its critical path too: the real mode logs them)
    snaps = [(o.start, o.end) for o in run.ops if o.pool == pool and o.kind in ("snapshot", "precopy")]
    rests = [(o.start, o.end) for o in run.ops if o.pool == pool and o.kind == "restore"]
    parts: dict[str, list[float]] = {k: [] for k in SPLIT}
    for w0, w1, _ in switch_windows(run.logs[pool]):
        r = _overlap(w0, w1, rests)
        both = _overlap(w0, w1, snaps + rests)
        parts["total"].append(w1 - w0)
        parts["restore"].append(r)
        parts["snapshot"].append(both - r)
        parts["lock_bus"].append(w1 - w0 - both)
    return parts


def pool_figures(run: PoolRun, pool: str) -> dict[str, Any]:
    """One pool's duty cycle (over the makespan, and while every job still runs), switches, and the switch time on
    the critical path with its split (:func:`switch_parts`)."""
    log = run.logs[pool]
    wall = max(run.ends.values(), default=0.0)
    first_end = min(run.ends.values(), default=0.0)
    spans = [h for hs in holds(log).values() for h in hs]
    held = sum(g1 - g0 for g0, g1 in spans)
    parts = switch_parts(run, pool)
    return {
        "duty_cycle": held / wall if wall else 0.0,
        # over the time every job still ran (to the first job's end): the duty while they all compete
        "duty_all_running": _overlap(0.0, first_end, spans) / first_end if first_end else 0.0,
        "held_s": held,
        "switches": len(parts["total"]),
        "switching_s": sum(parts["total"]),
        "switch_median_s": _median(parts["total"]),
        "critical_path_s": {k: sum(v) for k, v in parts.items()},
        "critical_path_median_s": {k: _median(v) for k, v in parts.items()},
        "snapshots": sum(1 for o in run.ops if o.pool == pool and o.kind == "snapshot"),
        "restores": sum(1 for o in run.ops if o.pool == pool and o.kind == "restore"),
    }


def run_figures(run: PoolRun, steps: int) -> dict[str, Any]:
    """The run's makespan, each pool's figures, the mean duty over the pools and the share of time some pool was
    held by some job (``any_pool_duty``)."""
    wall = max(run.ends.values(), default=0.0)
    pools = {p: pool_figures(run, p) for p in sorted(run.logs)}
    spans = [h for p in run.logs for hs in holds(run.logs[p]).values() for h in hs]
    every = [switch_parts(run, p) for p in sorted(run.logs)]
    crit = {k: sum(sum(parts[k]) for parts in every) for k in SPLIT}
    crit_median = {k: _median([x for parts in every for x in parts[k]]) for k in SPLIT}
    # Per switch, what it took beyond the incoming restore (release, or acquire, to grant less the restore's share):
    # with grant on restore, what the stack adds to the restore (issue 27's goal: 10 ms at most, in real time).
    beyond = [t - r for parts in every for t, r in zip(parts["total"], parts["restore"], strict=True)]
    return {
        "jobs": len(run.ends),
        "steps_per_job": steps,
        "makespan_s": wall,
        "job_wall_s": dict(sorted(run.ends.items())),
        "pools": pools,
        "mean_duty": sum(f["duty_cycle"] for f in pools.values()) / len(pools) if pools else 0.0,
        "any_pool_duty": _overlap(0.0, wall, spans) / wall if wall else 0.0,
        "switches": sum(f["switches"] for f in pools.values()),
        "critical_path_s": crit,
        "critical_path_median_s": crit_median,
        "beyond_restore_median_s": _median(beyond),
        "yield_requests": run.yields,
        "events": run.events,
    }


def exclusive(run: PoolRun) -> bool:
    """No two jobs held one pool at once in the run's log (grant to release, each pool)."""
    for log in run.logs.values():
        spans = sorted(h for hs in holds(log).values() for h in hs)
        if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
            return False
    return True
