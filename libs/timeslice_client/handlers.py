"""What a workload does when its node's agent suspends or resumes it.

A handler is any object with ``suspend(mode, tags)`` and ``resume(mode, tags)`` returning a
:class:`HandlerResult`. They are plain (blocking) methods: the workload channel runs them on a thread
of its own, one call at a time, so the job's event loop and threads go on while tensors move.

Contract: ``suspend`` either completes or raises with the state left as it was (roll back what it
already moved), so a failed snapshot leaves the job RUNNING. ``resume`` after ``suspend`` restores
exactly what was there. ``tags`` select parts of the state (e.g. ``weights``, ``kv_cache``,
``optimizer``); an empty set means everything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .protocol import SuspendMode

__all__ = ["CallbackHandler", "HandlerResult", "WorkloadHandler"]


@dataclass(frozen=True, slots=True)
class HandlerResult:
    bytes_moved: int = 0  # bytes copied between device and host by this call
    device_bytes_freed: int = 0  # device bytes released (suspend) or taken again (resume)


@runtime_checkable
class WorkloadHandler(Protocol):
    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult: ...

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult: ...


Callback = Callable[[SuspendMode, frozenset[str]], HandlerResult | None]


class CallbackHandler:
    """Two plain callbacks as a handler; a callback that returns None reports no bytes."""

    def __init__(self, suspend: Callback, resume: Callback) -> None:
        self._suspend = suspend
        self._resume = resume

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return self._suspend(mode, tags) or HandlerResult()

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return self._resume(mode, tags) or HandlerResult()
