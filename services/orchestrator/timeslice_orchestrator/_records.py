"""The group records in KV ``groups``: reading them at start, storing them fenced by the leader's term, and telling
apart the ways a store can fail (private to the orchestrator's shell).

Fencing. A leader begins its term by writing the bucket's term marker (key ``_term``, ``TermRecord``), with a
compare-and-swap that fails if a later term wrote it already. Every record it stores afterwards is published with
``Nats-Expected-Last-Subject-Sequence-Subject: $KV.groups._term`` and the marker's sequence: the server refuses the
write as soon as another leader has begun its term (``Deposed``), whatever this process believes (it may have been
paused past its lease), so a deposed leader can store nothing. Within a term one writer per group stores its
records in order, so no per-key compare-and-swap is needed.

A record the orchestrator cannot use must never stop it: every other group goes on. So a store or a read says
*why* it failed, and the shell decides per group:

* ``Unusable``: the stored value does not decode (garbage written into the key), or the record to store is
  larger than the bus takes. The group is quarantined (``Quarantine``), the others go on.
* a record deleted or overwritten under the orchestrator is simply written again from the orchestrator's own copy
  at its next change (the copy reflects every event applied so far);
* ``Deposed``: another leader's term began; this one stops leading.
* anything else (a timeout, the server down): retried with back-off, then ``ServiceFailed``. A write that timed
  out may have landed (docs/cluster.md): the record is read again before it is written again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError
from nats.js.kv import KeyValue
from timeslice_client.protocol import (
    GROUPS_BUCKET,
    STREAM,
    GroupRecord,
    StateChanged,
    decode_record,
    encode,
    is_group_key,
    subjects,
)

from ._errors import Deposed, ServiceFailed, Unusable

__all__ = [
    "TERM_KEY",
    "Deposed",
    "Loaded",
    "RecordStore",
    "Stored",
    "TermRecord",
    "Unusable",
    "beyond_stream_end",
    "fresh_record",
    "last_epoch",
    "load_all",
]

log = logging.getLogger("timeslice.orchestrator")


class TermRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The value of the term marker ``_term`` in KV ``groups``: which leader's writes the server accepts."""

    term: int
    instance: str
    since_ms: int


TERM_KEY = "_term"  # not a group id: group ids start with a letter or digit
_TERM_SUBJECT = f"$KV.{GROUPS_BUCKET}.{TERM_KEY}"
_WRONG_LAST_SEQUENCE = 10071


@dataclass(frozen=True, slots=True)
class Stored:
    """What a read found: the record (None: the key is missing or deleted) and the key's revision."""

    record: GroupRecord | None
    revision: int | None
    undecodable: str | None = None  # why the value found there does not decode


class RecordStore:
    def __init__(
        self,
        js: JetStreamContext,
        kv: KeyValue,
        *,
        attempts: int,
        timeout_s: float,
        max_bytes: int,
        deadline_s: float = 30.0,
    ) -> None:
        self.js = js
        self.kv = kv
        self.attempts = attempts  # at least this many tries, and more until ``deadline_s`` (a cluster's election
        self.deadline_s = deadline_s  # stalls writes 4-9 s with fast failures, docs/nats.md: a count runs out in 3.5 s)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes  # the largest record stored; set well below the server's max_payload
        self._term: int | None = None
        self._fence: dict[str, str] = {}

    async def begin_term(self, term: int, instance: str) -> None:
        """Write the term marker: from now on only this term's writes are accepted. ``Deposed`` when a later term
        (or this one, from another instance) wrote it first."""
        seq, found = await self._read_term()
        if found is not None and (found.term, found.instance) == (term, instance):
            self._begin(term, seq)  # this instance's own term, begun again (after it lapsed and was confirmed)
            return
        if found is not None and found.term >= term:
            raise Deposed(term, f"the term marker names term {found.term} of {found.instance}")
        data = msgspec.json.encode(TermRecord(term=term, instance=instance, since_ms=int(time.time() * 1000)))
        try:
            pa = await self.js.publish(
                _TERM_SUBJECT, data, timeout=self.timeout_s, headers={"Nats-Expected-Last-Subject-Sequence": str(seq)}
            )
        except APIError as exc:
            if exc.err_code == _WRONG_LAST_SEQUENCE:
                raise Deposed(term, "another term marker was written first") from exc
            raise
        self._begin(term, int(pa.seq))

    def _begin(self, term: int, marker_seq: int) -> None:
        self._term = term
        self._fence = {
            "Nats-Expected-Last-Subject-Sequence": str(marker_seq),
            "Nats-Expected-Last-Subject-Sequence-Subject": _TERM_SUBJECT,
        }

    async def _read_term(self) -> tuple[int, TermRecord | None]:
        try:
            async with asyncio.timeout(self.timeout_s):
                msg = await self.js.get_last_msg(f"KV_{GROUPS_BUCKET}", _TERM_SUBJECT)
        except NotFoundError:
            return 0, None
        seq = int(msg.seq or 0)
        try:
            return seq, msgspec.json.decode(msg.data or b"", type=TermRecord)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return seq, None  # garbage, or deleted: overwritten by this term's marker

    async def store(self, group: str, rec: GroupRecord) -> int:
        """Store ``rec`` within this term; returns the key's new revision."""
        assert self._term is not None, "begin_term() first"
        data = encode(rec)
        if len(data) > self.max_bytes:
            raise Unusable(group, f"its record would take {len(data)} bytes, more than the {self.max_bytes} allowed")
        subject = f"$KV.{GROUPS_BUCKET}.{group}"
        deadline = time.monotonic() + self.deadline_s
        attempt = 0
        while attempt < self.attempts or time.monotonic() < deadline:
            attempt += 1
            try:
                pa = await self.js.publish(subject, data, timeout=self.timeout_s, headers=self._fence)
                return int(pa.seq)
            except APIError as exc:
                if exc.err_code == _WRONG_LAST_SEQUENCE:
                    raise Deposed(
                        self._term, f"the server refused a write of group {group!r}: another leader's term began"
                    ) from exc
                log.warning("storing group %s failed (%r), attempt %d", group, exc, attempt, extra={"group": group})
            except Exception as exc:  # a timeout is "unknown", not "failed" (docs/cluster.md): re-read below
                log.warning("storing group %s failed (%r), attempt %d", group, exc, attempt, extra={"group": group})
            stored = await self.read(group)
            if stored.record is not None and stored.record.last_seq == rec.last_seq:
                assert stored.revision is not None
                return stored.revision  # our own write, whose answer was lost
            await asyncio.sleep(min(0.05 * 2 ** min(attempt, 5), 1.0))  # back off before the next attempt
        raise ServiceFailed(
            f"could not store group {group!r} in {attempt} attempts over {self.deadline_s:.0f} s; "
            "is the NATS cluster up and does it have a stream leader?"
        )

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


