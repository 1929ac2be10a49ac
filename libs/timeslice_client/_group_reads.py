"""Reading the ``groups`` bucket for a client: its KV handle and one group's record, with errors that tell a
missing bucket (no orchestrator ran on this bus) from a bus that did not answer (a NATS election), by type; and a
read that waits (bounded) for the record to reflect a stream sequence, which is how ``status()`` reads its writes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from .errors import Unavailable
from .protocol import GROUPS_BUCKET, GroupRecord, decode_record

__all__ = ["groups_kv", "read_after", "read_record"]

T = TypeVar("T")

# read_after's pauses between reads: the first short (a record is stored well under a millisecond after the answer
# it trails), doubling up to the last (a store held up by a NATS election takes seconds: no need to ask 1000 times).
_FIRST_PAUSE_S = 0.0005
_LAST_PAUSE_S = 0.05


async def groups_kv(js: JetStreamContext, nats_url: str) -> KeyValue:
    """The ``groups`` bucket. Raises Unavailable saying whether it is missing or the bus did not answer."""
    try:
        return await js.key_value(GROUPS_BUCKET)
    except BucketNotFoundError as exc:
        raise Unavailable("the `groups` bucket is missing (start the orchestrator first)", nats_url=nats_url) from exc
    except Exception as exc:  # no answer (a NATS cluster electing a leader answers nothing for seconds)
        raise Unavailable(f"the `groups` bucket could not be read ({exc!r}); retry", nats_url=nats_url) from exc


async def read_record(kv: KeyValue, group: str, nats_url: str) -> GroupRecord:
    """``group``'s record (a group never written, or deleted, reads as a fresh one: IDLE at epoch 0)."""
    try:
        entry = await kv.get(group)
    except (KeyNotFoundError, KeyDeletedError):
        return GroupRecord(group=group)
    except Exception as exc:
        raise Unavailable(f"reading group {group!r} failed ({exc!r})", nats_url=nats_url) from exc
    return decode_record(entry.value) if entry.value else GroupRecord(group=group)


async def read_after(
    read: Callable[[], Awaitable[T]], seq: Callable[[T], int], floor: int, within_s: float
) -> tuple[T, bool]:
    """``read()`` until ``seq`` of what it read is at least ``floor`` (a record's ``last_seq``: it reflects the input at
    that stream sequence), pausing a little longer after each read, for at most ``within_s``. The last read, and
    whether it got there (False: the freshest one found by then). ``floor`` 0 is one read. Polled, not watched: a
    job's identity may read the bucket but may not make the consumer a watch needs (docs/security.md)."""
    found = await read()
    if seq(found) >= floor:
        return found, True
    deadline = time.monotonic() + within_s
    pause = _FIRST_PAUSE_S
    while (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(pause, left))
        pause = min(2 * pause, _LAST_PAUSE_S)
        found = await read()
        if seq(found) >= floor:
            return found, True
    return found, False
