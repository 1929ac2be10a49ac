"""``acquire_all`` and the order rule against the orchestrator's real core, in simulated time (timeslice issue 28).

The client's own multi-group code (``timeslice_client._multi_group.JobGroups``: the order, the turn, the rule, the
unwinding after a failure) runs unchanged; under it, each group's client is a model (``SimMember``, at the seam
``JobGroups`` declares: ``Member``) that speaks the wire protocol to the real ``apply()`` of every group through
a bus with a latency each way, on an event loop whose clock jumps to its next timer (``VirtualLoop``), so seconds of
contention take milliseconds.

Hypothesis draws any mix of jobs: single-group jobs (one hold at a time), jobs that take several groups listed in
any order, jobs that hold one group and then ask for another; patient ones (a timeout far beyond all the work
there is) and impatient ones (timeouts of milliseconds), hold times, faults after a grant (a workload that could not
be resumed), cancellations mid-call. Checked:

* every job finishes, and no patient job ever times out: a deadlock would hold patient jobs until their timeout
  (and a loop with nothing left to run but waits stops the run);
* never two holders of one group, as the clients see it (a grant arrives while another client believes it holds)
  and as the core records it (``check_record``), and no job waits for a group while the core records it holding one
  that sorts after it (the order rule, seen from the lock);
* after a failed ``acquire_all`` (timeout, cancel, fault), once its messages have landed, no group the call asked for
  records that job as holder, waiter or switch target, and its client holds none of them;
* ``LockOrderError`` exactly when the rule says so.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import selectors
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from timeslice_client import (
    AcquireAllFailed,
    AcquireCancelled,
    AcquireTimeout,
    Grant,
    GroupRecord,
    HandlerError,
    InvalidRequest,
    LockOrderError,
    ReleaseResult,
)
from timeslice_client._multi_group import JobGroups
from timeslice_client.protocol import (
    Acquire,
    Cancel,
    DequeueCode,
    Dequeued,
    Granted,
    InputEvent,
    Notice,
    Refused,
    Release,
    Released,
    Renew,
    Tick,
)
from timeslice_orchestrator.core import Notify, apply, new_record, next_deadline
from timeslice_orchestrator.invariants import check_record

GROUPS = ("g0", "g1", "g2", "g3")
T0 = 1_000_000  # the core's clock (ms) at virtual time 0
PATIENT_S = 60.0  # far beyond all the work of one example (at most 6 jobs x 4 steps x 30 ms, plus the bus)
LEASE_MS = 3_600_000  # leases and waits outlive every example: no renewals needed, none lost
TTL_MS = 600_000
_EPS = 1e-6  # a timer may fire a clock resolution early: what is due within it is due


class Stalled(AssertionError):
    """Nothing is ready and no timer is set, yet the run is not over: every task waits for another."""


class _Jump(selectors.SelectSelector):
    """The selector of ``VirtualLoop``: it never blocks; a wait for the next timer moves the clock there at once."""

    def __init__(self, loop_time: list[float]) -> None:
        super().__init__()
        self._now = loop_time

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Stalled("nothing to run and no timer: a deadlock")
        self._now[0] += max(0.0, timeout)
        return super().select(0)


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time: ``time()`` moves only when the loop would wait for a timer."""

    def __init__(self) -> None:
        self._now = [0.0]
        super().__init__(_Jump(self._now))

    def time(self) -> float:
        return self._now[0]


# --------------------------------------------------------------------------- the bus and the core


