"""Who works on which group now, across jobs, for the framework integrations' tests (slime, veRL): a call of a
job's worker must run in that job's hold of the group and never beside another job's call there. Violations are
collected, not raised (raising would stop a worker's thread); ``calls`` counts each job's calls by name, and
``beside_s`` tells how long two jobs worked at once on different groups (what two pools are for)."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .helpers import overlap_s


class PoolWatch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.violations: list[str] = []
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.spans: list[tuple[str, str, float, float]] = []  # (job, group, start, end) of every call, monotonic s

    def watched(
        self, job: str, group_of: Callable[[str], str] | None, holds: Any | None
    ) -> Callable[[str, str], contextlib.AbstractContextManager[None]]:
        """The framework's ``on_work(pool, call)`` hook for ``job``'s workers: each call runs :meth:`inside`, on the
        group ``group_of`` names for its pool (None: the pool's own name, a run without timeslice)."""

        def on_work(pool: str, call: str) -> contextlib.AbstractContextManager[None]:
            return self.inside(job, pool, pool if group_of is None else group_of(pool), call, holds)

        return on_work

    @contextlib.contextmanager
    def inside(self, job: str, pool: str, group: str, call: str, holds: Any | None) -> Iterator[None]:
        """``job``'s ``call`` on ``pool`` (its group ``group``); ``holds``: the integration's phase holds (``held``,
        ``open_phases``), None for a run without timeslice."""
        with self._lock:
            if holds is not None and group not in holds.held:
                self.violations.append(
                    f"{job}: {call} on {pool} ({group}) outside its hold "
                    f"(held: {holds.held}, open: {holds.open_phases})"
                )
            others = sorted(j for j, n in self._inside[group].items() if n and j != job)
            if others:
                self.violations.append(f"{job}: {call} on {group} while {others} worked there")
            self._inside[group][job] += 1
            self.calls[job, call] += 1
        start = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._inside[group][job] -= 1
                self.spans.append((job, group, start, time.monotonic()))

    def beside_s(self) -> float:
        """Seconds during which calls of two jobs ran at once on different groups (summed over pairs of calls)."""
        by: dict[tuple[str, str], list[tuple[float, float]]] = collections.defaultdict(list)
        for job, group, start, end in list(self.spans):
            by[job, group].append((start, end))
        keys = sorted(by)
        return sum(
            overlap_s(by[k1], by[k2])
            for i, k1 in enumerate(keys)
            for k2 in keys[i + 1 :]
            if k1[0] != k2[0] and k1[1] != k2[1]
        )
