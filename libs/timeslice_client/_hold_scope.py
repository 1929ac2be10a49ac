"""``client.on_accelerators()``: acquire on entry, release on exit, as an ``async with`` block or a decorator."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from ._grants import Grant
from .errors import TimeSliceError

if TYPE_CHECKING:
    from ._async_client import AsyncTimeSliceClient

__all__ = ["AsyncHold"]

log = logging.getLogger("timeslice.client")

P = ParamSpec("P")
R = TypeVar("R")


class AsyncHold:
    """Acquire on entry, release on exit (also on exceptions, never masking the body's exception)."""

    def __init__(self, client: AsyncTimeSliceClient, timeout: float | None) -> None:
        self._client = client
        self._timeout = timeout
        self.grant: Grant | None = None

    async def __aenter__(self) -> Grant:
        self.grant = await self._client.acquire(self._timeout)
        return self.grant

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self._client.release()
        except TimeSliceError:
            if exc is None:
                raise
            log.warning("release after a failed block did not succeed", exc_info=True)

    def __call__(self, fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            async with AsyncHold(self._client, self._timeout):
                return await fn(*args, **kwargs)

        return wrapper
