"""Reading the ``groups`` bucket for a client: its KV handle and one group's record, with errors that tell a
missing bucket (no orchestrator ran on this bus) from a bus that did not answer (a NATS election), by type."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from .errors import Unavailable
from .protocol import GROUPS_BUCKET, GroupRecord, decode_record

__all__ = ["groups_kv", "read_record"]


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