class SimBus:
    """The stream and the orchestrator: job inputs reach ``apply()`` of their group ``latency`` s after they are
    sent, in the order sent; notices reach their client ``latency`` s later; ticks at ``next_deadline``."""

    def __init__(self, latency: float, *, check_order: bool = True) -> None:
        self.latency = latency
        self.check_order = check_order
        self.loop = asyncio.get_running_loop()
        self.failure: asyncio.Future[None] = self.loop.create_future()  # a check that failed in a callback
        self.records: dict[str, GroupRecord] = {g: new_record(g) for g in GROUPS}
        self.seq = 0
        self._inbox: collections.deque[tuple[float, InputEvent]] = collections.deque()
        self._outbox: collections.deque[tuple[float, Notice]] = collections.deque()
        self._ticks: dict[str, asyncio.TimerHandle] = {}
        self._drained = asyncio.Event()  # set after each delivery (see ``quiet``)
        self.clients: dict[tuple[str, str], SimMember] = {}
        self.believed: dict[str, str | None] = dict.fromkeys(GROUPS)  # group -> the client that believes it holds

    def now_ms(self) -> int:
        return T0 + math.floor(self.loop.time() * 1000 + 1e-6)

    def send(self, ev: InputEvent) -> None:
        when = self.loop.time() + self.latency
        self._inbox.append((when, ev))
        self.loop.call_at(when, self._checked, self._drain_in)

    def _checked(self, fn: Callable[[], None]) -> None:
        """Run a callback of the loop's; a check that fails in it ends the run (the loop would only log it)."""
        try:
            fn()
        except AssertionError as exc:
            if not self.failure.done():
                self.failure.set_exception(exc)

    def _drain_in(self) -> None:
        while self._inbox and self._inbox[0][0] <= self.loop.time() + _EPS:
            self._apply(self._inbox.popleft()[1])
        self._drained.set()

    async def quiet(self, timeout: float = 10.0) -> None:
        """Until no message is in flight: every input applied, every notice delivered (and what they caused)."""
        async with asyncio.timeout(timeout):
            while self._inbox or self._outbox:
                self._drained.clear()
                await self._drained.wait()

    def _apply(self, ev: InputEvent) -> None:
        g = ev.group
        self.seq += 1
        rec, actions = apply(self.records[g], ev, self.now_ms(), self.seq)
        check_record(rec)
        self.records[g] = rec
        if self.check_order:
            self.check_order_at_the_core()
        for a in actions:
            if isinstance(a, Notify):
                when = self.loop.time() + self.latency
                self._outbox.append((when, a.notice))
                self.loop.call_at(when, self._checked, self._drain_out)
        if (old := self._ticks.pop(g, None)) is not None:
            old.cancel()
        if (due := next_deadline(rec)) is not None:
            at = max(self.loop.time(), (due - T0) / 1000 + 1e-6)
            self._ticks[g] = self.loop.call_at(at, self._checked, lambda: self._apply(Tick(group=g)))

    def _drain_out(self) -> None:
        while self._outbox and self._outbox[0][0] <= self.loop.time() + _EPS:
            n = self._outbox.popleft()[1]
            client = self.clients.get((n.group, n.job))
            if client is not None:
                client.on_notice(n)
        self._drained.set()

    def check_order_at_the_core(self) -> None:
        """No job waits for a group while the core has it holding one that sorts after it."""
        holds: dict[str, list[str]] = collections.defaultdict(list)
        for g, rec in self.records.items():
            if rec.holder is not None:
                holds[rec.holder.job].append(g)
        for g, rec in self.records.items():
            waiting = [w.job for w in rec.queue]
            if rec.switch is not None and rec.switch.to is not None:
                waiting.append(rec.switch.to.job)
            for job in waiting:
                above = [h for h in holds[job] if h > g]
                assert not above, f"job {job} waits for {g} while holding {above}: the order is broken"

    def nothing_of(self, job: str, groups: list[str]) -> None:
        for g in groups:
            rec = self.records[g]
            to = rec.switch.to.job if rec.switch is not None and rec.switch.to is not None else None
            assert rec.holder is None or rec.holder.job != job, f"{job} still holds {g} after a failed call"
            assert job not in {w.job for w in rec.queue} and to != job, f"{job} still waits for {g}"


