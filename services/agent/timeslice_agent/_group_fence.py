"""A group's epoch as its record in KV ``groups`` tells it: where a job registering afresh on this node starts its
fence (``Operations.fence_for_new_job``). Only the orchestrator writes the bucket, but what the agent reads there is
still checked, as a job context read back from KV is (``JobBook._readable``): a record it cannot use is logged,
counted (``timeslice_agent_refused_total{source="kv"}``) and leaves the fence to what the agent saw itself."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
from timeslice_client.protocol import decode_record

from ._errors import Refusal, Refused
from ._untrusted import MAX_EPOCH, shown

__all__ = ["record_epoch"]

log = logging.getLogger("timeslice.agent")


def record_epoch(data: bytes | None, group: str, node: str, refused: Callable[[Refusal], None]) -> int:
    """The epoch of ``group``'s stored record ``data`` (None: no record, a group never granted: 0; a record this agent
    cannot use: 0, refused)."""
    if data is None:
        return 0
    try:
        try:
            rec = decode_record(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Refused(Refusal.UNDECODABLE, f"undecodable: {shown(str(exc), 300)}") from None
        if rec.group != group:
            raise Refused(Refusal.WRONG_SUBJECT, f"it names group {shown(rec.group)}")
        if not 0 <= rec.epoch <= MAX_EPOCH:
            raise Refused(Refusal.OUT_OF_RANGE, f"its epoch {shown(rec.epoch)} is not in 0..{MAX_EPOCH}")
    except Refused as exc:
        refused(exc.code)
        log.warning(
            "the group's record in KV groups is not used: %s; a job registering in it starts at the epoch this agent "
            "saw last",
            exc,
            extra={"node": node, "group": group},
        )
        return 0
    return rec.epoch
