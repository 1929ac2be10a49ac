"""A shorter GIL switch interval while a workload answers a suspend or resume.

A job's main thread often runs pure Python (reward scoring, data preparation) right after it yields the
group, which is when its suspend runs. CPython then hands the GIL to a thread that wants it back (after a
socket read, a copy that released it) only every ``sys.getswitchinterval()`` seconds, 5 ms by default. The
workload channel's event loop and the handler's thread take the GIL back after every such call, so each
one can wait up to 5 ms. Measured here (``bench/busy_suspend.py``: the torch handler, 300 CPU tensors, 79 MB),
a suspend copying storage by storage took 2.7 to 3.1 s beside a thread spinning in Python instead of 22 to
36 ms; with the handler's batched copies and the interval at 0.1 ms, 38 to 58 ms (the busy thread still gets
its share of the CPU).

The interval is the process's: the first user lowers it (a command in flight, or a channel armed because its
job yielded the group), the last one to end puts back what was there before, unless somebody else changed it
meanwhile (theirs is kept).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

__all__ = ["DEFAULT_SWITCH_INTERVAL", "lower", "prompt_threads", "restore"]

DEFAULT_SWITCH_INTERVAL = 1e-4  # seconds

_lock = threading.Lock()
_users = 0
_saved = 0.0  # the interval before the first user lowered it
_ours = 0.0  # the interval we set


def lower(interval: float) -> None:
    """One more user: the interval is at most ``interval`` seconds until the matching ``restore()``."""
    global _users, _saved, _ours
    if interval <= 0:
        raise ValueError(f"switch interval must be positive, not {interval}")
    with _lock:
        if _users == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved, interval))
            _ours = sys.getswitchinterval()  # as the interpreter keeps it (whole microseconds)
        _users += 1


def restore() -> None:
    """One user fewer (one call per ``lower()``): the last one puts back the interval from before."""
    global _users
    with _lock:
        if _users == 0:
            raise RuntimeError("restore() without lower()")
        _users -= 1
        if _users == 0 and sys.getswitchinterval() == _ours:
            sys.setswitchinterval(_saved)


@contextlib.contextmanager
def prompt_threads(interval: float | None) -> Iterator[None]:
    """Within the block the switch interval is at most ``interval`` seconds (``None``: left alone)."""
    if interval is None:
        yield
        return
    lower(interval)
    try:
        yield
    finally:
        restore()
