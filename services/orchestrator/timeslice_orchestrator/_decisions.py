"""How the orchestrator publishes what the core decided for one input: notices, agent commands, state changes.

Apart from the service's shell because this is the one place the order of a decision's messages is kept (the
core's: a ``Released``/``Revoked`` always precedes the next ``Granted``, so the stream alone shows that holds never
overlap; ``invariants.StreamChecker`` checks it), and the one place a command is handed to the agent running
beside the orchestrator (``LocalAgent.take``) before it is published.
"""

from __future__ import annotations

import asyncio
import functools

from nats.aio.client import Client as NATS
from timeslice_client.protocol import NOTICE_SEQ_HEADER, encode, subjects

from ._in_process_agent import LocalAgent
from .core import Action, Command, Notify, Transition

__all__ = ["publish_decisions"]

# On the hot path: the same few subjects again and again, each validated once.
_notice_subject = functools.lru_cache(maxsize=16_384)(subjects.notice)


async def publish_decisions(nc: NATS, local: LocalAgent | None, group: str, actions: list[Action], seq: int) -> None:
    """Publish ``group``'s ``actions`` in the core's order; a command for ``local``'s node is handed to it first.
    ``seq``: the stream sequence of the input that decided them, carried by each notice (``NOTICE_SEQ_HEADER``): its
    record is stored with that ``last_seq`` (or a later one), so its job's ``status()`` knows what to wait for."""
    published: asyncio.Event | None = None  # only with an agent beside: nothing more per batch without one
    if local is not None:
        published = asyncio.Event()
        # Handed over before the publishes below: the operation's first step runs once this callback yields
        # (normally after everything here is buffered, so that step finds ``published`` set and goes on at
        # once), and it writes nothing before ``published`` is set, so the stream stores the command first.
        # Its writes (the job's mark, OpStarted, the request to the workload) then join these in the
        # connection's next socket write instead of one write later.
        for a in actions:
            if isinstance(a, Command) and a.command.node == local.node:
                local.take(a.command, published)
    # In the core's order: a Released/Revoked always precedes the next Granted, so the stream alone
    # shows that holds never overlap (invariants.StreamChecker checks it).
    headers: dict[str, str] | None = None
    try:
        for a in actions:
            if isinstance(a, Notify):
                headers = headers or {NOTICE_SEQ_HEADER: str(seq)}
                await nc.publish(_notice_subject(group, a.notice.job), encode(a.notice), headers=headers)
            elif isinstance(a, Command):
                await nc.publish(subjects.agent_cmd(a.command.node), encode(a.command))
            elif isinstance(a, Transition):
                await nc.publish(subjects.group_state(group), encode(a.change))
    finally:
        if published is not None:
            published.set()
