"""Run a service's main coroutine on uvloop when it is installed (the ``fast`` extra), else on asyncio's loop.

uvloop's socket writes and callbacks cost less per message, and every step of a handoff is a message: the
services (orchestrator, agent) use it when they can."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run"]

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        uvloop = None
    # outside the except block: an error of the run must not come chained to "No module named 'uvloop'"
    if uvloop is None:
        return asyncio.run(coro)
    return uvloop.run(coro)  # type: ignore[no-any-return]
