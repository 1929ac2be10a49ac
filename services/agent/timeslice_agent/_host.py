"""Facts about this host the agent needs: whether a process is alive, how much memory there is."""

from __future__ import annotations

import contextlib
import os

__all__ = ["alive", "host_memory"]


def alive(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory, from /proc/meminfo (zeros where it cannot be read)."""
    total = avail = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
            elif line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    return total, avail
