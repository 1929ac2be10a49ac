"""What the gRPC tests share: blocking gRPC calls made off the event loop that serves them, and the orchestrator
process's command line."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc
import pytest


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A blocking gRPC call, off the event loop that serves it."""
    return asyncio.to_thread(fn, *args, **kwargs)


async def rpc_error(fn: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    """The error a blocking gRPC call fails with (the test fails if it does not)."""
    with pytest.raises(grpc.RpcError) as info:
        await call(fn, *args, **kwargs)
    return info.value


def orchestrator_command(nats_url: str, *flags: str) -> list[str]:
    """The argv of ``timeslice orchestrator --nats-url <nats_url> <flags>`` (``python -m timeslice_orchestrator``)."""
    return [sys.executable, "-m", "timeslice_orchestrator", "orchestrator", "--nats-url", nats_url, *flags]
