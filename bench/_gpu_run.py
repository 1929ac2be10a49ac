"""How ``bench/gpu_check.py`` stays inside the GPU machine's per-command limit and leaves its report behind.

- ``Budget``: one overall time budget (``--budget-s``); every wait, timeout and subprocess bound of the check
  is cut to what is left of it, so a run ends before the device kills it (600 s per command);
- ``run_sections``: runs the sections in order, skips those the budget no longer fits (the reason recorded),
  and saves the report after each one;
- ``write_json_atomic``: the report's file is replaced whole (temp file, then ``os.replace``): a run killed at any
  moment leaves the last complete report, never a half-written one;
- ``run_bounded``: a subprocess bounded by the budget, stopped with its whole process tree when it runs over;
- ``LineReader``: a child's stdout read line by line with a timeout;
- ``die_with_parent``: a ``preexec`` that ends a helper process (nats-server starts its own session) when the
  check itself is killed.

Private to ``bench/``; ``gpu_check.py`` puts ``bench/`` and the project's packages on the path before importing it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = [
    "CLEANUP_S",
    "DEFAULT_BUDGET_S",
    "DEVICE_LIMIT_S",
    "MAX_BUDGET_S",
    "MIN_SECTION_S",
    "Budget",
    "LineReader",
    "die_with_parent",
    "run_bounded",
    "run_sections",
    "write_json_atomic",
]

DEVICE_LIMIT_S = 600.0  # the GPU machine's limit on one command
CLEANUP_S = 20.0  # what stopping a section's processes may add after the budget ran out, in total
MAX_BUDGET_S = DEVICE_LIMIT_S - CLEANUP_S - 10.0  # 570 s: the budget, its cleanup and the report fit in 600 s
DEFAULT_BUDGET_S = 540.0
MIN_SECTION_S = 5.0  # a section is not started with less than this left


class Budget:
    """The run's overall time budget: ``deadline`` = start + ``total_s`` (on ``clock``)."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if total_s <= 0:
            raise ValueError(f"the budget must be positive, not {total_s} s")
        self.total_s = total_s
        self._clock = clock
        self.start = clock()
        self.deadline = self.start + total_s

    def left(self) -> float:
        return max(0.0, self.deadline - self._clock())

    def elapsed(self) -> float:
        return self._clock() - self.start

    def spent(self) -> bool:
        """Too little is left to start a section."""
        return self.left() < MIN_SECTION_S

    def bound(self, natural_s: float) -> float:
        """``natural_s`` cut to what is left (at least 0.5 s: a timeout of 0 is refused by some callers; the wait
        after the deadline then fails within that)."""
        return max(0.5, min(natural_s, self.left()))

    def why_spent(self) -> str:
        return (
            f"the {self.total_s:.0f} s budget was spent ({self.elapsed():.0f} s elapsed): run it on its own "
            f"(--only), or raise --budget-s (at most {MAX_BUDGET_S:.0f})"
        )


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` whole: a temp file beside it, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=2, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def run_sections(
    rep: Any, steps: Sequence[tuple[str, Callable[[], None]]], budget: Budget, save: Callable[[], None]
) -> None:
    """Run ``steps`` in order on the report ``rep`` (a ``_gpu_report.Report``); save it before the first and after
    each one (``next_section``: the one that runs next, ``complete`` once all are through). A step the budget no
    longer fits is skipped, its reason in ``rep.skipped``; a step that raises is recorded in ``rep.errors``."""
    rep.sections = [name for name, _ in steps]
    for name, fn in steps:
        rep.next_section = name
        save()
        if budget.spent():
            rep.skipped.append(f"{name}: not run, {budget.why_spent()}")
            continue
        _section(rep, name, fn, budget)
        rep.done.append(name)
    rep.next_section = None
    rep.complete = True
    save()


def _section(rep: Any, name: str, fn: Callable[[], None], budget: Budget) -> None:
    """Run one section; a failure is recorded and the others still run."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:
        why = f" (stopped by the budget: {budget.why_spent()})" if budget.spent() else ""
        rep.errors.append(f"{name}: {exc.__class__.__name__}: {exc}{why}")
    print(f"[{name} done in {time.monotonic() - t0:.0f} s; {budget.left():.0f} s of the budget left]", flush=True)


# --------------------------------------------------------------------------- processes


def _tree(pid: int) -> frozenset[int]:
    from timeslice_agent._nvml import process_tree

    tree: frozenset[int] = process_tree([pid])
    return tree


def _signal_all(pids: frozenset[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_tree(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM ``proc`` and every descendant, SIGKILL what still runs after ``grace_s``."""
    pids = _tree(proc.pid) | {proc.pid}
    _signal_all(pids, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    _signal_all(pids | (_tree(proc.pid) if proc.poll() is None else frozenset()), signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)


def run_bounded(
    cmd: Sequence[str], timeout_s: float, *, grace_s: float = CLEANUP_S / 2, what: str = "", **popen: Any
) -> int:
    """Run ``cmd`` (``popen``: Popen's arguments) for at most ``timeout_s``; its exit status. Over time, or
    interrupted, it is stopped with its whole process tree, and TimeoutError says so."""
    proc = subprocess.Popen(list(cmd), **popen)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop_tree(proc, grace_s)
        raise TimeoutError(
            f"{what or cmd[0]} did not finish within {timeout_s:.0f} s: stopped with its child processes"
        ) from None
    except BaseException:
        stop_tree(proc, grace_s)
        raise


class LineReader:
    """A child's text stdout, one line at a time, each read bounded (a thread reads; ``readline`` waits)."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True, name="line-reader").start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put("")  # end of stream

    def readline(self, timeout_s: float, what: str) -> str:
        """The next line without its end ('' at the end of the stream); TimeoutError after ``timeout_s``."""
        try:
            return self._lines.get(timeout=timeout_s).strip()
        except queue.Empty:
            raise TimeoutError(f"{what}: no answer within {timeout_s:.0f} s") from None


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child SIGTERMed when this process ends (Linux; None elsewhere). For helpers
    that start their own session (nats-server), which a kill of the check's process group would miss."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the child after fork
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigterm)

    return preexec
