"""A thread with an event loop of its own: a workload channel answers its node's agent there. (The blocking
``TimeSliceClient`` ran its asyncio client on one too, until each call ran the loop on its caller's thread:
``_shared_loop``.)

The channel's commands arrive on this thread's own NATS connection and its handler runs right here, so a
reply leaves as soon as the handler returns: no hand-off to a worker thread and back to the job's loop, each
of which waits for an idle CPU to wake (about 0.3 ms apiece on the dev VM, bench/NOTES.md). The loop is
uvloop's when it is installed (the ``fast`` extra): measured, a plain asyncio loop here lost what the thread
saved.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ._serving_thread import ServingThread

__all__ = ["Responder"]

log = logging.getLogger("timeslice.workload")

T = TypeVar("T")


def _new_loop(fast: bool) -> asyncio.AbstractEventLoop:
    if not fast:
        return asyncio.new_event_loop()
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class Responder(ServingThread):
    """One thread running one event loop until :meth:`stop` (or :meth:`stop_blocking`). Coroutines are handed
    to it with :meth:`call` (from another loop) or :meth:`submit` (from any thread). ``fast``: uvloop's loop
    when it is installed, else asyncio's own. :meth:`start` it (``ServingThread.start``: until its loop runs)."""

    kind = "responder"

    def __init__(self, name: str, *, start_timeout: float = 5.0, fast: bool = True) -> None:
        self.name = name
        self.start_timeout = start_timeout
        self.fast = fast
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def running(self) -> bool:
        return self._loop is not None and not self._stopped

    def _serve(self, ready: threading.Event) -> None:
        loop = _new_loop(self.fast)
        asyncio.set_event_loop(loop)
        self._loop = loop
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on this thread's loop; its outcome lands in the returned future."""
        if self._loop is None or self._stopped:
            coro.close()
            raise RuntimeError(f"responder {self.name!r} is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this thread's loop and wait for its outcome. Cancelling the wait does not cancel
        the coroutine: it finishes there (what it changes stays consistent); bound the wait with a timeout."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(coro)))

    async def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop (its tasks are cancelled) and join the thread, waiting at most ``timeout`` s (it ends
        only once a handler call running there returns). Idempotent; returns whether the thread ended."""
        self._request_stop()
        return await asyncio.to_thread(self._join, timeout)

    def stop_blocking(self, timeout: float = 10.0) -> bool:
        """:meth:`stop`, for a caller that runs no event loop."""
        self._request_stop()
        return self._join(timeout)

    def _request_stop(self) -> None:
        loop = self._loop
        if not self._stopped and loop is not None:
            self._stopped = True
            with contextlib.suppress(RuntimeError):  # closed already
                loop.call_soon_threadsafe(loop.stop)

    def _join(self, timeout: float) -> bool:
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        if thread.is_alive():
            log.warning("the thread of %s is still busy %g s after it was asked to stop", self.name, timeout)
            return False
        return True