class SimMember:
    """One job's client of one group, as ``JobGroups`` sees it (``Member``), over ``SimBus``: what
    ``AsyncTimeSliceClient`` does with the wire, without the keeper (leases and waits outlive the run)."""

    def __init__(self, job: str, group: str, bus: SimBus) -> None:
        self.job_id, self.group_id, self.acquire_timeout_s = job, group, PATIENT_S
        self.bus = bus
        self.groups: JobGroups[SimMember] | None = None
        self.hold: tuple[int, str] | None = None  # (epoch, request id)
        self.pending: dict[str, asyncio.Future[Notice]] = {}
        self.fault_next = False  # the next acquire's grant comes with a workload that cannot be resumed
        self.rids = itertools.count(1)
        bus.clients[(group, job)] = self

    @property
    def holding(self) -> bool:
        return self.hold is not None

    @property
    def epoch(self) -> int | None:
        return self.hold[0] if self.hold else None

    def on_notice(self, n: Notice) -> None:
        fut = self.pending.get(getattr(n, "request_id", ""))
        if fut is not None and not fut.done():
            fut.set_result(n)

    async def acquire(self, timeout: float | None = None) -> Grant:
        """As ``AsyncTimeSliceClient.acquire``: the grant through ``JobGroups``, then the workloads' resume (which
        may fail: the group is released again and HandlerError raised)."""
        assert self.groups is not None
        grant = await self.groups.acquire(self, timeout)
        if self.fault_next:
            self.fault_next = False
            await self.release()
            raise HandlerError(f"{self.job_id}'s workload in {self.group_id} could not be resumed")
        return grant

    async def _acquire(self, timeout: float | None) -> Grant:
        loop = asyncio.get_running_loop()
        t = self.acquire_timeout_s if timeout is None else timeout
        deadline = loop.time() + t
        rid = f"{self.job_id}-{self.group_id}-{next(self.rids)}"
        fut: asyncio.Future[Notice] = loop.create_future()
        self.pending[rid] = fut
        granted = False
        self.bus.send(
            Acquire(
                group=self.group_id,
                job=self.job_id,
                request_id=rid,
                lease_ms=LEASE_MS,
                timeout_ms=int(t * 1000),
                waiter_ttl_ms=TTL_MS,
                confirm_ms=TTL_MS,
            )
        )
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    n = await fut
            except TimeoutError:
                raise AcquireTimeout(self.group_id, self.job_id, t) from None
            if isinstance(n, Dequeued):
                if n.code is DequeueCode.TIMEOUT:
                    raise AcquireTimeout(self.group_id, self.job_id, t)
                raise AcquireCancelled(self.group_id, self.job_id, n.reason, code=n.code)
            if isinstance(n, Refused):
                raise InvalidRequest(n.message, group_id=self.group_id, job_id=self.job_id)
            assert isinstance(n, Granted), n
            other = self.bus.believed[self.group_id]
            assert other in (None, self.job_id), f"{self.job_id} granted {self.group_id} while {other} holds it"
            self.bus.believed[self.group_id] = self.job_id
            self.hold = (n.epoch, rid)
            granted = True
            self.bus.send(Renew(group=self.group_id, job=self.job_id, request_id=rid, epoch=n.epoch))  # confirmed
            return Grant(self.group_id, self.job_id, n.epoch, n.waited_ms, n.context_restored)
        finally:
            self.pending.pop(rid, None)
            if not granted:  # withdrawn; a grant that crossed it is released by the core
                self.bus.send(Cancel(group=self.group_id, job=self.job_id, request_id=rid, reason="timeout or cancel"))

    async def release(self) -> ReleaseResult:
        assert self.hold is not None
        (epoch, _), self.hold = self.hold, None
        self.bus.believed[self.group_id] = None
        rid = f"{self.job_id}-{self.group_id}-r{next(self.rids)}"
        fut: asyncio.Future[Notice] = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        self.bus.send(Release(group=self.group_id, job=self.job_id, request_id=rid, epoch=epoch))
        try:
            async with asyncio.timeout(5):
                n = await fut
        finally:
            self.pending.pop(rid, None)
        assert isinstance(n, Released), n
        return ReleaseResult(self.group_id, self.job_id, n.epoch, n.pending_waiters, n.snapshot_deferred)

    async def connect(self) -> SimMember:
        return self

    async def close(self) -> None:
        """Nothing to close: the bus goes with the example."""

    async def _on_reconnected(self) -> None:
        """The model's bus never drops a notice."""

    def _settle_budget(self) -> float:
        return 0.0


# --------------------------------------------------------------------------- the jobs


