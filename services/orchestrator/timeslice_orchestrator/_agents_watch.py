"""Agents that disappear: a key of KV ``agents`` that expired (the agent's TTL) or was deleted, and an agent that
does not answer.

The orchestrator watches the bucket. A key that goes away only makes its node *suspect*: the orchestrator asks the
agent itself (its ``status`` RPC). An agent that answers is alive, whatever its key says (its heartbeats may have
failed for a while, e.g. through a NATS election slower than the key's TTL): it is asked again every
``recheck_s`` until its key is back, and declared lost the first time it does not answer. An agent that does not
answer is lost: the orchestrator publishes ``AgentLost`` into each group that still refers to that node (a pending
operation there, a context loaded there, a job placed there), and the core resolves those groups' operations and
placements like any other input. At start, the nodes that the stored records name but that have no key once the
watcher has delivered the bucket's current keys (or in an empty bucket) are suspect the same way, asked a little
later (an agent that starts beside this orchestrator writes its key first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from timeslice_client.protocol import AgentLost, GroupRecord, encode, subjects

from ._op_facts import pending_ops

__all__ = ["MAX_PROBES", "AgentLiveness", "agent_answers", "publish_agent_lost", "referenced_nodes", "watch_agents"]

log = logging.getLogger("timeslice.orchestrator")

MAX_PROBES: Final = 64  # agents asked at once; the others wait for the next pass (a second later at most)


class AgentLiveness:
    """What the watch counts (the metrics read it): keys that went away while their agent answered, agents lost."""

    def __init__(self) -> None:
        self.answered_without_key = 0
        self.lost = 0


async def agent_answers(nc: NATS, node: str, timeout: float) -> bool:
    """Whether ``node``'s agent answers its ``status`` request within ``timeout`` seconds."""
    try:
        await nc.request(subjects.agent_rpc(node, "status"), b"", timeout=timeout)
    except Exception:  # no responders, a timeout, a connection that went away: no answer
        return False
    return True


async def watch_agents(
    kv: KeyValue,
    js: JetStreamContext,
    nc: NATS,
    records: Callable[[], Mapping[str, GroupRecord]],
    stop: asyncio.Event,
    known: asyncio.Event,
    *,
    probe_s: float = 2.0,
    recheck_s: float = 2.0,
    start_grace_s: float = 2.0,
    counts: AgentLiveness | None = None,
) -> None:
    """Until ``stop``: publish ``AgentLost`` for each node whose key goes away and whose agent does not answer within
    ``probe_s``. ``known`` is set once the bucket's current keys were read; the nodes the records name without a key
    then are asked ``start_grace_s`` later."""
    alive: set[str] = set()
    suspects: dict[str, float] = {}  # node → when to ask it (again): its key is gone
    answering: set[str] = set()  # suspects that answered (counted and logged once each)
    counts = counts if counts is not None else AgentLiveness()

    def suspect_named(now: float) -> None:
        """At start: the nodes the records name without a key, asked after ``start_grace_s`` (an agent starting
        beside this orchestrator writes its key first, then subscribes)."""
        for node in referenced_nodes(records().values()) - alive:
            suspects.setdefault(node, now + start_grace_s)

    async def ask_due() -> None:
        now = time.monotonic()
        due = [n for n, at in suspects.items() if at <= now][:MAX_PROBES]
        if not due:
            return
        answers = await asyncio.gather(*(agent_answers(nc, n, probe_s) for n in due))
        for node, answered in zip(due, answers, strict=True):
            if node not in suspects:  # its key came back meanwhile
                continue
            if answered:
                if node not in answering:
                    answering.add(node)
                    counts.answered_without_key += 1
                    log.warning(
                        "agent key gone, the agent answers: not lost; asked again every %.1f s until its key is back",
                        recheck_s,
                        extra={"node": node},
                    )
                suspects[node] = time.monotonic() + recheck_s
            else:
                del suspects[node]
                answering.discard(node)
                counts.lost += 1
                await publish_agent_lost(js, records(), node)

    status = await kv.status()
    watcher = await kv.watchall()
    initial = status.values > 0
    try:
        if not initial:  # no key at all: every node the records name is suspect
            suspect_named(time.monotonic())
            known.set()
        while not stop.is_set():
            try:
                entry = await watcher.updates(timeout=1)  # type: ignore[no-untyped-call]
            except Exception:  # the nats-py watcher raises its own timeout type
                entry = None
            if entry is not None:
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    if entry.key in alive or initial is False:
                        alive.discard(entry.key)
                        suspects.setdefault(entry.key, 0.0)
                else:
                    alive.add(entry.key)
                    suspects.pop(entry.key, None)
                    answering.discard(entry.key)
                if initial and entry.delta == 0:
                    initial = False
                    suspect_named(time.monotonic())
                    known.set()
            await ask_due()
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
