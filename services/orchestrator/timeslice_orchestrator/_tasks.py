"""Ending a helper task at teardown, one way everywhere (the gRPC shim's liveness watch, the election's stop relay)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (None: there is none) and wait until it has ended, so that nothing it does outlives the
    teardown that ends it; its cancellation is expected and swallowed, any other error it ended with is raised."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
