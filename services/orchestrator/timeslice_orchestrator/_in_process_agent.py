"""A node agent run in the orchestrator's process (``timeslice up``, ``timeslice orchestrator --with-agent``).

The agent shares the orchestrator's NATS connection, and the orchestrator hands it its node's commands
directly (``LocalAgent``, below). A switch then skips one bus hop and one process wake-up. The agent is the
same ``timeslice_agent.Agent`` as ``timeslice agent`` runs, with its durable consumer, KV state and metrics.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry
from timeslice_client.protocol import Restore, Snapshot

if TYPE_CHECKING:
    from timeslice_agent import Agent


__all__ = ["AgentBeside", "LocalAgent"]


class LocalAgent(Protocol):
    """A node agent run by the orchestrator in its own process, on its connection (``timeslice_agent.Agent``)."""

    node: str

    @property
    def ready(self) -> asyncio.Event: ...

    async def run(self) -> None: ...

    def shutdown(self) -> None: ...

    def take(self, cmd: Snapshot | Restore, published: asyncio.Event) -> bool:
        """Start a command that is about to be published on the shared connection: the operation writes
        nothing before ``published`` is set. False when not taken (the stream delivers it then)."""
        ...


class AgentBeside:
    """Builds the agent for ``Orchestrator(local_agent=...)``; its metrics go to ``registry``.

    ``node_id`` None: ``$TIMESLICE_AGENT_NODE_ID``, else ``$TIMESLICE_NODE_ID`` or the host name. Imports the
    agent's package only when constructed, so the orchestrator alone needs none of it.
    """

    def __init__(self, node_id: str | None, nats_url: str | None, registry: CollectorRegistry) -> None:
        from timeslice_agent import AgentConfig, AgentMetrics

        self.config = (
            AgentConfig(nats_url=nats_url) if node_id is None else AgentConfig(node_id=node_id, nats_url=nats_url)
        )
        self.node: str = self.config.node_id
        self.metrics = AgentMetrics(registry)

    def __call__(self, nc: NATS) -> Agent:
        from timeslice_agent import Agent

        return Agent(self.config, nc=nc, metrics=self.metrics)
