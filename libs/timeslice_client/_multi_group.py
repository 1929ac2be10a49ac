"""Several groups for one job's client: ``acquire_all``, ``release_all``, ``on_accelerators(groups=...)``.

A client is one (job, group). The job's other groups are held by *sibling* clients: ``AsyncTimeSliceClient``s of
the same job and options, on the client's own NATS connection, made the first time a call names their group and
closed with the client. Each keeps its own hold with the machinery of any client (the keeper's renewals, notices,
claims, workload channels and their early suspend); ``JobGroups`` is what they share: which members the job has,
and the one rule that keeps jobs holding several groups from deadlocking (docs/multi-pool.md):

* **one global order**: a job waits for a group only while every group it holds sorts before it (``str`` order of
  the ids). ``acquire_all`` takes its groups in that order; a single ``acquire()`` of a group that sorts before one
  the job holds is refused at once (``LockOrderError``), before anything is sent. A wait-for cycle would need a job
  waiting for a group below one it holds, so none can form, whatever the mix of jobs;
* **one acquire of a job's at a time**: the acquires of a client and its siblings take turns (an ``asyncio.Lock``,
  waited for within the call's timeout), so the rule is checked against what the job holds when it waits, and a
  job never waits for two groups at once;
* **nothing left behind**: when ``acquire_all`` fails at a group (timeout, cancel, refusal, fault), the group's own
  client has withdrawn its wait (a grant that crossed the withdrawal is released by the orchestrator), and every
  group the call took is released, in reverse order, before the error (``AcquireAllFailed``) is raised.

A job with one group never sees any of it but the turn-taking: its acquires go as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar

from ._descriptors import Forwarded
from ._grants import Grant, ReleaseResult
from ._hold_scope import AsyncHold, SyncHold, SyncScopes, _SyncClient
from ._scope_decorators import run_within, run_within_async
from .errors import (
    AcquireAllFailed,
    AcquireAllTimeout,
    AcquireTimeout,
    InvalidRequest,
    LockLost,
    LockOrderError,
    TimeSliceError,
)
from .protocol import validate_id

if TYPE_CHECKING:
    from ._async_client import AsyncTimeSliceClient

__all__ = [
    "MAX_GROUPS",
    "AsyncMultiHold",
    "JobGroups",
    "MultiGroupCalls",
    "SyncGroups",
    "SyncMultiHold",
    "sibling",
    "take_order",
]

log = logging.getLogger("timeslice.client")

MAX_GROUPS = 16  # groups one client takes (its own and its siblings'), and so at most this many in one acquire_all

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Member(Protocol):
    """What ``JobGroups`` needs of the client of one group (``AsyncTimeSliceClient``; the property tests give
    their own, over the orchestrator's core in simulated time)."""

    job_id: str
    group_id: str
    acquire_timeout_s: float

    @property
    def holding(self) -> bool: ...
    @property
    def epoch(self) -> int | None: ...
    async def acquire(self, timeout: float | None = None) -> Grant: ...
    async def _acquire(self, timeout: float | None) -> Grant: ...
    async def release(self) -> ReleaseResult: ...
    async def connect(self) -> Any: ...
    async def close(self) -> None: ...
    async def _on_reconnected(self) -> None: ...
    def _settle_budget(self) -> float: ...


M = TypeVar("M", bound=Member)


def take_order(groups: Iterable[str]) -> tuple[str, ...]:
    """The groups of one call in the order they are taken: validated, each once, sorted; at least one, at most
    ``MAX_GROUPS``."""
    if isinstance(groups, str):
        raise InvalidRequest(f"give the groups as a list of ids, not the string {groups!r}")
    order = tuple(sorted({validate_id("group", g) for g in groups}))
    if not 1 <= len(order) <= MAX_GROUPS:
        raise InvalidRequest(f"one call takes 1 to {MAX_GROUPS} groups, not {len(order)}")
    return order


def sibling(owner: AsyncTimeSliceClient, group: str) -> AsyncTimeSliceClient:
    """A client of ``owner``'s job for ``group``: the same options, ``owner``'s connection (connected), its
    ``JobGroups``. It does not bind the process to the node's agent: the process's context is the owner group's."""
    sib = type(owner)(
        owner.job_id,
        group,
        owner.nats_url,
        owner.lease_ms / 1000,
        acquire_timeout_s=owner.acquire_timeout_s,
        request_timeout_s=owner.request_timeout_s,
        waiter_ttl_s=owner.waiter_ttl_ms / 1000,
        confirm_s=owner.confirm_ms / 1000,
        connect_timeout_s=owner.connect_timeout_s,
        fast_reacquire=owner.fast_reacquire,
        nc=owner._nc,
        bind_process=False,
        node_id=owner.node_id,
        priority=owner.priority,
    )
    sib._groups = owner._groups
    return sib


class JobGroups(Generic[M]):
    """The members of one job's client (its own group's client and the siblings), and the order rule (module doc).
    ``make`` makes the member of another group (``sibling``)."""

    def __init__(self, owner: M, make: Callable[[str], M]) -> None:
        self.owner = owner
        self._make = make
        self.members: dict[str, M] = {owner.group_id: owner}
        self._turn = asyncio.Lock()  # one acquire of the job's at a time
        self._turn_task: asyncio.Task[Any] | None = None  # the task whose acquire_all has the turn
        self._making = asyncio.Lock()  # siblings are made (and connected) one at a time
        self.closed = False

    def held(self) -> tuple[str, ...]:
        """The groups the job holds through this client, sorted."""
        return tuple(sorted(g for g, m in list(self.members.items()) if m.holding))  # a copy: read from any thread

    def settle_budget(self) -> float:
        """What resuming early-suspended workloads may add to an acquire of every member (s)."""
        return sum(m._settle_budget() for m in list(self.members.values()))

    async def member(self, group: str) -> M:
        """The member for ``group``, made and connected the first time (at most ``MAX_GROUPS`` in all)."""
        group = validate_id("group", group)
        if (m := self.members.get(group)) is not None:
            return m
        async with self._making:
            if (m := self.members.get(group)) is not None:
                return m
            if self.closed:
                raise TimeSliceError("this client is closed; make a new one")
            if len(self.members) >= MAX_GROUPS:
                raise InvalidRequest(
                    f"a client takes at most {MAX_GROUPS} groups; it has {sorted(self.members)}",
                    group_id=group,
                    job_id=self.owner.job_id,
                )
            await self.owner.connect()  # the siblings share its connection
            m = self._make(group)
            try:
                await m.connect()
            except BaseException:
                with contextlib.suppress(Exception):
                    await m.close()
                raise
            self.members[group] = m
            return m

    def check_order(self, group: str) -> None:
        """Raise ``LockOrderError`` if the job holds a group that sorts after ``group`` (which it does not hold)."""
        above = tuple(g for g in self.held() if g > group)
        if above:
            raise LockOrderError(self.owner.job_id, group, above)

    async def _take_turn(self, deadline: float, group: str, timeout: float) -> None:
        try:
            async with asyncio.timeout_at(deadline):
                await self._turn.acquire()
        except TimeoutError:
            raise AcquireTimeout(group, self.owner.job_id, timeout) from None

    async def acquire(self, m: M, timeout: float | None) -> Grant:
        """``m._acquire(timeout)`` (the grant, for ``m.acquire()``): in its turn, and refused if it would break the
        order. Within ``acquire_all``'s turn, as it is: that call has the turn, and checked the order."""
        if self._turn_task is not None and self._turn_task is asyncio.current_task():
            return await m._acquire(timeout)
        t = m.acquire_timeout_s if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + t
        waited = self._turn.locked()
        await self._take_turn(deadline, m.group_id, t)
        try:
            if not m.holding:  # a held group is granted again at once: no wait, nothing to order
                self.check_order(m.group_id)
            return await m._acquire(max(0.0, deadline - loop.time()) if waited else timeout)
        finally:
            self._turn.release()

    async def acquire_all(self, groups: Iterable[str], timeout: float | None) -> dict[str, Grant]:
        """Every group of ``groups``, in sorted order, within ``timeout`` for the whole call; see the module doc."""
        order = take_order(groups)
        t = self.owner.acquire_timeout_s if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + t
        job = self.owner.job_id
        try:
            await self._take_turn(deadline, order[0], t)  # another acquire of this job's is running
        except AcquireTimeout as exc:
            raise _failed(job, order, order[0], exc, t, (), (), ()) from exc
        self._turn_task = asyncio.current_task()
        try:
            members: list[M] = []
            for g in order:
                try:
                    members.append(await self.member(g))  # made and connected the first time
                except TimeSliceError as exc:
                    raise _failed(job, order, g, exc, t, (), tuple(h for h in self.held() if h in order), ()) from exc
            kept = tuple(m.group_id for m in members if m.holding)
            need = [m for m in members if m.group_id not in kept]
            if need:
                self.check_order(need[0].group_id)
            grants: dict[str, Grant] = {}
            taken: list[M] = []
            for m in members:
                if m.group_id in kept:  # not asked again: the hold it has
                    assert m.epoch is not None
                    grants[m.group_id] = Grant(m.group_id, m.job_id, m.epoch, 0, False)
                    continue
                try:
                    grants[m.group_id] = await m.acquire(max(0.0, deadline - loop.time()))
                except BaseException as exc:
                    released, unanswered = await _to_the_end(_give_back(taken))
                    raise _failed(job, order, m.group_id, exc, t, released, kept, unanswered) from exc
                taken.append(m)
            return grants
        finally:
            self._turn_task = None
            self._turn.release()

    async def release_all(self) -> dict[str, ReleaseResult]:
        """Release every group held, in reverse order; the results by group, in the order released. A release that
        fails does not stop the others: the first failure is raised after them."""
        out: dict[str, ReleaseResult] = {}
        failed: list[tuple[str, TimeSliceError]] = []
        for g in sorted(self.members, reverse=True):
            m = self.members[g]
            if m.epoch is None:
                continue
            try:
                out[g] = await m.release()
            except TimeSliceError as exc:
                failed.append((g, exc))
        if failed:
            where, error = failed[0]
            error.add_note(
                f"release_all of job {self.owner.job_id!r} failed at group {where!r}"
                f"{f' (and {[f for f, _ in failed[1:]]})' if failed[1:] else ''}; it released {list(out)}"
            )
            raise error
        return out

    async def reconnected(self) -> None:
        """The owner's connection is back: every sibling renews its waits and hold now (notices may be lost)."""
        for m in list(self.members.values()):
            if m is not self.owner:
                await m._on_reconnected()

    async def close(self) -> None:
        """Close the siblings (each releases what it holds and withdraws its waits); the owner closes itself.
        Idempotent (a sibling's own close comes back here)."""
        if self.closed:
            return
        self.closed = True
        for m in list(self.members.values()):
            if m is not self.owner:
                try:
                    await m.close()
                except Exception:
                    log.warning(
                        "closing the client of group %s failed",
                        m.group_id,
                        exc_info=True,
                        extra={"group": m.group_id, "job": m.job_id},
                    )


async def _to_the_end(cleanup: Coroutine[Any, Any, T]) -> T:
    """Run ``cleanup`` to its end even when this task is cancelled meanwhile (the cancellation that stopped a call
    may come again, e.g. a second Ctrl-C or an outer timeout): it is bounded (each release by the client's request
    timeout), and a cancellation that came during it is raised once it is over."""
    work = asyncio.ensure_future(cleanup)
    cancelled = False
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            cancelled = cancelled or not work.done()
    if cancelled:
        raise asyncio.CancelledError("cancelled while a failed acquire_all gave back what it took (it did)")
    return work.result()


async def _give_back(taken: list[M]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Release ``taken`` in reverse order: the groups given back, and those whose release got no answer."""
    released: list[str] = []
    unanswered: list[str] = []
    for m in reversed(taken):
        released.append(m.group_id)
        try:
            await m.release()
        except TimeSliceError as exc:  # lost already (LockLost), or no answer (Unavailable): no longer held here
            log.warning(
                "release of group %s after a failed acquire_all: %s",
                m.group_id,
                exc,
                extra={"group": m.group_id, "job": m.job_id},
            )
            if not isinstance(exc, LockLost):
                unanswered.append(m.group_id)
    return tuple(released), tuple(unanswered)


def _failed(
    job: str,
    order: tuple[str, ...],
    group: str,
    exc: BaseException,
    timeout: float,
    released: tuple[str, ...],
    kept: tuple[str, ...],
    unanswered: tuple[str, ...],
) -> BaseException:
    """The error a failed multi-group call raises: a timeout is ``AcquireAllTimeout``, another error of the package's
    ``AcquireAllFailed``; anything else (cancellation, Ctrl-C, a bug) goes on as it is, with a note."""
    if isinstance(exc, LockOrderError):  # the rule said no (before anything was asked of that group)
        if released:
            exc.add_note(f"acquire_all({list(order)}) released what it had taken: {list(released)}")
        return exc
    if isinstance(exc, AcquireTimeout):
        return AcquireAllTimeout(
            job,
            order,
            group,
            exc,
            timeout_s=timeout,
            holder=exc.holder,
            released=released,
            kept=kept,
            unanswered=unanswered,
        )
    if isinstance(exc, TimeSliceError):
        return AcquireAllFailed(job, order, group, exc, released=released, kept=kept, unanswered=unanswered)
    exc.add_note(
        f"acquire_all({list(order)}) of job {job!r} was stopped at group {group!r}; it released {list(released)}"
    )
    return exc


class MultiGroupCalls:
    """The calls of ``AsyncTimeSliceClient`` that take several groups of its job at once (a base class, so that the
    client's module stays the single group's)."""

    _groups: JobGroups[AsyncTimeSliceClient]

    async def acquire_all(self, groups: Iterable[str], timeout: float | None = None) -> dict[str, Grant]:
        """Take every group of ``groups`` (this client's own and any other of its job's) in sorted order, within
        ``timeout`` (default ``acquire_timeout_s``) for the whole call: the grants by group, in that order. A group this
        job holds already is kept (its grant as it is). Raises LockOrderError (before asking anything) when the job
        holds a group that sorts after one it would wait for; on any other failure (timeout, cancel, refusal,
        fault) releases what the call took and withdraws its wait before raising AcquireAllFailed (a timeout:
        AcquireAllTimeout, also an AcquireTimeout), which says at which group and what was released. See
        docs/multi-pool.md."""
        return await self._groups.acquire_all(groups, timeout)

    async def release_all(self) -> dict[str, ReleaseResult]:
        """Release every group this client holds (its own and the others'), in reverse order: the results by group,
        in the order released (empty: it held none). A release that fails (NotHolder, LeaseExpired, Unavailable)
        does not stop the others; the first such error is raised after them."""
        return await self._groups.release_all()

    @property
    def held_groups(self) -> tuple[str, ...]:
        """The groups this job holds through this client (its own and those of ``acquire_all``), sorted."""
        return self._groups.held()


# --------------------------------------------------------------------------- scopes


class AsyncMultiHold:
    """``async with client.on_accelerators(groups=[...]) as grants:``: each group's own scope (``AsyncHold``) entered
    in sorted order and left in reverse, so scopes nest per group as a single group's do (a group held on entry is
    kept, and left held); the timeout bounds the whole entry."""

    def __init__(self, groups: JobGroups[AsyncTimeSliceClient], names: Iterable[str], timeout: float | None) -> None:
        self._groups = groups
        self._order = take_order(names)
        self._timeout = timeout
        self._entered: list[AsyncHold] = []

    async def __aenter__(self) -> dict[str, Grant]:
        t = self._groups.owner.acquire_timeout_s if self._timeout is None else self._timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + t
        grants: dict[str, Grant] = {}
        entered: list[AsyncHold] = []
        kept = tuple(g for g in self._order if g in self._groups.held())
        for g in self._order:
            try:
                hold = AsyncHold(await self._groups.member(g), max(0.0, deadline - loop.time()))
                grants[g] = await hold.__aenter__()
            except BaseException as exc:
                released = await _to_the_end(_leave(entered, exc))
                raise _failed(self._groups.owner.job_id, self._order, g, exc, t, released, kept, ()) from exc
            entered.append(hold)
        self._entered = entered
        return grants

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        entered, self._entered = self._entered, []
        first: BaseException | None = None
        for hold in reversed(entered):
            try:
                await hold.__aexit__(exc_type, exc, tb)
            except TimeSliceError as e:  # a release that failed: the others are released all the same
                first = first or e
        if first is not None:
            raise first

    def __call__(self, fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        return run_within_async(lambda: AsyncMultiHold(self._groups, self._order, self._timeout), fn)


async def _leave(entered: list[AsyncHold], exc: BaseException) -> tuple[str, ...]:
    """Leave ``entered`` in reverse after ``exc``: the groups whose scope released them."""
    released: list[str] = []
    for hold in reversed(entered):
        c = hold._client
        if c._scopes.depth == 1 and c._scopes.owns:
            released.append(c.group_id)
        await hold.__aexit__(type(exc), exc, exc.__traceback__)
    return tuple(released)


class _Runner(Protocol):
    """The blocking client, as its members need it."""

    @property
    def job_id(self) -> str: ...
    def _run(self, coro: Any, timeout: float) -> Any: ...
    def _margin(self, t: float) -> float: ...


class _SyncSibling:
    """A sibling client as ``SyncHold`` sees it: its calls run on the blocking client's loop."""

    def __init__(self, runner: _Runner, member: AsyncTimeSliceClient) -> None:
        self._runner = runner
        self._member = member

    job_id = Forwarded[str]("_member")
    group_id = Forwarded[str]("_member")
    holding = Forwarded[bool]("_member")

    def acquire(self, timeout: float | None = None) -> Grant:
        m = self._member
        t = m.acquire_timeout_s if timeout is None else timeout
        grant: Grant = self._runner._run(m.acquire(timeout), self._runner._margin(t) + m._settle_budget())
        return grant

    def release(self) -> ReleaseResult:
        result: ReleaseResult = self._runner._run(
            self._member.release(), self._runner._margin(self._member.request_timeout_s)
        )
        return result


class SyncGroups:
    """The blocking client's per-group scopes: its own (``owner``, ``scopes``) and one per sibling, made lazily."""

    def __init__(
        self,
        runner: _Runner,
        owner: _SyncClient,
        scopes: SyncScopes,
        groups: JobGroups[AsyncTimeSliceClient],
        acquire_timeout_s: float,
    ) -> None:
        self.runner = runner
        self.acquire_timeout_s = acquire_timeout_s
        self._groups = groups
        self._scopes: dict[str, tuple[_SyncClient, SyncScopes]] = {owner.group_id: (owner, scopes)}
        self._lock = threading.Lock()

    def scope(self, group: str, timeout: float) -> tuple[_SyncClient, SyncScopes]:
        with self._lock:
            got = self._scopes.get(group)
        if got is not None:
            return got
        member: AsyncTimeSliceClient = self.runner._run(self._groups.member(group), self.runner._margin(timeout))
        with self._lock:
            return self._scopes.setdefault(
                group, (_SyncSibling(self.runner, member), SyncScopes(self.acquire_timeout_s))
            )


class SyncMultiHold:
    """``AsyncMultiHold`` for ``TimeSliceClient``: ``with client.on_accelerators(groups=[...]) as grants:``."""

    def __init__(self, groups: SyncGroups, names: Iterable[str], timeout: float | None) -> None:
        self._groups = groups
        self._order = take_order(names)
        self._timeout = timeout
        self._entered: list[tuple[SyncHold, SyncScopes, str]] = []

    def __enter__(self) -> dict[str, Grant]:
        t = self._groups.acquire_timeout_s if self._timeout is None else self._timeout
        deadline = time.monotonic() + t
        grants: dict[str, Grant] = {}
        entered: list[tuple[SyncHold, SyncScopes, str]] = []
        kept = tuple(g for g in self._order if g in self._groups._groups.held())
        for g in self._order:
            try:
                client, scopes = self._groups.scope(g, t)
                hold = SyncHold(client, max(0.0, deadline - time.monotonic()), scopes)
                grants[g] = hold.__enter__()
            except BaseException as exc:
                released = _leave_sync(entered, exc)
                raise _failed(self._groups.runner.job_id, self._order, g, exc, t, released, kept, ()) from exc
            entered.append((hold, scopes, g))
        self._entered = entered
        return grants

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        entered, self._entered = self._entered, []
        first: BaseException | None = None
        for hold, _, _ in reversed(entered):
            try:
                hold.__exit__(exc_type, exc, tb)
            except TimeSliceError as e:
                first = first or e
        if first is not None:
            raise first

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        return run_within(lambda: SyncMultiHold(self._groups, self._order, self._timeout), fn)


def _leave_sync(entered: list[tuple[SyncHold, SyncScopes, str]], exc: BaseException) -> tuple[str, ...]:
    released: list[str] = []
    for hold, scopes, g in reversed(entered):
        if scopes.depth == 1 and scopes.owns:
            released.append(g)
        hold.__exit__(type(exc), exc, exc.__traceback__)
    return tuple(released)
