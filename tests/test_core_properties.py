"""The pure orchestrator core against its invariants: a hypothesis state machine.

It drives ``apply()`` with random job, control and agent events (acquire, release, renew, cancel,
ticks and time jumps, registrations, operation results both fresh and late, lost agents) and checks
after every event: the record invariants (``check_record``), mutual exclusion as the notices tell it,
the waiters served by priority class with ageing, then by fair share when the group has shares (first come, first
served within a class otherwise: ``_next_waiter``, ``_fair_share``), the
minimum hold (a group kept only for a job switched in that released early while others waited, until its window
ends, never renewed, and taken back only by that job: ``_min_hold``),
rising grant epochs, no grant to a request that left, no
waiter lost without a notice, grants only after every restore succeeded, fencing (late or forged
operation results change nothing), ``next_deadline`` (nothing expires before it, something does at
it), idempotence and determinism. Grant on restore: an agent answering a restore while a snapshot of its switch
still runs on its node ran it beside (and says so, ``OpResult.overlapped``, unless it is an older agent); a grant
made before those snapshots ended must have such a restore beside each of them, never two jobs run, and a node
holds two contexts only while a switch moves one off and one on or while a snapshot trails a grant beside the
active job's (``core_agents.check_contexts``); a trailing snapshot that fails faults only its job. At the end the
whole run, with the agents' ``OpStarted`` facts, is encoded as a stream and checked by :class:`StreamChecker`.
Unit tests: ``test_core_semantics.py``, ``test_invariant_checkers.py``, ``test_grant_on_restore.py``.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from timeslice_client.protocol import (
    Acquire,
    AgentLost,
    Cancel,
    ClearFault,
    Granted,
    InputEvent,
    JobRegistered,
    JobUnregistered,
    OpKind,
    OpRecord,
    Phase,
    Release,
    Released,
    Renew,
    Restore,
    SetPolicy,
    Snapshot,
    Tick,
)
from timeslice_orchestrator._op_facts import pending_ops
from timeslice_orchestrator.core import Action, apply, new_record, next_deadline

from .core_agents import BesideRules, Message, Step, check_run, op_started, pending_epoch, runs_beside
from .core_model_checks import ModelChecks
from .core_predict_checks import PredictChecks
from .core_sim import JOBS, NODES, SEQ_GAP, T0, G, input_subject, notices, tag
from .op_messages import AgentOp

# Most acquires at the default class (first come, first served), some at others, so choices by class and by ageing
# both come up.
PRIORITIES = st.sampled_from([0, 0, 0, 0, 0, 1, 5, 9])
# Fair share off in most runs (the default), on with a few shapes of shares in the others.
SHARES = st.sampled_from([{}, {}, {"a": 3}, {"a": 1, "b": 5, "c": 2}])


# --------------------------------------------------------------------------- the state machine


class CoreMachine(ModelChecks, PredictChecks, BesideRules, RuleBasedStateMachine):
    """A model of what the notices promise, checked against ``apply()`` after every event."""

    def __init__(self) -> None:
        super().__init__()
        self.rec = new_record(G)
        self.now = T0
        self.seq = 0
        self.steps: list[Step] = []
        self.rid_counter = itertools.count(1)
        self.rid_job: dict[str, str] = {}  # every acquire's request id -> its job
        # waiting job -> (enqueue order, request id, priority class, enqueued at ms)
        self.entries: dict[str, tuple[int, str, int, int]] = {}
        self.order = itertools.count(1)
        self.departed: set[str] = set()  # request ids that left: dequeued, refused, superseded
        self.holder: tuple[str, int, str] | None = None  # (job, epoch, request id) per the notices
        self.max_epoch = 0
        self.grants = 0
        self.ops: dict[str, tuple[Snapshot | Restore, list[bool | str | None]]] = {}  # op id -> (command, [result])
        self.sent_at: dict[str, int] = {}  # op id -> the time its command last went out
        self.failed = False  # a step failed: teardown has nothing to add
        # (job, epoch) a client may claim: the last job input was its release, answered with nobody waiting
        self.claimable: tuple[str, int] | None = None
        self.since_release: list[str] = []  # the non-job events since (what a claim must be immune to)
        self.beside: set[tuple[str, int]] = set()  # (node, epoch): a restore that succeeded beside a snapshot there
        self.facts: list[Message] = []  # the agents' facts that come before the next event (a restore's OpStarted)
        self.yield_asked: set[int] = set()  # epochs whose holder was asked to yield (YieldRequested)
        self.taken_back: set[int] = set()  # epochs of holds taken back within a minimum hold (never kept again)

    # ------------------------------------------------------------------ plumbing

    def fresh_rid(self, job: str) -> str:
        rid = f"{job}-{next(self.rid_counter)}"
        self.rid_job[rid] = job
        return rid

    def current_rid(self, job: str) -> str:
        if self.holder is not None and self.holder[0] == job:
            return self.holder[2]
        if job in self.entries:
            return self.entries[job][1]
        return f"x-{next(self.rid_counter)}"

    def step(self, ev: InputEvent) -> list[Action]:
        old = self.rec
        self.seq += SEQ_GAP  # room for the notices in the stream built at the end
        new, actions = apply(old, ev, self.now, self.seq)
        self.steps.append(Step(ev, self.now, self.seq, new, actions, before=self.facts))
        self.facts = []
        self.rec = new
        self.failed = True
        self.check_step(old, new, ev, actions)
        self.check_predict(old, new, ev, actions)
        self.failed = False
        if input_subject(ev).startswith("ts.v1.job."):  # what a claim's sequence check looks at
            free = [n for n in notices(actions, Released) if n.pending_waiters == 0 and n.ahead is None]
            self.claimable = (ev.job, free[0].epoch + 1) if isinstance(ev, Release) and free else None
            self.since_release = []
        else:
            self.since_release.append(tag(ev))
        return actions

    def step_inert(self, ev: InputEvent) -> None:
        """``ev`` must change nothing beyond what the mere passing of time changes."""
        as_tick = apply(self.rec, Tick(group=G), self.now, self.seq + SEQ_GAP)
        got = apply(self.rec, ev, self.now, self.seq + SEQ_GAP)
        assert got == as_tick, f"{ev} had an effect beyond a tick's"
        self.step(ev)

    # ------------------------------------------------------------------ checks

    # ------------------------------------------------------------------ rules

    @initialize(
        regs=st.fixed_dictionaries({j: st.sampled_from([(), ("n1",), ("n2",), NODES, NODES]) for j in JOBS}),
        shares=SHARES,
    )
    def setup(self, regs: dict[str, tuple[str, ...]], shares: dict[str, int]) -> None:
        for job, nodes in regs.items():
            for node in nodes:
                self.step(JobRegistered(group=G, job=job, node=node, op_timeout_ms=5_000))
        if shares:  # fair share from the start in some runs, so that its choices come up often
            self.step(SetPolicy(group=G, shares=shares))

    @rule(dt=st.sampled_from([1, 10, 100, 300, 300, 1_000, 1_000, 3_000, 5_000, 30_000, 400_000, -1, -2]))
    def wait(self, dt: int) -> None:
        """Time passes: a fixed step, or up to just before (-1) or exactly at (-2) the next deadline."""
        if dt > 0:
            self.now += dt
            return
        nd = next_deadline(self.rec)
        if nd is not None:
            self.now = max(self.now, nd + 1 + dt)

    @rule()
    def tick(self) -> None:
        self.step(Tick(group=G))

    @rule(quantum=st.sampled_from([0, 500, 5_000, 60_000]))
    def set_policy(self, quantum: int) -> None:
        self.step(SetPolicy(group=G, quantum_ms=quantum))

    @rule(shares=SHARES)
    def set_shares(self, shares: dict[str, int]) -> None:
        self.step(SetPolicy(group=G, shares=shares))

    @rule(min_hold=st.sampled_from([0, 300, 2_000, 20_000]))
    def set_min_hold(self, min_hold: int) -> None:
        self.step(SetPolicy(group=G, min_hold_ms=min_hold))

    @rule(on=st.sampled_from([True, True, False]))
    def set_predict(self, on: bool) -> None:
        self.step(SetPolicy(group=G, predict=on))

    @rule(data=st.data(), rounds=st.integers(1, 3), away=st.sampled_from([100, 1_000, 5_000]))
    def take_turns(self, data: st.DataObject, rounds: int, away: int) -> None:
        """Jobs take turns as an RL run's phases do (each asks, is switched in, works, releases and stays away a
        while), with responsive agents: the cycles the predictive restore learns from."""
        jobs = data.draw(st.lists(st.sampled_from(JOBS), min_size=2, max_size=3, unique=True))
        for _ in range(rounds):
            for job in jobs:
                self.acquire_patient(job)
                self.agents_answer_all(False, data.draw(st.booleans()), False)
                self.now += data.draw(st.sampled_from([away, away * 2, 10]))
                if self.holder is not None and self.holder[0] == job:
                    self.release()
                self.now += data.draw(st.sampled_from([0, 0, away, 3 * away]))  # nobody asks for a while
                if data.draw(st.integers(0, 3)):  # (else what the release started is left to the other rules)
                    self.agents_answer_all(False, False, False)

    @rule(
        data=st.data(),
        rounds=st.integers(1, 3),
        name=st.sampled_from(["rollout", "rollout", "reward"]),
        to_ask=st.sampled_from([10, 1_000, 5_000]),
    )
    def phase_turns(self, data: st.DataObject, rounds: int, name: str, to_ask: int) -> None:
        """Jobs take turns as in ``take_turns``, each publishing phase events (as ``timeslice_client.phase`` does) while
        away, a while before it asks (or not): the cues the predictive restore learns from at a phase start, and the
        plans they make. With the policy off, a phase event changes nothing beyond what time changes."""
        jobs = data.draw(st.lists(st.sampled_from(JOBS), min_size=1, max_size=3, unique=True))
        for _ in range(rounds):
            for job in jobs:
                edge: Literal["start", "end"] = data.draw(st.sampled_from(["start", "start", "start", "end"]))
                ev = Phase(group=G, job=job, name=name, edge=edge)
                if self.rec.predict:
                    self.step(ev)
                else:
                    self.step_inert(ev)
                self.now += data.draw(st.sampled_from([to_ask, to_ask, to_ask, 0, 2 * to_ask]))
                if data.draw(st.booleans()):
                    self.step(Tick(group=G))  # (a plan may come due before the ask)
                if not data.draw(st.integers(0, 5)):
                    continue  # (no ask this time)
                self.acquire_patient(job)
                self.agents_answer_all(False, data.draw(st.booleans()), False)
                self.now += data.draw(st.sampled_from([10, 1_000]))
                if self.holder is not None and self.holder[0] == job:
                    self.release()
                if data.draw(st.integers(0, 3)):
                    self.agents_answer_all(False, False, False)

    @precondition(lambda self: self.rec.switch is not None and self.rec.switch.ahead and self.rec.switch.to is None)
    @rule()
    def predicted_job_asks(self) -> None:
        """The job a predictive restore brings back asks while that switch runs."""
        assert self.rec.switch is not None and self.rec.switch.ahead is not None
        self.acquire_patient(self.rec.switch.ahead)

    @precondition(lambda self: self.rec.plan is not None)
    @rule(early=st.booleans())
    def plan_comes_due(self, early: bool) -> None:
        """Time runs to a predictive restore's start (or a millisecond short of it) and a tick looks."""
        assert self.rec.plan is not None
        self.now = max(self.now, self.rec.plan.at_ms - (1 if early else 0))
        self.step(Tick(group=G))

    @precondition(lambda self: self.rec.reserved is not None)
    @rule()
    def take_back(self) -> None:
        """The job the group is kept for asks again (within its window or not)."""
        assert self.rec.reserved is not None
        self.acquire_patient(self.rec.reserved.job)

    @precondition(lambda self: self.rec.quantum_ms > 0 and self.rec.holder is not None and self.rec.queue)
    @rule(extra=st.sampled_from([-1, 0, 0, 1, 50]))
    def hold_past_quantum(self, extra: int) -> None:
        """The holder and the waiters renew, then time runs to the holder's quantum (a millisecond short of it, at
        it, past it) and a tick looks."""
        self.renew_all()
        h = self.rec.holder
        if h is not None:
            self.now = max(self.now, h.granted_at_ms + self.rec.quantum_ms + extra)
            self.step(Tick(group=G))

    @rule(
        job=st.sampled_from(JOBS),
        lease=st.sampled_from([1_000, 5_000, 30_000, 30_000]),
        timeout=st.sampled_from([0, 1_000, 10_000, 300_000, 300_000]),
        ttl=st.sampled_from([300, 2_000, 5_000, 5_000]),
        confirm=st.sampled_from([300, 1_000, 3_000, 3_000]),
        invalid=st.sampled_from([None] * 12 + ["lease_ms", "waiter_ttl_ms", "confirm_ms", "timeout_ms"]),
        priority=PRIORITIES,
    )
    def acquire(
        self, job: str, lease: int, timeout: int, ttl: int, confirm: int, invalid: str | None, priority: int
    ) -> None:
        kw: dict[str, Any] = dict(
            lease_ms=lease, timeout_ms=timeout, waiter_ttl_ms=ttl, confirm_ms=confirm, priority=priority
        )
        if invalid is not None:
            kw[invalid] = {"lease_ms": 10, "waiter_ttl_ms": 10**9, "confirm_ms": 1, "timeout_ms": -1}[invalid]
        self.step(Acquire(group=G, job=job, request_id=self.fresh_rid(job), **kw))

    @rule(job=st.sampled_from(JOBS), priority=PRIORITIES)
    def acquire_patient(self, job: str, priority: int = 0) -> None:
        """A waiter that stays: long timeout, long liveness window, long confirmation window."""
        self.step(
            Acquire(
                group=G,
                job=job,
                request_id=self.fresh_rid(job),
                lease_ms=60_000,
                timeout_ms=600_000,
                waiter_ttl_ms=120_000,
                confirm_ms=60_000,
                priority=priority,
            )
        )

    @precondition(lambda self: self.holder is not None)
    @rule()
    def release(self) -> None:
        assert self.holder is not None
        job, epoch, rid = self.holder
        self.step(Release(group=G, job=job, request_id=rid, epoch=epoch))

    @precondition(lambda self: self.claimable is not None)
    @rule(
        lease=st.sampled_from([1_000, 30_000]),
        ttl=st.sampled_from([300, 5_000]),
        confirm=st.sampled_from([300, 3_000]),
    )
    def claim(self, lease: int, ttl: int, confirm: int) -> None:
        """The releasing job's next acquire as a claim: whatever non-job events came in between (time, ticks,
        agents, faults cleared), the core grants exactly the claimed epoch (the client returned already)."""
        assert self.claimable is not None
        job, epoch = self.claimable
        ev = Acquire(
            group=G,
            job=job,
            request_id=self.fresh_rid(job),
            lease_ms=lease,
            timeout_ms=0,
            waiter_ttl_ms=ttl,
            confirm_ms=confirm,
            claim_epoch=epoch,
        )
        between = sorted(set(self.since_release))
        grants = notices(self.step(ev), Granted)
        assert [(n.job, n.epoch, n.request_id) for n in grants] == [(job, epoch, ev.request_id)], grants
        event("claim granted")
        for t in between:
            event(f"claim granted after {t}")

    @precondition(lambda self: self.holder is not None)
    @rule(
        data=st.data(), others=st.lists(st.sampled_from(["wait", "tick", "agents", "clear_fault", "late"]), max_size=6)
    )
    def release_then_claim(self, data: st.DataObject, others: list[str]) -> None:
        """The holder releases; if nobody waited, non-job events of every kind come before its claim."""
        self.release()
        for kind in others:
            if self.claimable is None:
                return
            if kind == "wait":
                self.wait(data.draw(st.sampled_from([10, 1_000, 5_000, 400_000, -2])))
            elif kind == "tick":
                self.tick()
            elif kind == "agents":
                self.agents(
                    data,
                    data.draw(st.sampled_from(["register", "unregister", "lost"])),
                    data.draw(st.sampled_from(NODES)),
                    5_000,
                )
            elif kind == "clear_fault":
                self.clear_fault(data)
            else:
                self.noise(data, "late", data.draw(st.booleans()))
        if self.claimable is not None:
            self.claim(30_000, 5_000, 3_000)

    @rule()
    def renew_all(self) -> None:
        """A client's background renewer: the holder's lease and every waiter's place."""
        if self.holder is not None:
            job, epoch, rid = self.holder
            self.step(Renew(group=G, job=job, request_id=rid, epoch=epoch))
        for job, (_, rid, _, _) in sorted(self.entries.items()):
            self.step(Renew(group=G, job=job, request_id=rid))

    def some_rid(self, data: st.DataObject) -> str | None:
        rids = [e[1] for e in self.entries.values()]
        if self.holder is not None:
            rids.append(self.holder[2])
        rids += sorted(self.rid_job)[-2:]
        return data.draw(st.sampled_from(rids)) if rids else None

    def some_job(self, data: st.DataObject) -> str:
        """Mostly a job involved right now (holder, switch target, being snapshotted, waiting, faulted)."""
        rec = self.rec
        involved = {j for j in (rec.active_job, rec.holder.job if rec.holder else None) if j is not None}
        involved |= {op.job for op in pending_ops(rec)}
        if rec.switch is not None and rec.switch.to is not None:
            involved.add(rec.switch.to.job)
        involved |= {w.job for w in rec.queue} | set(rec.faulted)
        if involved and data.draw(st.integers(0, 3)) > 0:
            return data.draw(st.sampled_from(sorted(involved)))
        return data.draw(st.sampled_from(JOBS))

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rid = self.some_rid(data)
        if rid is not None:
            self.step(Cancel(group=G, job=self.rid_job[rid], request_id=rid, reason="cancelled"))

    @rule(data=st.data())
    def cancel_foreign(self, data: st.DataObject) -> None:
        """A job cancels a request id that may not be its own (a confused or hostile client)."""
        rid = self.some_rid(data)
        if rid is not None:
            self.step(Cancel(group=G, job=self.some_job(data), request_id=rid, reason="cancelled"))

    @rule(data=st.data(), delta=st.integers(-2, 1))
    def release_other(self, data: st.DataObject, delta: int) -> None:
        """A release from some job, with its latest request id and an epoch near the current one."""
        job = self.some_job(data)
        self.step(Release(group=G, job=job, request_id=self.current_rid(job), epoch=max(0, self.rec.epoch + delta)))

    @rule(data=st.data(), delta=st.integers(-2, 1), waiter=st.booleans())
    def renew_other(self, data: st.DataObject, delta: int, waiter: bool) -> None:
        """A renewal from some job: of a lease (with an epoch near the current one) or of a waiter's place."""
        if waiter:
            rid = self.some_rid(data)
            if rid is not None:
                self.step(Renew(group=G, job=self.rid_job[rid], request_id=rid))
            return
        job = self.some_job(data)
        self.step(Renew(group=G, job=job, request_id=self.current_rid(job), epoch=max(0, self.rec.epoch + delta)))

    @rule(data=st.data())
    def clear_fault(self, data: st.DataObject) -> None:
        """An operator clears a fault: mostly of a faulted job or of the incoming job of a switch."""
        sw = self.rec.switch
        likely = sorted(set(self.rec.faulted) | ({sw.to.job} if sw is not None and sw.to is not None else set()))
        if likely and data.draw(st.integers(0, 3)) > 0:
            job = data.draw(st.sampled_from(likely))
        else:
            job = data.draw(st.sampled_from(JOBS))
        self.step(ClearFault(group=G, job=job))

    @rule(
        data=st.data(),
        kind=st.sampled_from(["register", "register", "unregister", "lost"]),
        node=st.sampled_from(NODES),
        timeout=st.sampled_from([500, 5_000, 120_000]),
    )
    def agents(self, data: st.DataObject, kind: str, node: str, timeout: int) -> None:
        if kind == "register":
            self.step(JobRegistered(group=G, job=self.some_job(data), node=node, op_timeout_ms=timeout))
        elif kind == "unregister":
            job = self.some_job(data)
            sw = self.rec.switch
            for op in sw.ops if sw is not None else ():
                # The job left that node: its restore there ends with nothing to bring back (no fault), so a grant
                # may follow without it ("dropped"; seen with a predictive restore the job then asked into).
                if op.kind is OpKind.RESTORE and op.job == job and op.node == node and op.op_id in self.ops:
                    self.ops[op.op_id][1][0] = "dropped"
            self.step(JobUnregistered(group=G, job=job, node=node))
        else:
            sw = self.rec.switch
            if sw is not None:
                snapshotting = {op.node for op in sw.ops if op.kind is OpKind.SNAPSHOT}
                for op in sw.ops:
                    if (
                        op.kind is OpKind.RESTORE
                        and op.node == node
                        and node in snapshotting
                        and node not in self.rec.saved.get(op.job, ())
                    ):
                        self.ops[op.op_id][1][0] = "dropped"
            self.step(AgentLost(group=G, node=node))

    @precondition(lambda self: self.rec.switch is not None and self.rec.switch.to is not None)
    @rule(node=st.sampled_from(NODES))
    def incoming_job_registers(self, node: str) -> None:
        """The incoming job of a running switch (re)appears on a node, e.g. a worker restarted there."""
        sw = self.rec.switch
        assert sw is not None and sw.to is not None
        self.step(JobRegistered(group=G, job=sw.to.job, node=node, op_timeout_ms=5_000))

    def answer(self, op: OpRecord, epoch: int, ok: bool, *, reports: bool = True) -> None:
        """The agent's answer. A restore answered while a snapshot of its switch is pending on its node ran beside
        it (the room rule); the agent says so unless it is an older one (``reports``)."""
        beside = runs_beside(self.rec, op)
        if op.kind is OpKind.RESTORE:
            self.facts.append(op_started(op, epoch, overlapped=beside))
        on_time = self.now < op.deadline_ms  # else it times out before this answer is applied
        if on_time:
            self.ops[op.op_id][1][0] = ok
            if ok and beside and reports:
                self.beside.add((op.node, epoch))
        tr, holder = self.rec.trailing, self.rec.holder
        self.step(
            AgentOp.pending(G, op, epoch).result(
                ok, error=None if ok else "backend failed", overlapped=beside and reports
            )
        )
        if tr is not None and op in tr.ops and not ok:
            # A failed trailing snapshot (rolled back: its context stays beside the holder's) faults its job only.
            assert op.job in self.rec.faulted and op not in pending_ops(self.rec), self.rec
            assert holder is None or holder.lease_deadline_ms <= self.now or self.rec.holder == holder
            event("trailing snapshot failed" if on_time else "trailing snapshot timed out")

    @precondition(lambda self: pending_ops(self.rec))
    @rule(data=st.data(), ok=st.sampled_from([True, True, False]), reports=st.sampled_from([True, True, False]))
    def op_result(self, data: st.DataObject, ok: bool, reports: bool) -> None:
        self.answer(data.draw(st.sampled_from(pending_ops(self.rec))), pending_epoch(self.rec), ok, reports=reports)

    @precondition(lambda self: pending_ops(self.rec) or self.holder is not None)
    @rule(release=st.booleans(), restores_first=st.booleans(), trail=st.booleans())
    def agents_answer_all(self, release: bool, restores_first: bool, trail: bool) -> None:
        """Responsive agents: every pending operation succeeds, phase after phase (after the holder's
        release, if ``release``): a smooth handoff; with ``restores_first``, the restores end first (beside), and
        with ``trail`` the snapshots a grant on restore left running are left to other rules."""
        if release and self.holder is not None:
            self.release()
        for _ in range(4):
            ops = sorted(pending_ops(self.rec), key=lambda o: (o.kind is OpKind.SNAPSHOT) == restores_first)
            if not ops or (trail and self.rec.trailing is not None):
                return
            epoch = pending_epoch(self.rec)
            for op in ops:
                if op in pending_ops(self.rec) and pending_epoch(self.rec) == epoch:
                    self.answer(op, epoch, True)

    @rule(data=st.data(), kind=st.sampled_from(["late", "forged", "phase", "duplicate"]), ok=st.booleans())
    def noise(self, data: st.DataObject, kind: str, ok: bool) -> None:
        """Events that must change nothing (beyond what time changes)."""
        if kind == "phase" and not self.rec.predict:  # (with the policy on, a phase start may plan: phase_then_asks)
            self.step_inert(Phase(group=G, job=data.draw(st.sampled_from(JOBS)), name="train", edge="start"))
        elif kind == "forged" and pending_ops(self.rec):
            # A pending operation's id with an older epoch: fenced off.
            op = data.draw(st.sampled_from(pending_ops(self.rec)))
            self.step_inert(AgentOp.pending(G, op, pending_epoch(self.rec) - 1).result(ok, overlapped=ok))
        elif kind == "late":
            # An answer for an operation that is no longer pending (answered, timed out, older switch).
            pending = {op.op_id for op in pending_ops(self.rec)}
            old = [c for c, _ in self.ops.values() if c.op_id not in pending]
            if old:
                c = data.draw(st.sampled_from(old))
                self.step_inert(AgentOp.of(c).result(ok, overlapped=ok))
        elif kind == "duplicate" and self.rec.last_seq > 0:
            # Re-applying an event already reflected in the record: the same object, no actions.
            done = [s for s in self.steps if s.seq <= self.rec.last_seq]
            s = data.draw(st.sampled_from(done))
            seq = data.draw(st.sampled_from([s.seq, self.rec.last_seq]))
            new, actions = apply(self.rec, s.ev, self.now, seq)
            assert new is self.rec and actions == []

    # ------------------------------------------------------------------ invariants and the end

    @invariant()
    def deadlines_are_exact(self) -> None:
        """Nothing expires before ``next_deadline``; something does at it."""
        nd = next_deadline(self.rec)
        probe = self.seq + SEQ_GAP
        quiet_until = self.now + 10**9 if nd is None else nd - 1
        if quiet_until >= self.now:
            new, actions = apply(self.rec, Tick(group=G), quiet_until, probe)
            assert new is self.rec and actions == [], f"a tick before the next deadline {nd} changed the record"
        if nd is not None:
            new, _ = apply(self.rec, Tick(group=G), max(nd, self.now), probe)
            assert new is not self.rec, f"nothing expired at the next deadline {nd}"

    def teardown(self) -> None:
        if not self.failed:
            check_run(self.steps, self.rec, self.grants, self.max_epoch, self.holder[:2] if self.holder else None)


CoreMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCoreStateMachine = CoreMachine.TestCase
