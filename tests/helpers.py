"""Test helpers: bounded waiting, never a bare sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    check: Callable[[], Awaitable[T] | T], *, timeout: float = 10.0, interval: float = 0.01, what: str = ""
) -> T:
    """Call ``check`` until it returns a truthy value (or stops raising AssertionError), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            result = check()
            if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
                result = await result  # type: ignore[misc]
            if result:
                return result  # type: ignore[return-value]
            last = None
        except AssertionError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {what or check}") from last
        await asyncio.sleep(interval)


def eventually_sync(check: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.01, what: str = "") -> T:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            result = check()
            if result:
                return result
            last = None
        except AssertionError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {what or check}") from last
        time.sleep(interval)