@dataclass
class Step:
    kind: str  # "one": one group; "all": acquire_all of several, listed as drawn; "then": hold one, ask another
    groups: list[str]
    hold_ms: int
    fault: bool = False  # the grant of the call's last group needs a resume that fails
    cancel_ms: int | None = None  # the call is cancelled after this long (``asyncio.timeout`` around it)


@dataclass
class JobPlan:
    name: str
    patient: bool
    timeout_ms: int
    steps: list[Step]
    outcomes: list[str] = field(default_factory=list)


_hold = st.integers(0, 30)
_step_one = st.builds(Step, st.just("one"), st.lists(st.sampled_from(GROUPS), min_size=1, max_size=1), _hold)
_step_all = st.builds(
    Step,
    st.just("all"),
    st.lists(st.sampled_from(GROUPS), min_size=2, max_size=4, unique=True),
    _hold,
    st.booleans(),
    st.none() | st.integers(0, 40),
)
_step_then = st.builds(Step, st.just("then"), st.lists(st.sampled_from(GROUPS), min_size=2, max_size=2), _hold)


@st.composite
def _jobs(draw: st.DrawFn) -> list[JobPlan]:
    plans = []
    for i in range(draw(st.integers(2, 6))):
        multi = draw(st.booleans())
        steps = draw(
            st.lists(st.one_of(_step_all, _step_then, _step_one) if multi else _step_one, min_size=1, max_size=4)
        )
        plans.append(JobPlan(f"j{i}", draw(st.booleans()), draw(st.integers(1, 40)), steps))
    return plans


async def _run_job(plan: JobPlan, bus: SimBus) -> None:
    first = plan.steps[0].groups[0]
    owner = SimMember(plan.name, first, bus)

    def make(g: str) -> SimMember:
        m = SimMember(plan.name, g, bus)
        m.groups = jg
        return m

    jg: JobGroups[SimMember] = JobGroups(owner, make)
    owner.groups = jg
    timeout = PATIENT_S if plan.patient else plan.timeout_ms / 1000
    for step in plan.steps:
        try:
            await _run_step(plan, step, jg, bus, timeout)
        except (AcquireTimeout, AcquireAllFailed, HandlerError, TimeoutError) as exc:
            cause = f"({type(exc.error).__name__})" if isinstance(exc, AcquireAllFailed) else ""
            plan.outcomes.append(f"{step.kind}: {type(exc).__name__}{cause}")
            if plan.patient and isinstance(exc, AcquireTimeout):
                raise AssertionError(f"patient job {plan.name} timed out: a deadlock ({exc})") from exc
        await jg.release_all()
        assert jg.held() == ()


async def _run_step(plan: JobPlan, step: Step, jg: JobGroups[SimMember], bus: SimBus, timeout: float) -> None:
    if step.kind == "one":
        m = await jg.member(step.groups[0])
        await m.acquire(timeout)
        await asyncio.sleep(step.hold_ms / 1000)  # the work, in simulated time
        await m.release()
        plan.outcomes.append("one: ok")
        return
    if step.kind == "then":
        g1, g2 = step.groups
        m1, m2 = await jg.member(g1), await jg.member(g2)
        await m1.acquire(timeout)
        try:
            await m2.acquire(timeout)
        except LockOrderError as exc:
            assert g2 < g1 and (exc.group_id, exc.held) == (g2, (g1,)), exc
            assert jg.held() == (g1,), "a refused ask gave up what was held"
            plan.outcomes.append("then: LockOrderError")
            return
        assert g2 >= g1, f"{plan.name} held {g1} and was let wait for {g2}"
        await asyncio.sleep(step.hold_ms / 1000)
        plan.outcomes.append("then: ok")
        return
    order = sorted(step.groups)
    if step.fault:
        (await jg.member(order[-1])).fault_next = True
    try:
        if step.cancel_ms is None:
            grants = await jg.acquire_all(step.groups, timeout)
        else:
            async with asyncio.timeout(step.cancel_ms / 1000):
                grants = await jg.acquire_all(step.groups, timeout)
    except (AcquireAllFailed, TimeoutError) as exc:
        if isinstance(exc, AcquireAllFailed):
            assert exc.kept == () and exc.groups == tuple(order) and exc.group_id in order
        assert jg.held() == (), f"{plan.name} still holds {jg.held()} after a failed acquire_all"
        await bus.quiet()  # its last messages (the withdrawal) land
        bus.nothing_of(plan.name, order)
        raise
    finally:
        for g in order:
            if (m := jg.members.get(g)) is not None:
                m.fault_next = False
    assert list(grants) == order and jg.held() == tuple(order)
    await asyncio.sleep(step.hold_ms / 1000)
    plan.outcomes.append("all: ok")


