"""A workload handler that forwards to another and counts what it did: the figures an integration reports."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..errors import HandlerError
from ..handlers import HandlerResult, WorkloadHandler
from ..protocol import SuspendMode

__all__ = ["CountingHandler", "OffloadCounts"]


@dataclass(frozen=True, slots=True)
class OffloadCounts:
    """What the handler did so far: calls, their total time (ms, the handler's own) and the bytes they moved."""

    suspends: int = 0
    resumes: int = 0
    suspend_ms: float = 0.0
    resume_ms: float = 0.0
    bytes_out: int = 0  # device -> host, over all suspends
    bytes_in: int = 0  # host -> device, over all resumes
    last_suspend_bytes: int = 0  # what the latest suspend moved (the size of one switch's state)


class CountingHandler:
    """Forwards ``suspend``/``resume`` to ``inner`` and counts them. ``inner`` may be replaced (:meth:`replace`) while
    its state is on the device, so a registration outlives the objects it moves (a trainer's second ``train()``)."""

    def __init__(self, inner: WorkloadHandler | None = None) -> None:
        self._inner = inner
        self._suspended = False
        self._counts = OffloadCounts()
        self._lock = threading.Lock()

    @property
    def inner(self) -> WorkloadHandler | None:
        return self._inner

    @property
    def counts(self) -> OffloadCounts:
        with self._lock:
            return self._counts

    def replace(self, inner: WorkloadHandler) -> None:
        """Forward to ``inner`` from now on; refused while the current one's state is suspended (it would be lost)."""
        with self._lock:
            if self._suspended:
                raise HandlerError(
                    "the state is suspended (off the device): replace the handler only while the job "
                    "holds the group and its state is back"
                )
            self._inner = inner

    def _target(self) -> WorkloadHandler:
        if self._inner is None:
            raise HandlerError("nothing to move yet: the integration registers its objects when training begins")
        return self._inner

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        with self._lock:
            result, ms = _timed(self._target().suspend, mode, tags)
            c, moved = self._counts, result.bytes_moved
            self._counts = replace(
                c,
                suspends=c.suspends + 1,
                suspend_ms=c.suspend_ms + ms,
                bytes_out=c.bytes_out + moved,
                last_suspend_bytes=moved,
            )
            self._suspended = True
            return result

    @property
    def precopy(self) -> Callable[[frozenset[str], threading.Event | None], HandlerResult]:
        """The inner handler's pre-copy while idle (``TorchOffloadHandler.precopy``; docs/backends.md, "Pre-copy"),
        holding this handler as a suspend does, so that a suspend or a :meth:`replace` that comes meanwhile waits for
        it. Absent (``AttributeError``, so ``getattr(h, "precopy", None)`` is None) when the inner handler has none:
        the workload channel then makes no copy."""
        copy = getattr(self._inner, "precopy", None)
        if copy is None:
            raise AttributeError(f"{type(self._inner).__name__} has no precopy")

        def counted(tags: frozenset[str], cancelled: threading.Event | None = None) -> HandlerResult:
            with self._lock:
                if self._inner is None or getattr(self._inner, "precopy", None) != copy:
                    return HandlerResult()  # replaced since: the copy would be of objects no longer registered
                result: HandlerResult = copy(tags, cancelled)
                return result

        return counted

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        with self._lock:
            result, ms = _timed(self._target().resume, mode, tags)
            c, moved = self._counts, result.bytes_moved
            self._counts = replace(c, resumes=c.resumes + 1, resume_ms=c.resume_ms + ms, bytes_in=c.bytes_in + moved)
            self._suspended = False
            return result


def _timed(
    call: Callable[[SuspendMode, frozenset[str]], HandlerResult], mode: SuspendMode, tags: frozenset[str]
) -> tuple[HandlerResult, float]:
    """``call(mode, tags)``'s result and the milliseconds it took (a call that raises counts nothing)."""
    t0 = time.perf_counter()
    result = call(mode, tags)
    return result, (time.perf_counter() - t0) * 1000
