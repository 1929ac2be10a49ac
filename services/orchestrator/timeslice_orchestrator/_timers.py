"""Expiries as events: the orchestrator publishes a ``Tick`` into the stream at each group's next deadline, so
that leases, waits and operation deadlines also expire when nothing else happens (private to the shell)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Callable

from nats.js import JetStreamContext
from timeslice_client.protocol import GroupRecord, Tick, encode, subjects

from .core import next_deadline

__all__ = ["Timers"]

log = logging.getLogger("timeslice.orchestrator")


class Timers:
    """One heap of (deadline, group); ``arm`` after every record change, ``run`` publishes the ticks."""

    def __init__(self, retry_ms: int) -> None:
        self.retry_ms = retry_ms  # a tick that changed nothing is looked at again this much later
        self._heap: list[tuple[int, str]] = []
        self._armed: dict[str, int] = {}  # the earliest deadline each group has in the heap
        self._wake = asyncio.Event()

    def arm(self, group: str, rec: GroupRecord) -> None:
        dl = next_deadline(rec)
        armed = self._armed.get(group)
        if dl is None or (armed is not None and armed <= dl):
            return  # an earlier timer will look at this group again
        self._armed[group] = dl
        if not self._heap or dl < self._heap[0][0]:
            self._wake.set()
        heapq.heappush(self._heap, (dl, group))

    def wake(self) -> None:
        self._wake.set()

    async def run(self, js: JetStreamContext, record: Callable[[str], GroupRecord], halt: asyncio.Event) -> None:
        """Until ``halt``: publish a tick for each group whose deadline came (``record``: its current record)."""
        while not halt.is_set():
            now_ms = int(time.time() * 1000)
            due: set[str] = set()
            while self._heap and self._heap[0][0] <= now_ms:
                t, g = heapq.heappop(self._heap)
                if self._armed.get(g) == t:
                    del self._armed[g]
                    due.add(g)
            for g in due:
                dl = next_deadline(record(g))
                if dl is not None and dl <= now_ms:
                    try:
                        await js.publish(subjects.ctl(g, "tick"), encode(Tick(group=g)), timeout=2)
                    except Exception as exc:
                        log.warning("tick for group %s not published: %r", g, exc, extra={"group": g})
                    dl = now_ms + self.retry_ms
                armed = self._armed.get(g)
                if dl is not None and (armed is None or dl < armed):
                    self._armed[g] = dl
                    heapq.heappush(self._heap, (dl, g))
            self._wake.clear()
            delay = (self._heap[0][0] - now_ms) / 1000 if self._heap else 3600.0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(delay, 0.001)):
                    await self._wake.wait()
