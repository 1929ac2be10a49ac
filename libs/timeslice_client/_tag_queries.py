"""``TagQueries``: what the offload handlers (``NumpyOffloadHandler``, ``TorchOffloadHandler``) say about their tags,
the named parts of the state they move, each suspended or not on its own."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["TagQueries"]


class TagQueries(abc.ABC):
    """A handler's ``tags`` and ``suspended_tags``, from :meth:`_suspended`, read under the handler's ``_lock`` (so
    that a suspend or resume in progress is not seen half done)."""

    _lock: AbstractContextManager[Any]

    @property
    def tags(self) -> frozenset[str]:
        """Every tag this handler moves (fixed when it is made)."""
        return frozenset(self._suspended())

    @property
    def suspended_tags(self) -> frozenset[str]:
        """The tags whose state is suspended now (off the device, or dropped)."""
        with self._lock:
            return frozenset(tag for tag, off in self._suspended().items() if off)

    @abc.abstractmethod
    def _suspended(self) -> Mapping[str, bool]:
        """Each tag, and whether its state is suspended now."""
