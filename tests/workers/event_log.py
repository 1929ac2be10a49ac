"""A worker's event log: JSON lines, one event a line (``{"ev": kind, ...fields, "t": unix seconds}``), written by
the worker process (``EventLog``) and read by the test (``log_events``)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["EventLog", "log_events"]


class EventLog:
    """Append-only JSON lines, one ``write`` + ``flush`` per event (threads share it; survives SIGKILL of this
    process)."""

    def __init__(self, path: str) -> None:
        self._f: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()

    def __call__(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, **fields, "t": time.time()})
        with self._lock:
            if not self._f.closed:  # a daemon thread may log while the process exits
                self._f.write(line + "\n")
                self._f.flush()

    def failure(self, where: str, exc: BaseException, **fields: Any) -> None:
        self("error", where=where, type=exc.__class__.__name__, msg=str(exc)[:500], **fields)

    def close(self) -> None:
        with self._lock:
            self._f.close()

    def run(self, body: Callable[[], int]) -> int:
        """A worker's life: ``body()``'s exit code, or 2 with its exception logged (``failure``); the log closed."""
        try:
            return body()
        except Exception as exc:
            self.failure("worker", exc)
            return 2
        finally:
            self.close()


def log_events(path: Path, ev: str | None = None) -> list[dict[str, Any]]:
    """A worker's JSON-lines event log as it is now: its complete lines (the last one may be being written, or cut
    by SIGKILL), each an event, only those of kind ``ev`` when given."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        e = json.loads(line)
        if ev is None or e["ev"] == ev:
            out.append(e)
    return out
