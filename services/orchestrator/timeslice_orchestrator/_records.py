"""The group records in KV ``groups``: reading them at start, storing them with compare-and-swap, and telling
apart the ways a store can fail (private to the orchestrator's shell).

A record the orchestrator cannot use must never stop it: every other group goes on. So a store or a read says
*why* it failed, and the shell decides per group:

* ``Unusable``: the stored value does not decode (garbage written into the key), or the record to store is
  larger than the bus takes. The group is quarantined (``Quarantine``), the others go on.
* a record that was deleted under the orchestrator is written again from the orchestrator's own copy, which
  reflects every event applied so far (``store`` recreates the key);
* ``ForeignWriter``: a valid record with another history was written by someone else (a second orchestrator
  writing without leadership). The shell stops: it must not write beside another writer.
* anything else (a timeout, the server down): retried with back-off, then ``OrchestratorError``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgspec
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from timeslice_client.protocol import GroupRecord, decode_record, encode

from ._errors import OrchestratorError

__all__ = ["ForeignWriter", "RecordStore", "Stored", "Unusable"]

log = logging.getLogger("timeslice.orchestrator")


class Unusable(OrchestratorError):
    """A group's record cannot be used: the stored value does not decode, or the record is too large to store."""

    def __init__(self, group: str, reason: str) -> None:
        self.group = group
        self.reason = reason
        super().__init__(f"group {group!r}: {reason}")


class ForeignWriter(OrchestratorError):
    """Someone else wrote a valid record of the group: another orchestrator is writing without leadership."""

    def __init__(self, group: str, expected_rev: int | None, stored_seq: int, own_seq: int) -> None:
        self.group, self.expected_rev, self.stored_seq, self.own_seq = group, expected_rev, stored_seq, own_seq
        super().__init__(
            f"group {group!r} was written by someone else (expected revision {expected_rev}; the stored record "
            f"reflects stream sequence {stored_seq}, this orchestrator's {own_seq}); is a second orchestrator "
            "running against the same bus without leadership?"
        )


@dataclass(frozen=True, slots=True)
class Stored:
    """What a read found: the record (None: the key is missing or deleted) and the key's revision."""

    record: GroupRecord | None
    revision: int | None
    undecodable: str | None = None  # why the value found there does not decode


class RecordStore:
    def __init__(self, kv: KeyValue, *, attempts: int, timeout_s: float, max_bytes: int) -> None:
        self.kv = kv
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes  # the largest record stored; set well below the server's max_payload

    async def store(self, group: str, rec: GroupRecord, rev: int | None) -> int:
        """Store ``rec`` over revision ``rev`` (None: the key must not exist); returns the new revision."""
        data = encode(rec)
        if len(data) > self.max_bytes:
            raise Unusable(group, f"its record would take {len(data)} bytes, more than the {self.max_bytes} "
                                  "allowed")
        for attempt in range(self.attempts):
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await self.kv.update(group, data, last=rev)
            except KeyWrongLastSequenceError:
                conflict = True
            except Exception as exc:  # a timeout is "unknown", not "failed" (docs/cluster.md): re-read below
                conflict = False
                log.warning("storing group %s failed (%r), attempt %d", group, exc, attempt + 1,
                            extra={"group": group})
            stored = await self.read(group)
            if stored.record is not None and stored.record.last_seq == rec.last_seq:
                assert stored.revision is not None
                return stored.revision  # our own write, whose answer was lost
            if conflict:
                if stored.undecodable is not None or (stored.record is None and stored.revision is not None):
                    # Garbage or a deletion written under us: this orchestrator's copy reflects every event
                    # applied so far, so it is written over it (the next attempt, on the revision found).
                    log.warning("group %s: the stored record was %s; writing it again from this orchestrator's "
                                "copy", group, "garbage" if stored.undecodable else "deleted", extra={"group": group})
                    rev = stored.revision
                    continue
                if stored.record is None:
                    rev = None  # purged: no revision left to compare with
                    continue
                raise ForeignWriter(group, rev, stored.record.last_seq, rec.last_seq)
            await asyncio.sleep(min(0.05 * 2**attempt, 1.0))  # back off before the next attempt
        raise OrchestratorError(f"could not store group {group!r} after {self.attempts} attempts")

    async def read(self, group: str) -> Stored:
        """The stored record; a missing, deleted or unreadable key reads as no record."""
        try:
            async with asyncio.timeout(self.timeout_s):
                entry = await self.kv.get(group)
        except Exception as exc:
            # KeyDeletedError carries the delete marker's entry: its revision is what a rewrite compares with.
            marker = getattr(exc, "entry", None)
            return Stored(None, getattr(marker, "revision", None))
        if not entry.value:
            return Stored(None, entry.revision)
        try:
            rec = decode_record(entry.value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Stored(None, entry.revision, undecodable=str(exc)[:200])
        if rec.group != group:
            return Stored(None, entry.revision, undecodable=f"the record names group {rec.group[:64]!r}")
        return Stored(rec, entry.revision)
