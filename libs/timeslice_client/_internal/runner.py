"""Run a service's main coroutine on uvloop when it is installed (the ``fast`` extra), else on asyncio's loop.

uvloop's socket writes and callbacks cost less per message, and every step of a handoff is a message: the
services (orchestrator, agent) use it when they can."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

__all__ = ["run"]

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    fast = _uvloop_run()
    # outside any except block: an error of the run must not come chained to "No module named 'uvloop'"
    if fast is None:
        return asyncio.run(coro)
    return cast(T, fast(coro))


def _uvloop_run() -> Callable[[Coroutine[Any, Any, Any]], Any] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return cast(Callable[[Coroutine[Any, Any, Any]], Any], uvloop.run)
