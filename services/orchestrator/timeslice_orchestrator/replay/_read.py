"""Read the ``TIMESLICE`` stream for a replay: every message from the head up to a moment, in order."""

from __future__ import annotations

import asyncio
from typing import Final

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError
from timeslice_client.bus import connect
from timeslice_client.protocol import STREAM, subjects

from .._delivery import seq_and_time  # the orchestrator's own arithmetic: the fold sees the `now` it saw
from .._errors import ReplayError
from ._fold import group_of
from ._model import StreamEvent

__all__ = ["MAX_EVENTS", "ReplayError", "read_window", "seq_and_time"]

MAX_EVENTS: Final = 5_000_000  # ~1-2 GB of Python objects at most; a replay beyond it needs --until


async def read_window(
    nats_url: str | None,
    *,
    group: str | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
    timeout: float = 30.0,
    max_events: int = MAX_EVENTS,
) -> list[StreamEvent]:
    """The stream's messages in stream order, from its first message to ``until_ms`` (or its last message
    as of the call), of ``group`` only if given.

    The history before ``since_ms`` is included on purpose: the fold needs it to know the state at
    ``since_ms`` (who held, who waited); :func:`fold_events` with the same ``since_ms`` shows only the
    window. Reads through an ordered ephemeral consumer; bounded by ``timeout`` seconds in all and by
    ``max_events`` messages (beyond it: :class:`ReplayError`, narrow the window with ``until_ms``).
    """
    del since_ms  # the window's start does not change what must be read; see the docstring
    nc = await connect(nats_url, name="timeslice-replay")
    try:
        js = nc.jetstream()
        try:
            info = await js.stream_info(STREAM)
        except NotFoundError as exc:
            raise ReplayError(
                f"stream {STREAM} does not exist on {nats_url or 'the default server'}: "
                "nothing was ever recorded there (is the orchestrator running against it?)"
            ) from exc
        first, last = info.state.first_seq, info.state.last_seq
        out: list[StreamEvent] = []
        if last == 0 or last < first:
            return out
        sub = await js.subscribe(
            subjects.all_events, stream=STREAM, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
        )
        try:
            async with asyncio.timeout(timeout):
                while True:
                    msg = await sub.next_msg(timeout=timeout)
                    seq, ts = seq_and_time(msg.reply)
                    if seq > last or (until_ms is not None and ts > until_ms):
                        break
                    if group is None or group_of(msg.subject, msg.data) == group:
                        out.append(StreamEvent(seq=seq, ts_ms=ts, subject=msg.subject, data=msg.data))
                        if len(out) > max_events:
                            raise ReplayError(
                                f"more than {max_events} messages to replay: pass an earlier "
                                "--until or a --group to read less"
                            )
                    if seq >= last:
                        break
        except (TimeoutError, NatsTimeout) as exc:
            raise ReplayError(
                f"reading stream {STREAM} took longer than {timeout} s "
                f"({len(out)} of up to {last - first + 1} messages read): retry with a longer "
                "timeout or a narrower window"
            ) from exc
        finally:
            await sub.unsubscribe()
        return out
    finally:
        await nc.close()
