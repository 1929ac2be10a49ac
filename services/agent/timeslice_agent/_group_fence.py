"""A group's epoch as its record in KV ``groups`` tells it: where a job registering afresh on this node starts its
fence (``Operations.fence_for_new_job``). Only the orchestrator writes the bucket, but what the agent reads there is
still checked: a record it cannot read leaves the fence to what the agent saw itself, with a warning."""

from __future__ import annotations

import logging

import msgspec
from timeslice_client.protocol import decode_record

__all__ = ["record_epoch"]

log = logging.getLogger("timeslice.agent")


def record_epoch(data: bytes | None, group: str, node: str) -> int:
    """The epoch of ``group``'s stored record ``data`` (None: no record, a group never granted: 0)."""
    if data is None:
        return 0
    try:
        rec = decode_record(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning(
            "the group's record in KV groups is unreadable (%s); a job registering in it starts at the epoch this "
            "agent saw last",
            exc,
            extra={"node": node, "group": group},
        )
        return 0
    if rec.group != group:
        log.warning(
            "the record under the group's key names group %r; a job registering in it starts at the epoch this agent "
            "saw last",
            rec.group,
            extra={"node": node, "group": group},
        )
        return 0
    return max(0, rec.epoch)