def _simulate(plans: list[JobPlan], latency_ms: int) -> SimBus:
    async def main() -> SimBus:
        bus = SimBus(latency_ms / 1000)

        async def watch(jobs: list[asyncio.Task[None]]) -> None:
            ended = asyncio.gather(*jobs, return_exceptions=True)  # a job's own error: the group says it
            await asyncio.wait([bus.failure, ended], return_when=asyncio.FIRST_COMPLETED)
            if bus.failure.done():
                bus.failure.result()  # raises it: the group cancels the jobs

        async with asyncio.timeout(10 * PATIENT_S), asyncio.TaskGroup() as tg:
            jobs = [tg.create_task(_run_job(p, bus)) for p in plans]
            tg.create_task(watch(jobs))
        await bus.quiet()  # the last messages land (a withdrawal, its answer)
        if bus.failure.done():
            bus.failure.result()
        bus.failure.cancel()
        return bus

    return _run_virtual(main())


def _run_virtual(coro: Any) -> Any:
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans=_jobs(), latency_ms=st.integers(0, 5))
def test_any_mix_of_jobs_finishes_without_deadlock_and_failures_leave_nothing(
    plans: list[JobPlan], latency_ms: int
) -> None:
    try:
        bus = _simulate(plans, latency_ms)
    except* AssertionError as group:
        raise group.exceptions[0] from None
    for p in plans:
        assert len(p.outcomes) == len(p.steps), (p.name, p.outcomes)
        for o in p.outcomes:
            event(f"{'patient' if p.patient else 'impatient'}: {o}")
    for g, rec in bus.records.items():
        assert rec.holder is None and not rec.queue, f"{g} is left {rec.state} after every job ended"


def _crossed(check_order: bool) -> list[str]:
    """Two patient jobs, each holding one group and then waiting for the other's, by hand (what the order rule
    forbids): ``check_order`` off, they stall until their timeout; on, the core check stops the run."""

    async def crossed(bus: SimBus, job: str, first: str, second: str, both: asyncio.Barrier) -> str:
        a, b = SimMember(job, first, bus), SimMember(job, second, bus)
        await a._acquire(PATIENT_S)
        await both.wait()
        try:
            await b._acquire(1.0)
        except AcquireTimeout:
            return "timed out"
        finally:
            await a.release()
        await b.release()
        return "got both"

    async def main() -> list[str]:
        bus = SimBus(0.001, check_order=check_order)
        both = asyncio.Barrier(2)
        run = asyncio.gather(crossed(bus, "x", "g0", "g1", both), crossed(bus, "y", "g1", "g0", both))
        await asyncio.wait([run, bus.failure], return_when=asyncio.FIRST_COMPLETED)
        if bus.failure.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            bus.failure.result()
        return list(await run)

    result: list[str] = _run_virtual(main())
    return result


def test_the_simulation_sees_a_deadlock_of_jobs_taking_two_groups_in_opposite_orders() -> None:
    """The harness can fail: the deadlock the issue describes shows, both as patient jobs timing out and as the
    order check at the core."""
    assert _crossed(check_order=False) == ["timed out", "timed out"]
    try:
        _crossed(check_order=True)
    except AssertionError as exc:
        assert "the order is broken" in str(exc)
    else:
        raise AssertionError("the core check did not see y wait for g0 while holding g1")


def test_the_virtual_loop_stops_a_run_that_can_never_end() -> None:
    async def forever() -> None:
        await asyncio.get_running_loop().create_future()

    try:
        _run_virtual(forever())
    except Stalled:
        return
    raise AssertionError("a run with nothing left to do but wait did not stop")
