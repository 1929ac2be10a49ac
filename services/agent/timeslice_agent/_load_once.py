"""A native library the agent loads on first use, once per process (NVML, the CUDA driver's checkpoint API), or why
it cannot be used on this node: loaded under a lock, as the agent's threads may ask for it at once, and never tried
again, so a node without it says so once (in the log) instead of on every operation."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["LoadOnce"]

log = logging.getLogger("timeslice.agent")

T = TypeVar("T")


class LoadOnce(Generic[T]):
    """``load()`` on the first :meth:`get`; ``unavailable``, raised by it, means the library cannot be used here
    (its message says why: :attr:`error`). ``said``: the log line that tells so, with ``%s`` for the reason."""

    def __init__(self, load: Callable[[], T], unavailable: type[Exception], said: str) -> None:
        self._load, self._unavailable, self._said = load, unavailable, said
        self._lock = threading.Lock()
        self._loaded: T | None = None
        self._error: str | None = None

    def get(self) -> T | None:
        """The loaded library, or None when it cannot be used."""
        with self._lock:
            if self._loaded is None and self._error is None:
                try:
                    self._loaded = self._load()
                except self._unavailable as exc:
                    self._error = str(exc)
                    log.info(self._said, self._error)
            return self._loaded

    def error(self) -> str | None:
        """Why :meth:`get` is None (tried now if it was not yet); None while the library works."""
        self.get()
        return self._error
