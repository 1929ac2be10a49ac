"""The lease key orchestrators elect their leader on, ``$KV.leader.orchestrator``: its bucket, its record, reading it.

What ``Leadership`` (in ``_leadership``) campaigns with, and what a reader without a campaign needs: ``timeslice
status`` and the benches read the current leader (``read_leader``, ``holder_pid``). Apart from the election itself
because these are facts about the key (how a record is written and decoded, what a deletion or an expiry marker
looks like, which failures mean a lost compare-and-swap), not about holding it; ``clock`` is the one clock both use
(``CLOCK_BOOTTIME`` where there is one: it keeps counting through SIGSTOP and a suspend).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import Header, KeyValueConfig, StorageType
from nats.js.errors import APIError, NotFoundError

from ._errors import LeadershipError

__all__ = [
    "LEADER_BUCKET",
    "LEADER_KEY",
    "STREAM",
    "STREAM_NOT_FOUND",
    "SUBJECT",
    "UNANSWERED",
    "LeaderRecord",
    "Seen",
    "clock",
    "default_instance_id",
    "ensure_leader_bucket",
    "holder_pid",
    "is_wrong_last",
    "read_key",
    "read_leader",
    "seen_from",
]

log = logging.getLogger("timeslice.orchestrator.leadership")

LEADER_BUCKET = "leader"
LEADER_KEY = "orchestrator"
STREAM = f"KV_{LEADER_BUCKET}"
SUBJECT = f"$KV.{LEADER_BUCKET}.{LEADER_KEY}"
WRONG_LAST_SEQ = (10071, 10164)  # a failed sequence check: a plain APIError with these codes (JSStreamWrongLastSeq*)
STREAM_NOT_FOUND = 10059
# A write that got no answer: its outcome is unknown until the key is read again (in a cluster a write that timed
# out on the client had been committed in 2 of 10 leader kills; docs/nats.md).
UNANSWERED = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError)

if hasattr(time, "CLOCK_BOOTTIME"):
    _BOOTTIME = time.CLOCK_BOOTTIME

    def clock() -> float:
        return time.clock_gettime(_BOOTTIME)
else:  # pragma: no cover - not Linux
    clock = time.monotonic


class LeaderRecord(msgspec.Struct, frozen=True):
    """The value of the lease key."""

    holder: str  # the instance id: host/pid/random
    term: int
    since_ms: int  # wall clock when this term began
    label: str = ""  # e.g. the instance's status URL


@dataclass(frozen=True, slots=True)
class Seen:
    """One state of the key: ``record`` None when absent (deleted, purged, expired)."""

    rev: int  # 0: no message at all
    record: LeaderRecord | None
    ttl_s: float | None  # the record's Nats-TTL
    at: float  # clock() when observed


def parse_ttl(value: str | None) -> float | None:
    try:
        return float(value.removesuffix("s")) if value else None
    except ValueError:
        return None


def seen_from(rev: int, headers: dict[str, str] | None, data: bytes | None) -> Seen:
    h = headers or {}
    if h.get("KV-Operation") in ("DEL", "PURGE") or "Nats-Marker-Reason" in h or not data:
        return Seen(rev, None, None, clock())
    try:
        record = msgspec.json.decode(data, type=LeaderRecord)
    except msgspec.DecodeError as exc:
        # Not ours to judge: someone wrote the key. Treat it as held (safe) until it goes away.
        log.error(  # noqa: TRY400 - the value, not a traceback, explains it
            "undecodable leader record at revision %d (%s): %r", rev, exc, data[:200]
        )
        record = LeaderRecord(holder="<undecodable>", term=0, since_ms=0)
    return Seen(rev, record, parse_ttl(h.get(Header.MSG_TTL.value)), clock())


def is_wrong_last(exc: BaseException) -> bool:
    return isinstance(exc, APIError) and exc.err_code in WRONG_LAST_SEQ


async def ensure_leader_bucket(js: JetStreamContext, *, replicas: int = 1, timeout: float = 5.0) -> None:
    """Create the ``leader`` bucket if it is missing (history 1, TTL markers, file storage, direct gets).

    An existing bucket is used as it is when it allows per-message TTLs; otherwise ``LeadershipError``."""
    async with asyncio.timeout(timeout):
        try:
            info = await js.stream_info(STREAM)
        except NotFoundError:
            try:
                await js.create_key_value(
                    KeyValueConfig(
                        bucket=LEADER_BUCKET,
                        history=1,
                        replicas=replicas,
                        storage=StorageType.FILE,
                        direct=True,
                        limit_marker_ttl=1,
                        description="timeslice orchestrator leader lease",
                    )
                )
            except APIError as exc:  # created by another instance at the same moment (10058)
                log.debug("leader bucket creation raced: %r", exc)
            info = await js.stream_info(STREAM)
    if not info.config.allow_msg_ttl:
        raise LeadershipError(
            f"the KV bucket {LEADER_BUCKET!r} exists without per-message TTLs (allow_msg_ttl); "
            f"delete it (`nats kv del {LEADER_BUCKET}`) while no orchestrator runs, then restart"
        )
    if info.config.num_replicas != replicas:
        log.warning(
            "the KV bucket %r has %s replicas, not the %d asked for: it is used as it is",
            LEADER_BUCKET,
            info.config.num_replicas,
            replicas,
        )
    if not info.config.subject_delete_marker_ttl:
        log.warning(
            "the KV bucket %r has no TTL markers (limit_marker_ttl): standbys notice a dead leader "
            "only by re-reading after the TTL",
            LEADER_BUCKET,
        )


async def read_key(js: JetStreamContext, timeout: float) -> Seen:
    async with asyncio.timeout(timeout):
        try:
            try:
                msg = await js.get_msg(STREAM, subject=SUBJECT, direct=True)
            except nats.errors.NoRespondersError:  # no such stream, or one without direct gets: ask the API
                msg = await js.get_msg(STREAM, subject=SUBJECT)
        except NotFoundError as exc:
            if exc.err_code == STREAM_NOT_FOUND:
                raise
            return Seen(0, None, None, clock())
    return seen_from(msg.seq or 0, msg.headers, msg.data)


async def read_leader(js: JetStreamContext, *, timeout: float = 2.0) -> LeaderRecord | None:
    """The current leader's record, or None when nobody holds the lease (or the bucket does not exist)."""
    try:
        return (await read_key(js, timeout)).record
    except NotFoundError:
        return None


def default_instance_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"


def holder_pid(rec: LeaderRecord | None) -> int | None:
    """The process id in a default instance id (``host/pid/random``); None for another form or no record."""
    parts = rec.holder.split("/") if rec is not None else []
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
