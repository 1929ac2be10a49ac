"""Agents that disappear: a key of KV ``agents`` that expired (the agent's TTL) or was deleted.

The orchestrator watches the bucket; for a lost node it publishes ``AgentLost`` into each group that still
refers to that node (a pending operation there, a context loaded there, a job placed there), and the core
resolves those groups' operations and placements like any other input. At start, the nodes that the stored
records name but that have no key once the watcher has delivered the bucket's current keys are lost too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping

from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from timeslice_client.protocol import AgentLost, GroupRecord, encode, subjects

from ._op_facts import pending_ops

__all__ = ["publish_agent_lost", "referenced_nodes", "watch_agents"]

log = logging.getLogger("timeslice.orchestrator")


async def watch_agents(
    kv: KeyValue,
    js: JetStreamContext,
    records: Callable[[], Mapping[str, GroupRecord]],
    stop: asyncio.Event,
    known: asyncio.Event,
) -> None:
    """Until ``stop``: publish ``AgentLost`` for each node whose key goes away. ``known`` is set once the
    bucket's current keys were read (and the nodes the records name without a key were reported lost)."""
    alive: set[str] = set()
    status = await kv.status()
    watcher = await kv.watchall()
    initial = status.values > 0
    try:
        if not initial:
            known.set()
        while not stop.is_set():
            try:
                entry = await watcher.updates(timeout=1)  # type: ignore[no-untyped-call]
            except Exception:  # the nats-py watcher raises its own timeout type
                entry = None
            if entry is None:
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                if entry.key in alive or initial is False:
                    alive.discard(entry.key)
                    await publish_agent_lost(js, records(), entry.key)
            else:
                alive.add(entry.key)
            if initial and entry.delta == 0:
                initial = False
                for node in referenced_nodes(records().values()) - alive:
                    await publish_agent_lost(js, records(), node)
                known.set()
    finally:
        known.set()
        with contextlib.suppress(Exception):
            await watcher.stop()  # type: ignore[no-untyped-call]


def referenced_nodes(records: Iterable[GroupRecord]) -> set[str]:
    """Every node a record names: where its jobs are placed and where contexts are loaded."""
    nodes: set[str] = set()
    for rec in records:
        for ns in rec.placements.values():
            nodes.update(ns)
        nodes.update(rec.loaded)
    return nodes


async def publish_agent_lost(js: JetStreamContext, records: Mapping[str, GroupRecord], node: str) -> None:
    """``AgentLost`` into every group that still refers to ``node``."""
    for g, rec in records.items():
        pending = any(op.node == node for op in pending_ops(rec))  # the switch's, or snapshots trailing a grant
        if pending or node in rec.loaded or any(node in ns for ns in rec.placements.values()):
            log.warning("agent lost", extra={"node": node, "group": g})
            try:
                await js.publish(subjects.ctl(g, "agent_lost"), encode(AgentLost(group=g, node=node)), timeout=5)
            except Exception:
                log.exception("could not publish agent_lost", extra={"node": node, "group": g})
