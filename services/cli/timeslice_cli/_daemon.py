"""What makes ``timeslice up`` a well-behaved daemon: one per data dir, nothing left behind, a port jobs can keep.

- **One per data dir.** ``<data-dir>/up.lock`` is held (``flock``) while an ``up`` runs and says where it runs
  (pid, NATS URL, ports, log); a second ``up`` on the same data dir refuses with that, and ``timeslice down``
  reads it to stop the first. The lock goes with the process, however it dies: no stale lock to clean.
- **Nothing left behind.** The nats-server (and an agent process) are started with ``PR_SET_PDEATHSIG``: the
  kernel stops them when ``up`` dies, SIGKILL included. A nats-server still running on the data dir from an older
  crash (found by the ports file it writes there) is stopped before a new one starts.
- **A stable port.** NATS listens on 4222 unless that is taken (then on a free port, and ``up`` says so), so a
  restarted ``up`` is where its jobs' connections look for it again.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from timeslice_agent._host import alive

from ._common import CliError

__all__ = [
    "DEFAULT_PORT",
    "UpLock",
    "die_with_parent",
    "pick_port",
    "port_free",
    "running",
    "served_default_port",
    "stop_orphans",
    "stop_pid",
]

DEFAULT_PORT = 4222  # NATS's own default: what a job's client tries without a URL file too
LOCK_NAME = "up.lock"
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send ``sig`` to the child when the thread that started it ends (the
    process, for ``up``: it starts its children from its main thread). None where there is no ``prctl``."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: nobody would stop this child
            os._exit(1)

    return preexec


class UpLock:
    """``<data-dir>/up.lock``: held while this process runs ``up`` on the data dir, with what it serves in it."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.path = data_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ``CliError`` naming the ``up`` that holds it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by the children (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise CliError(
                f"another `timeslice up` runs on data dir {self.data_dir}: "
                f"{describe(read_info(self.path))}; "
                f"use it, stop it with `timeslice down --data-dir {self.data_dir}`, or give this one "
                "another --data-dir"
            ) from None
        self._fd = fd
        self.write(pid=os.getpid(), state="starting")

    def write(self, **info: Any) -> None:
        """Replace what the lock file says (pid, state, url, ...)."""
        if self._fd is None:
            return
        doc = {"pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **info}
        data = (json.dumps(doc) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def update(self, **info: Any) -> None:
        current = read_info(self.path) or {}
        self.write(**{**current, **info})

    def release(self) -> None:
        """Let go (the file stays, empty: unlinking it could let two ``up`` lock different files)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)


def read_info(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def describe(info: dict[str, Any] | None) -> str:
    if not info:
        return "it has not said where yet (starting)"
    parts = [f"pid {info.get('pid')}"]
    if info.get("url"):
        parts.append(f"NATS {info['url']}")
    if info.get("grpc") and info["grpc"] != "-":
        parts.append(f"gRPC {info['grpc']}")
    if info.get("started"):
        parts.append(f"since {info['started']}")
    if info.get("log"):
        parts.append(f"log {info['log']}")
    return ", ".join(parts)


def running(data_dir: Path) -> dict[str, Any] | None:
    """What the ``up`` running on ``data_dir`` says about itself (None: none runs there)."""
    path = data_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return read_info(path) or {}
    finally:
        os.close(fd)  # closing drops a lock this call took
    return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_pid(pid: int, timeout: float = 10.0) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; True once ``pid`` is gone."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)  # polling a process we signalled, bounded by the deadline
        if not alive(pid):
            return True
    return not alive(pid)


def stop_orphans(data_dir: Path, say: Callable[[str], None]) -> list[int]:
    """Stop every nats-server still serving ``data_dir`` (its ports file names its pid): an older ``up`` died
    without stopping it. Returns their pids."""
    stopped = []
    for ports in sorted((data_dir / "ports").glob("nats-server_*.ports")):
        try:
            pid = int(ports.stem.rsplit("_", 1)[1])
        except (IndexError, ValueError):
            continue
        if (
            pid == os.getpid()
            or not alive(pid)
            or "nats-server" not in _cmdline(pid)
            or str(data_dir) not in _cmdline(pid)
        ):
            continue
        try:
            url = json.loads(ports.read_text())["nats"][0]
        except (OSError, ValueError, KeyError, IndexError):
            url = "?"
        say(
            f"timeslice up: a nats-server from an earlier `timeslice up` still serves data dir {data_dir} "
            f"(pid {pid}, {url}); stopping it"
        )
        if not stop_pid(pid):
            raise CliError(
                f"the orphaned nats-server (pid {pid}) on data dir {data_dir} did not stop: "
                f"`kill -9 {pid}`, then start again"
            )
        stopped.append(pid)
    return stopped


def port_free(host: str, port: int) -> bool:
    """Whether ``port`` at ``host`` can be listened on (as nats-server binds it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nats-server binds: TIME_WAIT is no owner
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def served_default_port(data_dir: Path) -> bool:
    """Whether the data dir's last nats-server listened on the default port (its ports file says so)."""
    for ports in (data_dir / "ports").glob("nats-server_*.ports"):
        try:
            urls = json.loads(ports.read_text())["nats"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if any(isinstance(u, str) and u.endswith(f":{DEFAULT_PORT}") for u in urls):
            return True
    return False


def pick_port(host: str, given: int | None, say: Callable[[str], None], *, wait_s: float = 0.0) -> int | None:
    """The NATS port: ``given`` if given, else 4222 when it is free at ``host``, else None (any free port).
    ``wait_s``: how long 4222 may take to come free (the data dir's own nats-server, just dead, held it: a
    process killed with many threads lets go of its sockets only once the last thread has exited)."""
    if given is not None:
        return given
    deadline = time.monotonic() + wait_s
    while not port_free(host, DEFAULT_PORT):
        if time.monotonic() >= deadline:
            say(
                f"timeslice up: port {DEFAULT_PORT} at {host} is taken (by another program: not a `timeslice up` "
                "on this data dir); NATS listens on a free port instead, which clients find through the URL file"
            )
            return None
        time.sleep(0.05)  # polling the port an exiting process lets go of, bounded by the deadline
    return DEFAULT_PORT
