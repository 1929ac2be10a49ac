"""One lock per job id, kept only while it is held or awaited: an agent runs for weeks and sees job ids come
and go, so a lock per id ever seen would only grow."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["JobLocks"]


class JobLocks:
    """``async with locks.hold(job):`` serializes what is done to one job; different jobs never wait on each other."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # job -> (its lock, holders and waiters)

    def __len__(self) -> int:
        """Job ids with a lock now: those held or awaited."""
        return len(self._locks)

    def users(self, job: str) -> int:
        """How many hold or await ``job``'s lock (0: it has none)."""
        return self._locks.get(job, (None, 0))[1]

    @contextlib.asynccontextmanager
    async def hold(self, job: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(job, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[job] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[job]
            if users == 1:
                del self._locks[job]
            else:
                self._locks[job] = (lock, users - 1)
