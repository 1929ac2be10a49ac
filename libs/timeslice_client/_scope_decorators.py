"""Scopes used as decorators (``@client.on_accelerators()``, ``@client.on_accelerators(groups=...)``): each call of
the decorated function runs inside a scope of its own, made anew for it, since a scope object is entered once (it
keeps what its own entry took) while the decorated function may run many times, and at once in several tasks or
threads."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import ParamSpec, TypeVar

__all__ = ["run_within", "run_within_async"]

P = ParamSpec("P")
R = TypeVar("R")


def run_within(scope: Callable[[], AbstractContextManager[object]], fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, each call of it inside a fresh ``scope()``."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with scope():
            return fn(*args, **kwargs)

    return wrapper


def run_within_async(
    scope: Callable[[], AbstractAsyncContextManager[object]], fn: Callable[P, Awaitable[R]]
) -> Callable[P, Awaitable[R]]:
    """``fn`` (a coroutine function), each call of it inside a fresh ``scope()``."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        async with scope():
            return await fn(*args, **kwargs)

    return wrapper
