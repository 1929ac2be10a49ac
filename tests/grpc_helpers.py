"""What the gRPC tests share: blocking gRPC calls made off the event loop that serves them, the agent's gRPC shim
for a test's block, and the orchestrator process's command line."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from timeslice_agent import Agent
from timeslice_agent.grpc_shim import AgentGrpcConfig, AgentGrpcShim
from timeslice_orchestrator.grpc_shim import GrpcConfig, OrchestratorGrpcShim


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A blocking gRPC call, off the event loop that serves it."""
    return asyncio.to_thread(fn, *args, **kwargs)


async def rpc_error(fn: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    """The error a blocking gRPC call fails with (the test fails if it does not)."""
    with pytest.raises(grpc.RpcError) as info:
        await call(fn, *args, **kwargs)
    return info.value


@contextlib.asynccontextmanager
async def shim_target(agent: Agent) -> AsyncIterator[str]:
    """``agent``'s gRPC shim while the block runs, on 127.0.0.1 at a port the system chose: its ``host:port``. Its
    callers are local, so their uid is the test's, the workload's."""
    shim = AgentGrpcShim(agent, AgentGrpcConfig(host="127.0.0.1", port=0))
    port = await shim.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await shim.stop()


@contextlib.asynccontextmanager
async def orchestrator_shim(nats_url: str, **settings: Any) -> AsyncIterator[OrchestratorGrpcShim]:
    """The orchestrator's gRPC shim (``GrpcConfig`` of ``settings``) on 127.0.0.1 at a port the system chose, serving
    while the block runs."""
    s = OrchestratorGrpcShim(GrpcConfig(host="127.0.0.1", port=0, **settings), nats_url=nats_url)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


def orchestrator_command(nats_url: str, *flags: str) -> list[str]:
    """The argv of ``timeslice orchestrator --nats-url <nats_url> <flags>`` (``python -m timeslice_orchestrator``)."""
    return [sys.executable, "-m", "timeslice_orchestrator", "orchestrator", "--nats-url", nats_url, *flags]
