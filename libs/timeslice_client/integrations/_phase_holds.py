"""A job's loop as phases on named pools: what the slime and veRL integrations share.

A phase (``generate``, ``train``, ``weight_sync``, ...) needs some of the job's groups (its pools of accelerators):
:meth:`PhaseHolds.begin` takes those the job does not hold yet, :meth:`PhaseHolds.end` gives back every group that
no phase still open needs. Phases may overlap (slime's asynchronous driver starts the next generation while it
trains), so a group is held while any open phase needs it, and only then. A phase may end with ``keep``: its
groups stay held into the next phase that needs them (and are given back when one begins that does not), so that a
job's turn on a pool can span several phases (one pool: a whole step) instead of changing hands at every phase.

Taking several groups keeps the client's one global order (docs/multi-pool.md: a job waits for a group only while
every group it holds sorts before it). When a phase needs a group that sorts *before* one the job holds for another
open phase (slime's asynchronous driver with the usual names: ``trainers`` held for training, ``samplers`` asked
for the next generation), the groups above it are given back first and everything is taken again in order
(counted as ``reorders``). The framework's drivers open phases before they start the work (the begin callback
comes first), so what is given back is not in use yet; name the pools so that the one held first sorts first
(e.g. ``a-trainer``, ``b-sampler``) and it never happens.

Each group is held through a scope of its own (``client.on_accelerators(groups=[g])``), so that one group can be
given back while another stays held; a group the job already held outside these phases (a scope of its own, a
plain ``acquire()``) is borrowed and left held.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from .._grants import Grant
from .._sync_client import TimeSliceClient
from ..errors import InvalidRequest, TimeSliceError

__all__ = ["PhaseAdapter", "PhaseCounts", "PhaseHolds"]


class _Scope(Protocol):
    def __enter__(self) -> dict[str, Grant]: ...
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class PhaseCounts:
    """What the holds did so far: ``phases`` begun; ``acquires`` and ``releases`` (one per group); ``waited_ms``, the
    acquires' total wait (the orchestrator's figure); ``reorders``, groups given back to take a lower one in order;
    ``held_s``, the time each group was held, in all."""

    phases: int = 0
    acquires: int = 0
    releases: int = 0
    waited_ms: float = 0.0
    reorders: int = 0
    held_s: tuple[tuple[str, float], ...] = ()


class PhaseHolds:
    """The groups of a job's open phases, held through ``client`` (a :class:`TimeSliceClient`: the frameworks'
    drivers are blocking). ``acquire_timeout_s``: the bound of each phase's taking (default: the client's). Meant for
    one driver thread; calls from several are taken one at a time."""

    def __init__(self, client: TimeSliceClient, *, acquire_timeout_s: float | None = None) -> None:
        if not isinstance(client, TimeSliceClient):
            raise InvalidRequest(
                f"phase holds need a TimeSliceClient, not {type(client).__name__} (the driver calls them on its "
                "own thread, without an event loop)"
            )
        self.client = client
        self.acquire_timeout_s = acquire_timeout_s
        self._open: list[tuple[str, frozenset[str]]] = []  # the open phases, in the order they began
        self._scopes: dict[str, _Scope] = {}  # one per group held through these phases
        self._since: dict[str, float] = {}  # when each was taken (monotonic)
        self._lock = threading.Lock()  # one phase call at a time (held while a phase waits for its groups)
        self._figures = threading.Lock()  # the figures below: read without waiting for a phase's acquire
        self._counts = PhaseCounts()
        self._held_s: dict[str, float] = {}

    # ------------------------------------------------------------------ reading

    @property
    def counts(self) -> PhaseCounts:
        with self._figures:
            return self._snapshot()

    @property
    def held(self) -> tuple[str, ...]:
        """The groups held through these phases, sorted."""
        return tuple(sorted(self._scopes))

    @property
    def open_phases(self) -> tuple[str, ...]:
        """The phases begun and not ended, in the order they began."""
        return tuple(name for name, _ in list(self._open))

    # ------------------------------------------------------------------ phases

    def begin(self, phase: str, groups: Iterable[str]) -> None:
        """Open ``phase``, which needs ``groups``: take those not held yet (in order; see the module doc). On a
        failure what this call took is given back and the phase is not opened; the error says why (a timeout is an
        ``AcquireTimeout``)."""
        need = frozenset(() if isinstance(groups, str) else groups)
        if not need:
            raise InvalidRequest(
                f"phase {phase!r} names no groups (a list of group ids, not {groups!r})", job_id=self.client.job_id
            )
        with self._lock:
            self._give_back(g for g in self._unused() if g not in need)  # kept by a phase that ended with keep
            missing = set(need - self._scopes.keys())
            if missing:
                above = sorted(g for g in self._scopes if g > min(missing))
                for g in reversed(above):  # the order: the job may wait only holding groups that sort before
                    self._drop(g)
                self._add(reorders=len(above))
                missing.update(above)
                try:
                    self._take(sorted(missing))
                except TimeSliceError as exc:
                    if above:
                        exc.add_note(
                            f"phase {phase!r} gave back {above} to take {sorted(missing)} in order; they "
                            f"are not held now, though open phases {self.open_phases} need them"
                        )
                    raise
            self._open.append((phase, need))
            self._add(phases=1)

    def end(self, phase: str, *, keep: bool = False) -> tuple[str, ...]:
        """Close the latest open ``phase`` and give back the groups no open phase needs: those released, in the
        order released. ``keep``: give back nothing now; what no open phase needs stays held until a phase begins
        that does not need it, a phase ends without ``keep``, or :meth:`close` (a turn longer than one phase). A
        release that fails (the lease was lost) does not stop the others; its error is raised after them."""
        with self._lock:
            for i in range(len(self._open) - 1, -1, -1):
                if self._open[i][0] == phase:
                    del self._open[i]
                    break
            else:
                raise InvalidRequest(
                    f"phase {phase!r} ended but was not begun (open: {list(self.open_phases) or 'none'}): call "
                    "begin (on_phase_begin) before the phase's work and end after it",
                    job_id=self.client.job_id,
                )
            if keep:
                return ()
            return self._give_back(self._unused())

    @contextlib.contextmanager
    def phase(self, name: str, groups: Iterable[str], *, keep: bool = False) -> Iterator[None]:
        """``begin`` on entry, ``end`` on exit (also when the block raises; ``keep`` as ``end``'s, but not then)."""
        self.begin(name, groups)
        ok = False
        try:
            yield
            ok = True
        finally:
            self.end(name, keep=keep and ok)

    def end_turn(self) -> tuple[str, ...]:
        """Give back the groups kept (``end(..., keep=True)``) that no open phase needs: those released."""
        with self._lock:
            return self._give_back(self._unused())

    def close(self) -> tuple[str, ...]:
        """End every open phase and give back every group held through them (idempotent)."""
        with self._lock:
            self._open.clear()
            return self._give_back(list(self._scopes))

    # ------------------------------------------------------------------ plumbing (under _lock)

    def _take(self, order: list[str]) -> None:
        """Each group of ``order`` (sorted) through a scope of its own; ``acquire_timeout_s`` bounds them all (None:
        each waits at most the client's ``acquire_timeout_s``)."""
        deadline = None if self.acquire_timeout_s is None else time.monotonic() + self.acquire_timeout_s
        taken: list[str] = []
        try:
            for g in order:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                scope = self.client.on_accelerators(left, groups=[g])
                grant = scope.__enter__()[g]
                self._scopes[g] = scope
                with self._figures:
                    self._since[g] = time.monotonic()
                taken.append(g)
                self._add(acquires=1, waited_ms=grant.waited_ms)
        except BaseException:
            with contextlib.suppress(TimeSliceError):
                self._give_back(reversed(taken))
            raise

    def _unused(self) -> list[str]:
        """The groups held that no open phase needs."""
        in_use = frozenset().union(*(g for _, g in self._open))
        return [g for g in self._scopes if g not in in_use]

    def _drop(self, group: str) -> None:
        scope = self._scopes.pop(group)
        with self._figures:
            self._held_s[group] = self._held_s.get(group, 0.0) + time.monotonic() - self._since.pop(group)
        self._add(releases=1)
        scope.__exit__(None, None, None)

    def _give_back(self, groups: Iterable[str]) -> tuple[str, ...]:
        released: list[str] = []
        first: TimeSliceError | None = None
        for g in sorted(groups, reverse=True):
            try:
                self._drop(g)
            except TimeSliceError as exc:
                first = first or exc
            released.append(g)
        if first is not None:
            first.add_note(f"giving back {released} of job {self.client.job_id!r}: the first failure")
            raise first
        return tuple(released)

    def _add(
        self, *, phases: int = 0, acquires: int = 0, releases: int = 0, waited_ms: float = 0.0, reorders: int = 0
    ) -> None:
        with self._figures:
            c = self._counts
            self._counts = PhaseCounts(
                c.phases + phases,
                c.acquires + acquires,
                c.releases + releases,
                c.waited_ms + waited_ms,
                c.reorders + reorders,
            )

    def _snapshot(self) -> PhaseCounts:  # under _figures
        now = time.monotonic()
        held = dict(self._held_s)
        for g, since in self._since.items():
            held[g] = held.get(g, 0.0) + now - since
        c = self._counts
        return PhaseCounts(c.phases, c.acquires, c.releases, c.waited_ms, c.reorders, tuple(sorted(held.items())))


class PhaseAdapter:
    """The base of a framework's adapter (slime's ``TimeSliceCallback``, veRL's ``VerlHolds``): its phases' holds
    (``holds``) through ``client``, the figures they report, and the lookup of a phase's groups by the name the
    framework gives it."""

    client: TimeSliceClient
    holds: PhaseHolds

    @property
    def counts(self) -> PhaseCounts:
        """What the holds did so far (:class:`PhaseCounts`)."""
        return self.holds.counts

    def _lookup(self, table: Mapping[str, tuple[str, ...]], name: str, unknown: str) -> tuple[str, ...]:
        """``table[name]``; a name missing from it (one of a newer framework's, or a typo) is an ``InvalidRequest``
        that says ``unknown``."""
        try:
            return table[name]
        except KeyError:
            raise InvalidRequest(unknown, job_id=self.client.job_id) from None
