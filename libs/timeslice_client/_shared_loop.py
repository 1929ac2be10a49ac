"""An asyncio loop that a blocking call runs on its own thread, and a thread of its own runs between calls.

``TimeSliceClient`` (``_sync_client``) runs its ``AsyncTimeSliceClient`` here. A blocking call used to hand its
coroutine to a loop thread and sleep on a future: two thread wake-ups per call (the loop thread to start it, the
caller when it ends), 0.08-0.13 ms each on the idle dev VM and up to 0.5 ms on its busy cores (``bench/_sync_hops.py``,
``bench/NOTES.md``, "The blocking client on the caller's thread"). Here the calling
thread runs the loop itself for the length of the call, so the grant that ends an ``acquire()`` is read by the
thread that waits for it, and a ``release()`` leaves at once.

Between calls (the job trains), the loop's thread serves the client: its keeper's renewals, notices, the
connection's pings and reconnects. It waits, outside :attr:`SharedLoop._mutex`, on an epoll of its own that holds the
loop's selector (an epoll fd, readable when it has events) and a wake-up pipe, and runs the loop's callbacks, without
blocking, only while it holds that mutex. A call takes the selector out of that epoll (so the thread sleeps through
the call's I/O instead of waking with the caller and taking the GIL from it), takes the mutex (at once while the
thread waits) and runs the loop, with its own blocking ``select``, until its coroutine is done; then it puts the
selector back, and wakes the thread only if the call left it something to do before the thread would wake anyway.
Two threads never run the loop's code at once, and nothing wakes the loop's thread on a call's way in or out.

This drives asyncio's own selector loop step by step (``BaseEventLoop._run_once``, a private method; uvloop
cannot be driven so): the names it relies on are in :class:`_Internals`, checked when a loop is made.

A call made while another thread's call runs the loop is handed to that loop (the other thread, or this one's
thread after it, runs it) and waits for it, as all calls did before. Ctrl-C during a call cancels the call's
coroutine and waits (at most :data:`INTERRUPT_GRACE_S`) for its cleanup, the withdrawal of a wait, before
``KeyboardInterrupt`` is raised; a second Ctrl-C raises at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import logging
import math
import os
import select
import selectors
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Coroutine, Iterator
from types import FrameType
from typing import Any, Protocol, TypeVar, cast

from ._serving_thread import ServingThread

__all__ = ["INTERRUPT_GRACE_S", "CallTimeout", "LoopClosed", "SharedLoop"]

log = logging.getLogger("timeslice.client")

T = TypeVar("T")

# signal's C module: its getsignal/signal without the enum conversions of signal.py (a few µs a call, cold more)
_csignal: Any = importlib.import_module("_signal")
_SIGINT = int(signal.SIGINT)
_DEFAULT_INT = signal.default_int_handler
_get_running_loop = asyncio.events._get_running_loop
_set_running_loop = asyncio.events._set_running_loop

INTERRUPT_GRACE_S = 2.0  # how long a Ctrl-C'd call waits for its coroutine's cleanup before KeyboardInterrupt
_TURNS = 64  # loop steps the thread runs in one hold of the mutex before it lets a call in


class LoopClosed(RuntimeError):
    """The loop was stopped: no more calls."""


class CallTimeout(Exception):
    """A call ran past the ``timeout`` of :meth:`SharedLoop.run` (not a ``TimeoutError``: the coroutine's own
    timeouts stay apart from it)."""


class _Internals(Protocol):
    """The private parts of ``asyncio.BaseEventLoop`` this module drives (measured on CPython 3.11; a loop
    without them is refused when made)."""

    _ready: deque[asyncio.Handle]
    _scheduled: list[asyncio.TimerHandle]
    _thread_id: int | None

    def _run_once(self) -> None: ...

    def _write_to_self(self) -> None: ...


class _Selector(selectors.DefaultSelector):
    """The loop's selector: its ``select`` does not wait while ``nonblocking`` (the loop's thread runs the loop
    only for what is ready; it waits on an epoll of its own outside the mutex), nor past ``deadline`` (a call's
    limit, monotonic s: cheaper than a timer of the loop's, which a call would make and cancel every time)."""

    nonblocking = False
    deadline = math.inf

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self.nonblocking:
            timeout = 0
        elif self.deadline != math.inf:
            left = max(0.0, self.deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        return super().select(timeout)


class _Waits:
    """What the loop's thread waits on between its turns: an epoll where there is one (Linux), else ``poll``. An
    epoll's interest list changes under a thread that waits in it (a call takes the selector out of it); ``poll``'s
    only at its next wait (the thread may then wake once during a call, and wait for the mutex)."""

    def __init__(self) -> None:
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._poll = select.poll() if self._epoll is None else None

    def register(self, fd: int) -> None:
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN)
        elif self._poll is not None:
            self._poll.register(fd, select.POLLIN)

    def unregister(self, fd: int) -> None:
        if self._epoll is not None:
            self._epoll.unregister(fd)
        elif self._poll is not None:
            self._poll.unregister(fd)

    def wait(self, timeout: float) -> list[int]:
        """The fds that are readable, waiting at most ``timeout`` s (rounded up to the millisecond)."""
        ms = math.ceil(timeout * 1000)
        if self._epoll is not None:
            return [fd for fd, _ in self._epoll.poll(ms / 1000)]
        assert self._poll is not None
        return [fd for fd, _ in self._poll.poll(ms)]

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()


class SharedLoop(ServingThread):
    """One asyncio loop, run by the thread of a blocking :meth:`run` for its length and by a thread of its own
    (``name``) between calls. :meth:`start` it, :meth:`stop` it (idempotent; joins the thread)."""

    kind = "loop"

    # The loop's thread wakes at least this often (s), so a timer that a call sets further out than that needs no
    # wake-up at the call's end (one the thread would take while the job's thread runs again).
    max_wait = 1.0

    def __init__(self, name: str, *, start_timeout: float = 5.0) -> None:
        self.name = name
        self.start_timeout = start_timeout
        self._selector = _Selector()
        self.loop = asyncio.SelectorEventLoop(self._selector)
        self._inner = cast(_Internals, self.loop)
        for attr in ("_ready", "_scheduled", "_thread_id", "_run_once", "_write_to_self"):
            if not hasattr(self.loop, attr):  # a Python whose loop lacks them: fail at once, not in a call
                self.loop.close()
                raise RuntimeError(f"asyncio's loop has no {attr} on this Python ({sys.version.split()[0]})")
        self._mutex = threading.Lock()  # held by the thread that runs the loop's code (see the module's doc)
        self._state = threading.Lock()  # guards _caller and _stopped
        self._caller: int | None = None  # the thread whose call runs the loop now
        self._stopped = False
        self._poll_until = math.inf  # when the loop's thread wakes next, unless I/O comes (monotonic s)
        # The loop's thread waits on an epoll of its own: the loop's selector (an epoll fd, readable when it has
        # events) and a pipe to wake it by. A call takes the selector out of it for its length, so the thread sleeps
        # through the call's I/O (woken with the caller, it would take the GIL from it), and puts it back after.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._waits = _Waits()
        self._waits.register(self._wake_r)
        self._waits.register(self._selector.fileno())
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._hooks = (
            self.loop._asyncgen_firstiter_hook,  # type: ignore[attr-defined]
            self.loop._asyncgen_finalizer_hook,  # type: ignore[attr-defined]
        )
        self._main = threading.main_thread().ident  # the thread whose SIGINT handler a call may swap
        self._cut = _Cut(self._inner)  # reset by each call (one call drives the loop at a time)
        self._on_sigint = self._cut.handler

    # ------------------------------------------------------------------ lifecycle

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop's thread (joined, at most ``timeout`` s), cancel the tasks left and close the loop.
        Idempotent; returns whether it all ended in time. Call it from no loop callback."""
        with self._state:
            first, self._stopped = not self._stopped, True
        thread = self._thread
        if first and thread is not None and thread.is_alive():
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"\0")
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("the thread of %s is still busy %g s after it was asked to stop", self.name, timeout)
                return False
        if self.loop.is_closed() or not self._mutex.acquire(timeout=timeout):
            return self.loop.is_closed()
        try:
            self._finish(timeout)
        finally:
            self._mutex.release()
        return True

    def _finish(self, timeout: float) -> None:
        """Cancel what is left on the loop, let it end (at most ``timeout`` s) and close the loop (mutex held)."""
        me = threading.get_ident()
        with self._running_here(me):
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            if tasks:
                gathered = asyncio.gather(*tasks, return_exceptions=True)
                self._drive(gathered, time.monotonic() + timeout)
            ends = self.loop.create_task(self.loop.shutdown_asyncgens())
            self._drive(ends, time.monotonic() + timeout)
        self._inner._thread_id = None
        self.loop.close()
        self._waits.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------------ the loop's thread

    def _serve(self, ready: threading.Event) -> None:
        me = self._ident = threading.get_ident()
        ready.set()
        while True:
            with self._mutex:
                if self._stopped or self.loop.is_closed():
                    return
                with self._running_here(me):
                    self._selector.nonblocking = True
                    try:
                        for _ in range(_TURNS):
                            self._inner._run_once()
                            if not self._inner._ready:
                                break
                    except BaseException:  # a step that raises past asyncio's own handler: say so, keep serving
                        log.exception("the loop of %s failed a step", self.name)
                    finally:
                        self._selector.nonblocking = False
                wait = min(self._next_wait(), self.max_wait)
                self._poll_until = time.monotonic() + wait
            if self._wake_r in self._waits.wait(wait):
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)

    def _next_wait(self) -> float:
        """Seconds until the loop has something to do without I/O: 0 when a callback is ready, else until its
        first timer (inf: none)."""
        if self._inner._ready:
            return 0.0
        scheduled = self._inner._scheduled
        if not scheduled:
            return math.inf
        # The heap's head, cancelled or not (then the thread wakes early once, and _run_once drops it).
        return max(0.0, scheduled[0].when() - self.loop.time())

    @contextlib.contextmanager
    def _running_here(self, me: int) -> Iterator[None]:
        """The loop runs on this thread for the block (mutex held): asyncio's running loop, its thread id, its
        async generators' hooks."""
        old_loop = _get_running_loop()
        old_hooks = sys.get_asyncgen_hooks()
        _set_running_loop(self.loop)
        self._inner._thread_id = me
        sys.set_asyncgen_hooks(*self._hooks)
        try:
            yield
        finally:
            sys.set_asyncgen_hooks(*old_hooks)
            _set_running_loop(old_loop)

    # ------------------------------------------------------------------ calls

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and return its outcome; raise ``CallTimeout`` (the coroutine cancelled) when it
        takes over ``timeout`` s (None: no limit), ``LoopClosed`` after :meth:`stop`."""
        me = threading.get_ident()
        with self._state:
            if self._stopped or self.loop.is_closed():
                coro.close()
                raise LoopClosed(f"loop {self.name!r} is stopped")
            if me in (self._caller, self._ident):
                coro.close()
                raise RuntimeError("a blocking call from within the client's own loop (a callback) would never end")
            drive = self._caller is None
            if drive:
                self._caller = me
        if not drive:
            return self._run_handed(coro, timeout)
        # Kept lean (inline, no context managers): this runs on the critical path of every call, and after a
        # job's training step it runs cold.
        waits, fd = self._waits, self._selector.fileno()
        waits.unregister(fd)
        back = False  # the selector is back among the loop thread's waits
        try:
            try:
                self._mutex.acquire()  # at once, unless the loop's thread is in a turn
            except BaseException:  # Ctrl-C right there: the coroutine never ran
                coro.close()
                raise
            try:
                old_loop, old_hooks = _get_running_loop(), sys.get_asyncgen_hooks()
                _set_running_loop(self.loop)
                self._inner._thread_id = me
                sys.set_asyncgen_hooks(*self._hooks)
                try:
                    return self._run_here(coro, timeout)
                finally:
                    sys.set_asyncgen_hooks(*old_hooks)
                    _set_running_loop(old_loop)
                    self._inner._thread_id = self._ident
                    waits.register(fd)  # the thread wakes now if I/O is waiting
                    back = True
                    self._wake_thread()
            finally:
                self._mutex.release()
        finally:
            if not back:
                waits.register(fd)
            with self._state:
                self._caller = None

    def _run_here(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run the loop on this thread until ``coro`` is done (mutex held). Once it is cut short (Ctrl-C, or
        ``timeout``), its cleanup runs for at most :data:`INTERRUPT_GRACE_S` more."""
        loop, run_once, selector = self.loop, self._inner._run_once, self._selector
        task = loop.create_task(coro)
        cut = self._cut
        cut.reset(task)
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        guard: asyncio.TimerHandle | None = None
        swap = threading.get_ident() == self._main and _csignal.getsignal(_SIGINT) is _DEFAULT_INT
        try:
            if swap:
                _csignal.signal(_SIGINT, self._on_sigint)
            selector.deadline = deadline  # the select returns by the call's limit
            try:
                while not task.done():
                    if cut.give_up is not None:
                        if time.monotonic() >= cut.give_up:
                            break
                        if guard is None:  # the select returns by then
                            guard = loop.call_at(loop.time() + INTERRUPT_GRACE_S, _nothing)
                    elif time.monotonic() >= deadline:
                        selector.deadline = math.inf  # from here the guard below bounds the select
                        cut.expire()
                        continue
                    run_once()
            except KeyboardInterrupt:  # a second Ctrl-C, or a SIGINT handler of the caller's own
                if not cut.interrupted:
                    selector.deadline = math.inf
                    cut.interrupt()
                    self._drive(task, time.monotonic() + INTERRUPT_GRACE_S)
                raise
        finally:
            selector.deadline = math.inf
            if swap:
                _csignal.signal(_SIGINT, _DEFAULT_INT)
            if guard is not None:
                guard.cancel()
        if cut.interrupted:
            raise KeyboardInterrupt
        if cut.expired and (not task.done() or task.cancelled()):
            raise CallTimeout(f"the call took over {timeout:g} s")
        return task.result()

    def _drive(self, fut: asyncio.Future[Any], deadline: float) -> None:
        """Step the loop on this thread until ``fut`` is done or ``deadline`` (monotonic s) passes (mutex held)."""
        guard = self.loop.call_later(max(0.0, deadline - time.monotonic()), _nothing)  # wakes the select
        try:
            while not fut.done() and time.monotonic() < deadline:
                self._inner._run_once()
        finally:
            guard.cancel()

    def _wake_thread(self) -> None:
        """After a call (mutex held): wake the loop's thread if the call left it something to do before it
        would wake by itself (a ready callback, an earlier timer)."""
        if not self.loop.is_closed() and self._next_wait() + time.monotonic() < self._poll_until:
            self._poll_until = -math.inf  # it wakes now; it sets this again when it waits next
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"\0")

    def _run_handed(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Hand ``coro`` to whichever thread runs the loop now and wait for its outcome."""
        ended = threading.Event()

        async def tracked() -> T:
            try:
                return await coro
            finally:
                ended.set()

        fut = asyncio.run_coroutine_threadsafe(tracked(), self.loop)
        try:
            done, _ = concurrent.futures.wait([fut], timeout)
        except KeyboardInterrupt:
            fut.cancel()
            ended.wait(INTERRUPT_GRACE_S)
            raise
        if not done:
            fut.cancel()
            raise CallTimeout(f"the call took over {timeout:g} s")
        return fut.result()


def _nothing() -> None:
    """A timer's callback that only makes the loop's select return."""


class _Cut:
    """A call cut short: by its timeout (:meth:`expire`), or by Ctrl-C on the main thread (:meth:`interrupt`).
    Either cancels the call's task, whose cleanup then runs; ``give_up`` is when the call stops waiting for it.
    A second Ctrl-C raises ``KeyboardInterrupt`` at once. The handler is installed only over Python's default."""

    def __init__(self, loop: _Internals) -> None:
        self.loop = loop
        self.task: asyncio.Task[Any] | None = None
        self.interrupted = False
        self.expired = False
        self.give_up: float | None = None

    def reset(self, task: asyncio.Task[Any]) -> None:
        """For the call of ``task`` (the loop's calls reuse one: allocated once, not on every call's path)."""
        self.task = task
        self.interrupted = self.expired = False
        self.give_up = None

    def _cut(self) -> None:
        if self.give_up is None:
            self.give_up = time.monotonic() + INTERRUPT_GRACE_S
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def expire(self) -> None:
        self.expired = True
        self._cut()

    def interrupt(self) -> None:
        self.interrupted = True
        self._cut()

    def handler(self, signum: int, frame: FrameType | None) -> None:
        """The SIGINT handler during a call."""
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupt()
        with contextlib.suppress(RuntimeError, OSError):
            self.loop._write_to_self()  # the select returns; the loop runs the task's cleanup
