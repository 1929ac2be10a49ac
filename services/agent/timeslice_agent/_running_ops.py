"""The operations an agent is running, so that a restore sent together with the snapshots of its switch
(``Restore.after``) starts only once those snapshots on this node are answered."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterable
from typing import Final

__all__ = ["RunningOps"]

MAX_SEEN: Final = 4096  # op ids remembered as begun by this agent (a restore follows at most 64)


class RunningOps:
    """Operation ids being run here, each with an event set once its result is decided."""

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Event] = {}
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()  # begun here, newest last

    def start(self, op_id: str) -> bool:
        """Register ``op_id`` as running; False when it runs already (a redelivered command)."""
        if op_id in self._running:
            return False
        self._running[op_id] = asyncio.Event()
        self._seen[op_id] = None
        self._seen.move_to_end(op_id)
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
        return True

    def seen(self, op_id: str) -> bool:
        """Whether ``op_id`` began on this agent since it started (running, or ended)."""
        return op_id in self._seen

    def answered(self, op_id: str) -> None:
        """Its result is decided: the operations that follow it may start."""
        if (done := self._running.get(op_id)) is not None:
            done.set()

    def finish(self, op_id: str) -> None:
        """It ended (answered or not): wake what follows it and forget it."""
        done = self._running.pop(op_id, None)
        if done is not None:
            done.set()

    def any_running(self, op_ids: Iterable[str]) -> bool:
        """Whether any of ``op_ids`` runs here and has no result yet."""
        return any((done := self._running.get(op_id)) is not None and not done.is_set() for op_id in op_ids)

    async def wait(self, after: Iterable[str], deadline_s: float) -> str | None:
        """Wait until every operation in ``after`` is answered; an error when ``deadline_s`` (epoch seconds)
        passes first. An operation not running here (answered long ago, or sent before a restart) is not
        waited for."""
        for op_id in after:
            done = self._running.get(op_id)
            if done is None:
                continue
            try:
                async with asyncio.timeout(max(0.0, deadline_s - time.time())):
                    await done.wait()
            except TimeoutError:
                return f"deadline passed while {op_id} was still running"
        return None
