"""The orchestrator's catch-up after a restart: the inputs stored after the durable consumer's ack floor.

Reads with an ordered consumer (no acks, flow control, gaps detected and re-read) filtered on one subject,
``subjects.all_events``, which holds every input: nats-server reads stored messages for a consumer with several
filter subjects (the durable's ``subjects.inputs``) about 10x slower than for one (measured with 2.15.1: ~4k vs
~45k messages/s), and this backlog is what delays the first grant after a crash. Other subjects (notices,
commands) are dropped here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from timeslice_client.protocol import STREAM, subjects

from ._delivery import delivery, first, is_input
from ._errors import OrchestratorError

__all__ = ["catch_up"]

log = logging.getLogger("timeslice.orchestrator")


async def catch_up(js: JetStreamContext, floor: int, on_input: Callable[[Msg], Awaitable[None]],
                   stop: asyncio.Event, *, idle_s: float, pending_limit: int) -> int:
    """Pass every input stored after ``floor``, up to the stream's end when called, to ``on_input``, in order;
    returns the last sequence read. Raises ``OrchestratorError`` when nothing arrives for ``idle_s``; returns
    early once ``stop`` is set."""
    head = (await js.stream_info(STREAM)).state.last_seq
    if head <= floor:
        return floor
    last = floor
    done = asyncio.Event()
    progress = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        nonlocal last
        if done.is_set():
            return  # read past the end: the durable delivers it again
        try:
            seq, _, pending = delivery(msg.reply)
        except (ValueError, IndexError):
            return
        if seq <= last:
            return  # read again after the ordered consumer restarted at a gap: already applied
        if is_input(msg.subject):
            await on_input(msg)
        last = seq
        progress.set()
        if seq >= head or pending == 0:
            done.set()

    t0 = time.perf_counter()
    sub = await js.subscribe(subjects.all_events, stream=STREAM, cb=on_msg, ordered_consumer=True,
                             config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                                   opt_start_seq=floor + 1),
                             pending_msgs_limit=pending_limit)
    try:
        while not done.is_set() and not stop.is_set():
            progress.clear()
            try:
                async with asyncio.timeout(idle_s):
                    await first(progress.wait(), done.wait(), stop.wait())
            except TimeoutError:
                raise OrchestratorError(
                    f"catching up from stream sequence {floor + 1} stalled at {last} (the stream's end was "
                    f"{head}): nothing arrived for {idle_s} s; is nats-server healthy?"
                ) from None
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    log.info("caught up from stream sequence %d to %d in %.3f s", floor + 1, last, time.perf_counter() - t0)
    return last
