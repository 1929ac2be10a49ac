"""Waiting until a job's processes have stopped after SIGSTOP (the ``freeze`` backend's proof that they did).

``kill(SIGSTOP)`` returns once the signal is queued; each thread stops only when it next runs in the kernel's
signal path. On a loaded node that was measured at up to 16 ms after ``kill`` returned, with the job's threads
still running user code meanwhile (2 cores, 3 busy loops, 200 tries). A snapshot that reported done at once let
the next job be granted while the frozen one still ran. So the snapshot ends only once every thread of every
signalled process reads as stopped in ``<proc>/<pid>/task/<tid>/stat``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable

from ._ownership import ProcFS

__all__ = ["NotStopped", "group_members", "running_threads", "wait_stopped"]

# Thread states (proc(5)) in which a thread runs no user code: stopped, traced-stopped, zombie, dead.
_STILL = frozenset("tTZX")
_FIRST_POLL_S = 0.0005
_MAX_POLL_S = 0.01
_MAX_SHOWN = 8  # threads named in an error


class NotStopped(Exception):
    """Threads of the job still ran when the wait ended: ``running`` maps ``pid/tid`` to its state letter
    (the ``freeze`` backend turns it into a ``BackendError``)."""

    def __init__(self, running: dict[str, str], waited_s: float) -> None:
        self.running = running
        self.waited_s = waited_s
        shown = ", ".join(f"{k} ({v})" for k, v in list(running.items())[:_MAX_SHOWN])
        more = len(running) - _MAX_SHOWN
        super().__init__(
            f"{len(running)} thread(s) had not stopped {waited_s:.3f} s after SIGSTOP: {shown}"
            + (f" and {more} more" if more > 0 else "")
        )


def _state(path: str) -> str | None:
    """The state letter of one ``stat`` file (None when it is gone or unreadable: the thread ended)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        return chr(data[data.rindex(b")") + 2])
    except (OSError, ValueError, IndexError):
        return None


def running_threads(pids: Iterable[int], *, proc: str = "/proc") -> dict[str, str]:
    """The threads of ``pids`` that may still run user code, as ``pid/tid`` -> state (a process that is gone
    has none)."""
    running: dict[str, str] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue  # gone
        for tid in tids:
            state = _state(f"{proc}/{pid}/task/{tid}/stat")
            if state is not None and state not in _STILL:
                running[f"{pid}/{tid}"] = state
    return running


def group_members(pgid: int, *, proc: str = "/proc") -> frozenset[int]:
    """The processes whose process group is ``pgid`` (each ``<proc>/<pid>/stat``, read by ``_ownership.ProcFS``)."""
    fs = ProcFS(proc)
    try:
        entries = os.listdir(proc)
    except OSError:
        return frozenset()
    return frozenset(int(n) for n in entries if n.isdigit() and (st := fs.stat(int(n))) is not None and st.pgrp == pgid)


async def wait_stopped(pids: Iterable[int], *, timeout: float, proc: str = "/proc") -> float:
    """Return the seconds waited once no thread of ``pids`` can run; raise ``NotStopped`` after ``timeout``.

    Polls ``/proc`` (a read is a few microseconds per thread, cheaper than a hop to a worker thread) with a
    back-off from 0.5 ms to 10 ms, so a job that stops at once costs no sleep at all."""
    targets = tuple(pids)
    start = time.monotonic()
    pause = _FIRST_POLL_S
    while True:
        running = running_threads(targets, proc=proc)
        waited = time.monotonic() - start
        if not running:
            return waited
        if waited >= timeout:
            raise NotStopped(running, waited)
        await asyncio.sleep(min(pause, max(0.0, timeout - waited)))
        pause = min(pause * 2, _MAX_POLL_S)
