"""The orchestrator's catch-up after a restart: the inputs stored after the durable consumer's ack floor.

Reads with an ordered consumer (no acks, flow control, gaps detected and re-read) filtered on one subject,
``subjects.all_events``, which holds every input: nats-server reads stored messages for a consumer with several
filter subjects (the durable's ``subjects.inputs``) about 10x slower than for one (measured with 2.15.1: ~4k vs
~45k messages/s; docs/nats.md), and this backlog is what delays the first grant after a crash. Other subjects
(notices, commands) are dropped here.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from timeslice_client.protocol import STREAM, subjects

from ._delivery import delivery, first, is_input
from ._errors import ServiceFailed

__all__ = ["ack_floor", "api_error", "bind_durable", "catch_up", "failure", "fill_gap"]

log = logging.getLogger("timeslice.orchestrator")


async def catch_up(
    js: JetStreamContext,
    floor: int,
    on_input: Callable[[Msg], Awaitable[None]],
    stop: asyncio.Event,
    *,
    idle_s: float,
    pending_limit: int,
) -> int:
    """Pass every input stored after ``floor``, up to the stream's end when called, to ``on_input``, in order;
    returns the last sequence read. Raises ``ServiceFailed`` when nothing arrives for ``idle_s``; returns
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
    sub = await js.subscribe(
        subjects.all_events,
        stream=STREAM,
        cb=on_msg,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=floor + 1),
        pending_msgs_limit=pending_limit,
    )
    try:
        while not done.is_set() and not stop.is_set():
            progress.clear()
            try:
                async with asyncio.timeout(idle_s):
                    await first(progress.wait(), done.wait(), stop.wait())
            except TimeoutError:
                raise ServiceFailed(
                    f"catching up from stream sequence {floor + 1} stalled at {last} (the stream's end was "
                    f"{head}): nothing arrived for {idle_s} s; is nats-server healthy?"
                ) from None
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    log.info("caught up from stream sequence %d to %d in %.3f s", floor + 1, last, time.perf_counter() - t0)
    return last


async def bind_durable(
    js: JetStreamContext,
    nc: NATS,
    durable: str,
    after: int,
    cb: Callable[[Msg], Awaitable[None]],
    *,
    ack_wait_s: float,
    max_ack_pending: int,
) -> Any:
    """(Re)create the orchestrator's durable push consumer at stream sequence ``after + 1`` (everything up to
    ``after`` is acknowledged) delivering to ``cb``; returns the subscription."""
    with contextlib.suppress(NotFoundError):
        await js.delete_consumer(STREAM, durable)
    deliver = nc.new_inbox()
    sub = await nc.subscribe(deliver, cb=cb, pending_msgs_limit=max_ack_pending * 2)
    await asyncio.sleep(0)  # let the SUB reach the socket before the flush (docs/nats.md: flush is no barrier)
    await nc.flush()
    cfg = ConsumerConfig(
        durable_name=durable,
        description="timeslice orchestrator inputs",
        deliver_subject=deliver,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE if after else DeliverPolicy.ALL,
        opt_start_seq=after + 1 if after else None,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_ack_pending=max_ack_pending,
        filter_subjects=list(subjects.inputs),
    )
    await js.add_consumer(STREAM, cfg)
    log.info("consuming from stream sequence %d", after + 1)
    return sub


async def ack_floor(js: JetStreamContext, durable: str) -> int:
    """The stream sequence up to which the durable consumer acknowledged every input (0: no such consumer yet)."""
    try:
        info = await js.consumer_info(STREAM, durable)
    except NotFoundError:
        return 0
    return info.ack_floor.stream_seq if info.ack_floor and info.ack_floor.stream_seq else 0


async def fill_gap(
    js: JetStreamContext,
    nc: NATS,
    after: int,
    before: int,
    on_input: Callable[[Msg], Awaitable[None]],
    *,
    max_span: int = 256,
) -> bool:
    """Pass the inputs stored between stream sequences ``after`` and ``before`` (both excluded) to ``on_input``, in
    order, read one by one from the stream: the deliveries a clustered consumer lost in flight when its leader
    failed over (the durable redelivers them after its ack wait; applied already by then, they are only
    acknowledged). Each is passed as a delivery (its stream sequence and time in the reply subject, as the consumer
    would give them), not acknowledged. False, having passed nothing, when the span is wider than ``max_span`` or a
    read fails (the stream is still electing): the caller catches up from the ack floor instead."""
    if before - after - 1 > max_span:
        return False
    found: list[Msg] = []
    for seq in range(after + 1, before):
        try:
            raw = await js.get_msg(STREAM, seq)
        except NotFoundError:
            continue  # removed by the stream's limits: nothing to apply
        except Exception as exc:
            log.warning(
                "stream sequence %d could not be read to fill a gap of deliveries: %r%s", seq, exc, api_error(exc)
            )
            return False
        if raw.subject is None or raw.time is None or not is_input(raw.subject):
            continue
        ts_ns = (raw.time - _EPOCH) // datetime.timedelta(microseconds=1) * 1000
        found.append(
            Msg(nc, subject=raw.subject, reply=f"$JS.ACK.{STREAM}.gap.1.{seq}.0.{ts_ns}.0", data=raw.data or b"")
        )
    for msg in found:
        await on_input(msg)
    log.info(
        "filled a gap of deliveries from the stream: %d inputs between sequences %d and %d", len(found), after, before
    )
    return True


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def api_error(exc: BaseException) -> str:
    """A JetStream API error's code and description (their repr is empty), for a log line: ``": 10013 ..."``."""
    code, text = getattr(exc, "err_code", None), getattr(exc, "description", None)
    return f": {code} {text}" if code or text else ""


def failure(exc: BaseException) -> str:
    """What failed, for a log line: each error of an exception group (at most 4) with its JetStream code
    (``api_error``) and the last call of timeslice's own code it came from (``in _ack_floor``), since a bus error's
    repr alone does not say which request it answered."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        elif len(leaves) < 4:
            leaves.append(e)

    walk(exc)
    parts = []
    for e in leaves:
        ours = [f for f in traceback.extract_tb(e.__traceback__) if "timeslice_" in f.filename]
        where = f" in {ours[-1].name} ({ours[-1].filename.rsplit('/', 1)[-1]}:{ours[-1].lineno})" if ours else ""
        parts.append(f"{e!r}{api_error(e)}{where}")
    return "; ".join(parts)
