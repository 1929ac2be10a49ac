"""Weighted fair share never starves a waiter, and decides as its rule says: a hypothesis property over any shares,
any earlier usage, any priority classes, ageing periods and half-lives, and any sequence of requests and holds, driven
through the pure core (``apply``).

The bound (``_fair_share``): fair share orders only waiters of equal effective priority (class plus ageing), so a
waiter of class ``c`` that asked at ``t`` is ahead of every request made from ``t + (MAX_PRIORITY - c + 1)`` ageing
periods on; from then on it waits at most for the hold running and one hold of each other job that was waiting then.
With ``J`` jobs, holds of at most ``H`` and switches that take no time (no agent here), it is granted by
``t + (MAX_PRIORITY - c + 1) * ageing + (J - 1) * H``.

Checked at every step besides: the record's invariants, one holder at a time (mutual exclusion, as the notices tell
it), each choice against a model of the rule (class plus ageing, then the least usage per share, then who asked first)
and said in ``GroupRecord.picked`` when fair share made it, and, without decay, each job's usage equal to its earlier
usage plus the time it held."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from fractions import Fraction

import msgspec
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from timeslice_client.protocol import (
    MAX_PRIORITY,
    MAX_SHARE,
    Acquire,
    Granted,
    GroupRecord,
    InputEvent,
    Release,
    Released,
    Usage,
)
from timeslice_orchestrator._fair_share import decayed
from timeslice_orchestrator.core import Limits, apply, new_record
from timeslice_orchestrator.invariants import check_record

from .core_sim import T0, G, notices

H = 5_000  # the longest hold
PATIENT = dict(lease_ms=3_600_000, timeout_ms=7 * 24 * 3600 * 1000, waiter_ttl_ms=10**9, confirm_ms=10**9)


@dataclass
class Scenario:
    classes: dict[str, int]
    shares: dict[str, int]
    earlier: dict[str, int]  # usage before the run, in ms
    limits: Limits
    plans: dict[str, list[tuple[int, int]]]  # job -> its requests: (think time before it asks, how long it holds)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    jobs = [f"j{i}" for i in range(draw(st.integers(2, 5)))]
    classes = {j: draw(st.sampled_from([0, 0, 0, 1, 4, MAX_PRIORITY])) for j in jobs}
    shares = draw(st.dictionaries(st.sampled_from(jobs), st.sampled_from([1, 2, 3, 10, MAX_SHARE])))
    earlier = draw(st.dictionaries(st.sampled_from(jobs), st.sampled_from([0, 1_000, 60_000, 10**9]))) if shares else {}
    limits = Limits(
        max_ttl_ms=10**9,
        priority_ageing_ms=draw(st.sampled_from([300, 2_000, 60_000])),
        usage_half_life_ms=draw(st.sampled_from([0, 0, 1_000, 600_000])),  # (0: no decay)
        max_usage_jobs=draw(st.sampled_from([2, 128])),
    )
    hold = st.integers(1, H)
    plans = {
        j: draw(st.lists(st.tuples(st.sampled_from([0, 0, 1, 500, 3_000]), hold), min_size=1, max_size=8)) for j in jobs
    }
    return Scenario(classes, dict(sorted(shares.items())), earlier, limits, plans)


@dataclass
class Run:
    """The jobs' side of the run: who waits since when, who holds, and what each held."""

    s: Scenario
    rec: GroupRecord
    now: int = T0
    seq: int = 0
    order: itertools.count[int] = field(default_factory=itertools.count)
    waiting: dict[str, tuple[int, int]] = field(default_factory=dict)  # job -> (asked at, ask order)
    asks_at: dict[str, int] = field(default_factory=dict)  # job -> when it asks next
    holder: tuple[str, int] | None = None  # (job, until)
    held: dict[str, int] = field(default_factory=dict)
    longest_wait: float = 0.0  # of the bound

    def step(self, ev: InputEvent) -> list[Granted]:
        before = self.rec
        self.seq += 1
        self.rec, actions = apply(self.rec, ev, self.now, self.seq, self.s.limits)
        check_record(self.rec)
        released = notices(actions, Released)
        if released:
            assert self.holder is not None and released[0].job == self.holder[0]
            self.holder = None
        grants = notices(actions, Granted)
        assert len(grants) <= 1, grants
        for g in grants:
            assert self.holder is None, f"{g.job} granted while {self.holder} holds: mutual exclusion"
            self.check_choice(g.job, before)
        return grants

    def bound(self, job: str) -> int:
        jobs = len(self.s.classes)
        return (MAX_PRIORITY - self.s.classes[job] + 1) * self.s.limits.priority_ageing_ms + (jobs - 1) * H

    def check_choice(self, job: str, before: GroupRecord) -> None:
        """``job`` was granted: it waited within the bound and no other waiter came first by the rule."""
        asked, _ = self.waiting[job]
        assert self.now - asked <= self.bound(job), f"{job} waited {self.now - asked} ms, past {self.bound(job)}"
        self.longest_wait = max(self.longest_wait, (self.now - asked) / self.bound(job))
        lim, rec = self.s.limits, self.rec

        def key(j: str) -> tuple[int, Fraction, int, int]:
            at, order = self.waiting[j]
            u = rec.usage.get(j)
            used = decayed(u, self.now, lim.usage_half_life_ms) if u is not None and rec.shares else 0
            load = Fraction(used, rec.shares.get(j, 1))
            return (self.s.classes[j] + (self.now - at) // lim.priority_ageing_ms, -load, -at, -order)

        rivals = [j for j in self.waiting if j != job]
        better = [j for j in rivals if key(j) > key(job)]
        assert not better, f"passed to {job} {key(job)} while {[(j, key(j)) for j in better]} came first"
        tied = [j for j in rivals if key(j)[0] == key(job)[0]]
        if rec.shares and tied:
            p = rec.picked
            assert p is not None and (p.job, p.at_ms) == (job, self.now) and p.over in tied, (p, tied)
            event("fair share put one first" if any(key(j)[2:] > key(job)[2:] for j in tied) else "fair share agreed")
        else:
            assert rec.picked == before.picked, "a choice fair share did not make is not said to be its"

    def granted(self, job: str, hold_ms: int) -> None:
        del self.waiting[job]
        assert self.rec.holder is not None and self.rec.holder.job == job
        self.holder = (job, self.now + hold_ms)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_waiter_is_granted_within_the_bound_and_by_the_rule(s: Scenario) -> None:
    usage = {j: Usage(held_ms=u, at_ms=T0) for j, u in s.earlier.items()}
    run = Run(s, msgspec.structs.replace(new_record(G), shares=s.shares, usage=usage))
    plans = {j: list(p) for j, p in s.plans.items()}
    run.asks_at = {j: T0 + p[0][0] for j, p in plans.items()}
    holds: dict[str, int] = {}
    while run.asks_at or run.holder is not None:
        due = [(run.holder[1], 0, run.holder[0])] if run.holder is not None else []
        due += [(at, 1, job) for job, at in run.asks_at.items()]
        run.now, kind, job = min(due)
        if kind == 0:  # the holder releases; it asks again after its think time, if it has more to do
            h = run.rec.holder
            assert h is not None and h.job == job
            run.held[job] = run.held.get(job, 0) + run.now - h.granted_at_ms
            grants = run.step(Release(group=G, job=job, request_id=h.request_id, epoch=h.epoch))
            if plans[job]:
                run.asks_at[job] = run.now + plans[job][0][0]
            check_usage(run, job)
        else:
            del run.asks_at[job]
            _, holds[job] = plans[job].pop(0)
            run.waiting[job] = (run.now, next(run.order))
            grants = run.step(
                Acquire(group=G, job=job, request_id=f"{job}-{run.seq}", priority=s.classes[job], **PATIENT)
            )
        for g in grants:
            run.granted(g.job, holds[g.job])
    assert not run.waiting, f"left waiting: {run.waiting}"
    event(f"longest wait: {int(run.longest_wait * 4) * 25}-{int(run.longest_wait * 4) * 25 + 25}% of its bound")


def check_usage(run: Run, job: str) -> None:
    """Without decay, and with room for every job, a job's usage is exactly its earlier usage plus what it held."""
    rec, lim = run.rec, run.s.limits
    if not rec.shares:
        assert rec.usage == {}, "no usage kept with fair share off"
        return
    if lim.usage_half_life_ms == 0 and lim.max_usage_jobs >= len(run.s.classes):
        assert rec.usage[job].held_ms == run.s.earlier.get(job, 0) + run.held[job], (job, rec.usage[job], run.held)
    assert len(rec.usage) <= lim.max_usage_jobs
