"""Two jobs in the bench's own process handing one group back and forth without pause, and the check of the stream
they leave (``bench/failover.py`` and ``bench/stream_leader.py`` fault the stack under them).

Private to ``bench/``: the scripts import it as ``_handoffs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from typing import Any

from timeslice_client import AsyncTimeSliceClient
from timeslice_client.errors import TimeSliceError
from timeslice_orchestrator.invariants import StreamChecker
from timeslice_orchestrator.replay._read import read_window

__all__ = ["Handoffs", "check_stream", "close_stack"]


class Handoffs:
    """Two jobs handing the group back and forth; ``grants`` holds (acquire sent, granted) monotonic times."""

    def __init__(self, url: str, group: str) -> None:
        self.grants: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self.stop = asyncio.Event()
        self.granted = asyncio.Event()
        # fast_reacquire off: every grant is the orchestrator's decision
        self.clients = [
            AsyncTimeSliceClient(job, group, url, fast_reacquire=False, request_timeout_s=30)
            for job in ("job-a", "job-b")
        ]
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Both jobs begin handing off."""
        self.tasks = [asyncio.create_task(self.job(x)) for x in self.clients]

    def on_grant(self, asked: float, grant: Any) -> None:
        """Keep a grant of an acquire sent at ``asked`` (monotonic)."""
        self.grants.append((asked, time.monotonic()))

    async def job(self, client: AsyncTimeSliceClient) -> None:
        while not self.stop.is_set():
            try:
                asked = time.monotonic()
                self.on_grant(asked, await client.acquire(timeout=60))
                self.granted.set()
                await client.release()
            except TimeSliceError as exc:  # a release whose answer was lost in a failover: the next acquire tells
                self.errors.append(f"{client.job_id}: {exc.__class__.__name__}")
                if len(self.errors) > 1000:
                    raise

    async def next_grant_after(self, t: float, timeout: float = 60.0) -> float:
        """Seconds from ``t`` to the first grant of an acquire sent after ``t`` (so decided after it: a grant decided
        just before a kill and received just after does not count)."""
        deadline = time.monotonic() + timeout
        while True:
            after = [granted for asked, granted in self.grants if asked > t]
            if after:
                return min(after) - t
            if time.monotonic() > deadline:
                raise TimeoutError(f"no grant within {timeout} s of the fault")
            self.granted.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self.granted.wait()

    async def settled(self, n: int = 20, timeout: float = 60.0) -> None:
        """Until ``n`` more grants came (the handoffs run steadily again)."""
        start = len(self.grants)
        deadline = time.monotonic() + timeout
        while len(self.grants) < start + n:
            if time.monotonic() > deadline:
                raise TimeoutError("the handoffs did not resume")
            self.granted.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.granted.wait()

    async def finish(self) -> None:
        """Once the handoffs run steadily again, both jobs stop after their current handoff."""
        await self.settled(20)
        self.stop.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), 60)
        self.tasks = []

    async def close(self) -> None:
        """Both jobs stopped where they are, their clients closed."""
        self.stop.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for x in self.clients:
            with contextlib.suppress(Exception):
                await x.close()

    def figures(
        self, checker: StreamChecker, stream: list[tuple[int, int, str, bytes]], group: str, counted: str
    ) -> dict[str, Any]:
        """The result's handoffs, late release answers, the stream's grant counts (with the ``counted`` field of its
        stats besides) and violations (0 when every grant the fold decided was published as decided)."""
        st = checker.stats[group]
        unpublished = checker.unpublished_grants()
        return {
            "handoffs": len(self.grants),
            "release_errors": len(self.errors),
            "stream": {
                "messages": len(stream),
                "grants": st.grants,
                "fold_grants": st.fold_grants,
                counted: getattr(st, counted),
                "unpublished": len(unpublished),
            },
            "violations": 0 if st.grants == st.fold_grants and not unpublished else 1,
        }


async def close_stack(h: Handoffs, nc: Any, orchestrators: Iterable[Any]) -> None:
    """What the failover benches run on the bus, stopped whatever the run came to: the two jobs, the bench's own
    connection, then the orchestrators (the bus itself is the caller's)."""
    await h.close()
    await nc.close()
    for p in orchestrators:
        p.stop()


async def check_stream(url: str) -> tuple[StreamChecker, list[tuple[int, int, str, bytes]]]:
    """The whole stream, folded through the pure core: raises ``InvariantViolation``, naming the rule, on any
    violation; the checker and the stream's (seq, ts_ms, subject, data) events."""
    checker = StreamChecker()
    stream = [(e.seq, e.ts_ms, e.subject, e.data) for e in await read_window(url, max_events=10**7)]
    checker.feed_all(stream)
    return checker, stream
