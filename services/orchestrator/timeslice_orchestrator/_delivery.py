"""What the orchestrator reads off a JetStream delivery: its stream sequence, time and backlog (from the
reply subject), whether its subject is an input, and the group and job an input subject names; and
``first``, a wait on whichever of several events comes first."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from timeslice_client.protocol import subjects

from ._subjects import route, subject_matches

__all__ = ["delivery", "delivery_with_consumer_seq", "first", "is_input", "route", "seq_and_time"]


def seq_and_time(reply: str) -> tuple[int, int]:
    """Stream sequence and stream timestamp (ms) from a JetStream delivery's reply subject."""
    seq, ts, _ = delivery(reply)
    return seq, ts


def delivery(reply: str) -> tuple[int, int, int]:
    """Stream sequence, stream timestamp (ms) and messages still pending after this one, from a
    JetStream delivery's reply subject."""
    seq, ts, pending, _ = delivery_with_consumer_seq(reply)
    return seq, ts, pending


def delivery_with_consumer_seq(reply: str) -> tuple[int, int, int, int]:
    """``delivery`` and the consumer's own sequence of the message (rising by one per message the consumer
    delivers: a jump means deliveries that never arrived)."""
    t = reply.split(".")
    if len(t) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(t[5]), int(t[7]) // 1_000_000, int(t[8]), int(t[6])
    # $JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[.<token>]
    return int(t[7]), int(t[9]) // 1_000_000, int(t[10]), int(t[8])


_INPUT_PREFIXES: tuple[str, ...] = tuple(f.split("*", 1)[0].removesuffix(">") for f in subjects.inputs)


def is_input(subject: str) -> bool:
    """Whether the durable consumer (filtered on ``subjects.inputs``) would deliver ``subject``; the
    prefix test first, as most of what the catch-up reads is notices."""
    return subject.startswith(_INPUT_PREFIXES) and any(subject_matches(f, subject) for f in subjects.inputs)


async def first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Wait until the first of ``waits`` finishes; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