@dataclass(frozen=True, slots=True)
class Loaded:
    """One key read at start: its record, or why it cannot be used (``unusable``)."""

    group: str
    record: GroupRecord | None
    revision: int
    unusable: str | None = None


async def load_all(kv: KeyValue, *, timeout_s: float = 10.0) -> list[Loaded]:
    """Every group record in the bucket. Reads until the watcher's entry with no more pending (the "initial values
    done" marker can come before the initial values: docs/nats.md)."""
    status = await kv.status()
    if status.values == 0:
        return []
    out: list[Loaded] = []
    watcher = await kv.watchall()
    try:
        while True:
            entry = await watcher.updates(timeout=timeout_s)  # type: ignore[no-untyped-call]
            if entry is None:
                continue
            if entry.operation is None and entry.value and is_group_key(entry.key):
                out.append(_loaded(entry.key, entry.value, entry.revision or 0))
            if entry.delta == 0:
                break
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]
    return out


def _loaded(key: str, value: bytes, revision: int) -> Loaded:
    try:
        rec = decode_record(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return Loaded(key, None, revision, f"its stored record does not decode ({str(exc)[:200]})")
    if rec.group != key:
        return Loaded(key, None, revision, f"its stored record names group {rec.group[:64]!r}")
    return Loaded(key, rec, revision)


async def last_epoch(js: JetStreamContext, group: str, *, timeout_s: float) -> int | None:
    """The epoch of the group's last state change in the stream (None: the stream shows none, or it cannot be
    read). A group whose record is missing starts above it, so that no epoch is ever handed out twice."""
    try:
        async with asyncio.timeout(timeout_s):
            last = await js.get_last_msg(STREAM, subjects.group_state(group))
    except NotFoundError:
        return None
    except Exception as exc:
        log.warning("group %s: could not read its last state from the stream (%r)", group, exc, extra={"group": group})
        return None
    try:
        return _state_decoder.decode(last.data or b"").epoch
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


_state_decoder = msgspec.json.Decoder(StateChanged)


async def fresh_record(js: JetStreamContext | None, group: str, *, timeout_s: float) -> GroupRecord:
    """The record of a group that has none stored: a new group, or one whose record was deleted (by hand, or after
    a quarantine). Its epochs go on above the last one the stream shows for it; the rest starts afresh."""
    assert js is not None
    epoch = await last_epoch(js, group, timeout_s=timeout_s)
    if epoch is None:
        return GroupRecord(group=group)
    log.warning(
        "group %s has no stored record but the stream shows it at epoch %d: it starts afresh from there",
        group,
        epoch,
        extra={"group": group, "epoch": epoch},
    )
    return GroupRecord(group=group, epoch=epoch)


async def beyond_stream_end(
    js: JetStreamContext, records: dict[str, GroupRecord], floor: int
) -> dict[str, GroupRecord]:
    """The records that claim to reflect stream sequences beyond the stream's end, each set back to ``floor``.

    Such a record was written against another stream (the stream was deleted and created again) or forged: with
    it, every event up to that sequence would be skipped and the group frozen. It is caught up from the ack floor
    instead, its epoch kept, so that no epoch is handed out twice."""
    head = (await js.stream_info(STREAM)).state.last_seq
    out: dict[str, GroupRecord] = {}
    for group, rec in records.items():
        if rec.last_seq > head:
            log.warning(
                "group %s: its record reflects stream sequence %d, beyond the stream's end %d (was the stream "
                "recreated?); catching it up from %d",
                group,
                rec.last_seq,
                head,
                floor + 1,
                extra={"group": group, "epoch": rec.epoch},
            )
            out[group] = msgspec.structs.replace(rec, last_seq=floor)
    return out
