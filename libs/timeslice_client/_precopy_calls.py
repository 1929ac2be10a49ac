"""The pre-copy of a ``WorkloadChannel`` (a base class of it): after a release that nobody waited for, whose state
stays on the device, copy the state to host memory while the job is idle, so that the next switch's suspend only
frees the device memory; the job's next grant makes that copy worthless (issue 27, "Pre-copy while idle";
docs/backends.md, "Pre-copy")."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ._channel_thread import Responder
from ._codes import SuspendMode
from ._workload_options import Precopy
from .handlers import HandlerResult, WorkloadHandler

__all__ = ["PrecopyCalls"]

log = logging.getLogger("timeslice.workload")


class PrecopyCalls:
    """``precopy_idle()`` and ``cancel_precopy()``, and what they need of the channel (declared here, set by
    ``WorkloadChannel``)."""

    job_id: str
    group_id: str
    handler: WorkloadHandler
    mode: SuspendMode
    tags: tuple[str, ...]
    backends: tuple[str, ...]
    precopy: Precopy
    suspended: bool
    switched_out: int
    precopies: int
    _gate: threading.Lock
    _closed: bool
    _busy: bool
    _responder: Responder | None
    _early: concurrent.futures.Future[Any] | None
    _precopy_stop: threading.Event | None
    _precopying: concurrent.futures.Future[None] | None

    def precopy_idle(self) -> bool:
        """The job released the group, nobody waited and its state stays on the device (the orchestrator deferred
        the snapshot). When a switch is expected (``precopy``: ``"always"``, or ``"auto"``: this channel has been
        switched out before, so another job shares the group), copy the state to host memory now, on the channel's
        thread, keeping it on the device (the handler's ``precopy(tags, cancelled)``; ``TorchOffloadHandler`` has
        it): the suspend of the next switch then only frees the device memory. The client calls this after such a
        release; its next grant (``cancel_precopy``) makes the copy worthless, at no cost to that acquire. Returns
        whether it began (not for a handler without ``precopy``, nor in ``discard`` mode, without ``app_channel``,
        not started, closed, suspended or busy)."""
        copy = getattr(self.handler, "precopy", None)
        wanted = self.precopy == "always" or (self.precopy == "auto" and self.switched_out > 0)
        if not wanted or copy is None or self.mode != SuspendMode.OFFLOAD or "app_channel" not in self.backends:
            return False
        with self._gate:
            if self._closed or self._responder is None or self._early is not None or self.suspended or self._busy:
                return False
            if self._precopying is not None and not self._precopying.done():
                return False  # the last one still runs (cancelled by a grant since, or not)
            stop = self._precopy_stop = threading.Event()
            self._precopying = self._responder.submit(self._run_precopy(copy, stop))
        return True

    def cancel_precopy(self) -> None:
        """The job holds the group again and may change its state: a copy made while it was idle no longer stands
        for it (any thread; never waits: a copy still running stops at its next chunk)."""
        with self._gate:
            stop, self._precopy_stop = self._precopy_stop, None
        if stop is not None:
            stop.set()

    async def _end_precopy(self, timeout_s: float) -> None:
        """Cancel a pre-copy and wait (on the caller's loop, at most ``timeout_s``) for it to stop: at close."""
        self.cancel_precopy()
        future = self._precopying
        if future is not None and not future.done():
            with contextlib.suppress(TimeoutError, concurrent.futures.CancelledError):
                async with asyncio.timeout(timeout_s):
                    await asyncio.wrap_future(future)

    async def _run_precopy(
        self, copy: Callable[[frozenset[str], threading.Event], HandlerResult], stop: threading.Event
    ) -> None:
        t0 = time.perf_counter()
        try:
            result = copy(frozenset(self.tags), stop)
        except Exception as exc:  # nothing depends on it: the next suspend copies as usual
            log.warning("precopy failed: %r", exc, extra={"job": self.job_id, "group": self.group_id})
            return
        if not stop.is_set():
            self.precopies += 1
            log.debug(
                "precopied %d bytes in %.1f ms",
                getattr(result, "bytes_moved", 0),
                (time.perf_counter() - t0) * 1000,
                extra={"job": self.job_id, "group": self.group_id},
            )
