"""``ServingThread``: the start of an object that serves from a daemon thread of its own (the workload channel's
``Responder``, the blocking client's ``SharedLoop``): started once, and not returned from until the thread serves,
so that the first call handed to it finds it running (or the start fails, naming the thread)."""

from __future__ import annotations

import abc
import threading
from typing import ClassVar

__all__ = ["ServingThread"]


class ServingThread(abc.ABC):
    """Subclasses set ``name`` (the thread's), ``start_timeout`` (s) and ``_thread = None`` in their ``__init__``, and
    serve in :meth:`_serve`, which sets ``ready`` once it does."""

    kind: ClassVar[str]  # what the object is called in the error of a second start
    name: str
    start_timeout: float
    _thread: threading.Thread | None

    def start(self) -> None:
        """Start the thread and wait (at most ``start_timeout`` s) until it serves."""
        if self._thread is not None:
            raise RuntimeError(f"{self.kind} {self.name!r} was started already")
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(self.start_timeout):
            raise RuntimeError(f"the thread of {self.name!r} did not start within {self.start_timeout:g} s")

    @abc.abstractmethod
    def _serve(self, ready: threading.Event) -> None:
        """The thread's body: set ``ready`` once it serves, return when it is done."""
