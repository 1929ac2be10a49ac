"""A node agent run in the orchestrator's process (``timeslice up``, ``timeslice orchestrator --with-agent``).

The agent shares the orchestrator's NATS connection, and the orchestrator hands it its node's commands
directly (``LocalAgent``, below). A switch then skips one bus hop and one process wake-up. The agent is the
same ``timeslice_agent.Agent`` as ``timeslice agent`` runs, with its durable consumer, KV state and metrics.
The orchestrator runs it for as long as it runs itself (``run_beside``) and serves once it is ready
(``ready_beside``): either one's failure stops the orchestrator.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry
from timeslice_client.protocol import Restore, Snapshot

from ._delivery import first

if TYPE_CHECKING:
    from timeslice_agent import Agent


__all__ = ["AgentBeside", "LocalAgent", "ready_beside", "run_beside"]

log = logging.getLogger("timeslice.orchestrator")


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


async def run_beside(agent: LocalAgent, stopping: asyncio.Event, die: Callable[[BaseException], None]) -> None:
    """The agent beside the orchestrator, until it stops; its failure, or its exit before ``stopping`` is set,
    goes to ``die`` (it stops the orchestrator)."""
    try:
        await agent.run()
    except Exception as exc:
        log.exception("the agent running beside the orchestrator failed", extra={"node": agent.node})
        die(exc)
        return
    if not stopping.is_set():
        die(RuntimeError(f"the agent of node {agent.node!r} running beside the orchestrator stopped"))


async def ready_beside(
    agent: LocalAgent, timeout_s: float, halt: asyncio.Event, die: Callable[[BaseException], None]
) -> bool:
    """Until the agent beside the orchestrator is ready; False when ``halt`` is set first, or (after ``die``) when
    it is not ready within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            await first(agent.ready.wait(), halt.wait())
    except TimeoutError:
        die(TimeoutError(f"the agent of node {agent.node!r} was not ready within {timeout_s:.0f} s"))
        return False
    return not halt.is_set()


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
