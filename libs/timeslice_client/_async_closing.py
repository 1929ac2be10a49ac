"""``AsyncClosing``: ``async with obj:`` for the objects that own a connection (the workload channel, the async
snapshot-agent client): the block gets ``obj`` itself, already usable, and ``obj.close()`` is awaited at its end,
whatever ends it."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self

__all__ = ["AsyncClosing"]


class AsyncClosing(abc.ABC):
    """Subclasses define :meth:`close` (idempotent: a block may close early)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @abc.abstractmethod
    async def close(self) -> None:
        """Release what the object owns."""
