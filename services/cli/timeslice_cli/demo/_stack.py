"""The demo's private stack: a nats-server in the demo's work directory, and the orchestrator with the node's
snapshot agent beside it in this process (as ``timeslice up`` runs them)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NATS
from timeslice_orchestrator.embedded import NatsServer
from timeslice_orchestrator.service import LocalAgent, Orchestrator, OrchestratorConfig

__all__ = ["Stack", "embedded_stack"]

READY_TIMEOUT_S = 60.0  # a fresh interpreter on a loaded 2-core machine may take this long


@dataclass(frozen=True, slots=True)
class Stack:
    nats_url: str
    node_id: str
    orchestrator: Orchestrator


@contextlib.asynccontextmanager
async def embedded_stack(workdir: Path, node_id: str) -> AsyncIterator[Stack]:
    """Start everything, yield, stop everything (also when the body fails)."""
    from timeslice_agent import Agent, AgentConfig

    server = NatsServer(workdir / "nats")
    url = await server.astart()

    def agent(nc: NATS) -> LocalAgent:
        return Agent(AgentConfig(node_id=node_id, nats_url=url), nc=nc)

    failed: Exception | None = None
    try:
        orch = Orchestrator(OrchestratorConfig(nats_url=url, local_agent_ready_s=READY_TIMEOUT_S), local_agent=agent)
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(orch.run(), name="demo-orchestrator")
            try:
                ready = tg.create_task(orch.ready.wait())
                try:
                    async with asyncio.timeout(READY_TIMEOUT_S):
                        await asyncio.wait({run, ready}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    ready.cancel()
                if run.done():
                    raise RuntimeError("the orchestrator (or the agent beside it) stopped before it was ready")
                try:
                    yield Stack(url, node_id, orch)
                except Exception as exc:  # the body's own error: raised as it is, not in the group's wrapper
                    failed = exc
            finally:
                orch.shutdown()
    finally:
        await server.astop()
    if failed is not None:
        raise failed
