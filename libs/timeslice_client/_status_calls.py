"""The reads of ``AsyncTimeSliceClient`` (a base class of it, under ``ReleaseCalls``): ``status()``, ``list_groups()``,
and the bookkeeping that lets ``status()`` read this client's own writes.

Read-your-writes. The orchestrator answers a job first and stores the group's record after (docs/architecture.md),
so a read made right after an answer can find the record from before the call. Each record says which input it
reflects up to (``GroupRecord.last_seq``, a stream sequence), so each client keeps a *read floor*: the highest
sequence among

* its inputs that the orchestrator always stores the record at (``_RECORDED``: an acquire or claim always
  changes the record or is answered; a release is always answered; a cancel is stored even when the wait had
  ended already), taken from their PubAcks;
* the notices it heard (grants, releases, refusals, dequeues, revocations): each carries the sequence of the input
  that decided it (``NOTICE_SEQ_HEADER``), and an input that decided a notice is always stored.

Renewals and phase events do not count: they may change nothing, and an input that changes nothing is not stored
(no write per heartbeat), so a floor that counted them could wait for a record that never comes. ``status()`` of a
group waits (bounded) until the record's ``last_seq`` reaches that group's floor."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from ._group_reads import groups_kv, read_after, read_record
from ._group_status import GroupStatus, group_status
from .bus import kv_keys
from .protocol import GROUPS_BUCKET, NOTICE_SEQ_HEADER, Acquire, Cancel, GroupRecord, Release, is_group_key, validate_id

if TYPE_CHECKING:
    from ._async_client import AsyncTimeSliceClient
    from ._multi_group import JobGroups

__all__ = ["StatusCalls"]

log = logging.getLogger("timeslice.client")

# The job inputs whose stream sequence a record always comes to reflect (see the module's doc).
_RECORDED: Final = (Acquire, Release, Cancel)


class StatusCalls:
    """``status()``, ``list_groups()`` and the read floor (declared here, set by ``AsyncTimeSliceClient``)."""

    group_id: str
    job_id: str
    nats_url: str
    request_timeout_s: float
    _nc: NATS | None
    _js: JetStreamContext | None
    _kv: KeyValue | None
    _groups: JobGroups[AsyncTimeSliceClient]
    _read_floor: int
    connect: Callable[[], Awaitable[Any]]

    async def status(self, group_id: str | None = None, *, wait_s: float | None = None) -> GroupStatus:
        """What the group's lock record says (a read-only view with units in its names,
        :class:`~timeslice_client.GroupStatus`; a fresh group reads as IDLE at epoch 0), reflecting this client's own
        calls: after ``acquire()`` returned, this job is the holder; after ``release()`` returned, it is not (unless
        something happened since). The orchestrator stores records just after its answers, so the read waits for the
        record to catch up with this client's latest call of that group (its own or, with ``acquire_all``, another of
        its groups), at most ``wait_s`` (default ``request_timeout_s``; 0: no wait). Past that it returns the freshest
        record with ``stale`` set (and logs a warning) rather than fail: the orchestrator is slow to store (a NATS
        election), or stopped. Other jobs' calls show once their records are stored, as before."""
        group = validate_id("group", group_id or self.group_id)
        kv = await self._groups_kv()
        member = self._groups.members.get(group)
        floor = member._read_floor if member is not None else 0
        within = self.request_timeout_s if wait_s is None else max(0.0, wait_s)
        rec, caught_up = await read_after(lambda: read_record(kv, group, self.nats_url), _last_seq, floor, within)
        if not caught_up and within > 0:
            log.warning(
                "group %s: its stored record reflects stream sequence %d, not yet this client's last call (%d), "
                "after %.3g s; returning it marked stale",
                group,
                rec.last_seq,
                floor,
                within,
                extra={"group": group, "job": self.job_id},
            )
        return group_status(rec, stale=not caught_up)

    async def list_groups(self) -> list[str]:
        await self._groups_kv()  # Unavailable, with what to do, when the bucket is missing
        assert self._nc is not None
        keys = await kv_keys(self._nc, GROUPS_BUCKET, timeout=self.request_timeout_s)  # not kv.keys(): it can miss keys
        return [k for k in keys if is_group_key(k)]

    async def _groups_kv(self) -> KeyValue:
        await self.connect()
        if self._kv is None:
            assert self._js is not None
            self._kv = await groups_kv(self._js, self.nats_url)
        return self._kv

    async def _holder_or_none(self) -> str | None:
        rec = await self._record_or_none()
        return rec.holder.job if rec and rec.holder else None

    async def _record_or_none(self) -> GroupStatus | None:
        """The group's status as stored now, for an error message (None: not readable within a second)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1):
                return group_status(await read_record(await self._groups_kv(), self.group_id, self.nats_url))
        return None

    def _stored_input(self, msg: msgspec.Struct, seq: int) -> None:
        """``msg`` was stored in the stream at ``seq``: the read floor rises to it when the record always will."""
        if isinstance(msg, _RECORDED) and seq > self._read_floor:
            self._read_floor = seq

    def _heard(self, msg: Msg) -> None:
        """A notice came: the read floor rises to the sequence of the input that decided it."""
        raw = msg.headers.get(NOTICE_SEQ_HEADER) if msg.headers else None
        # (a stream sequence is a uint64: at most 20 digits; a longer one is no sequence, and int() of thousands of
        # digits raises)
        if raw is not None and len(raw) <= 20 and raw.isdigit() and int(raw) > self._read_floor:
            self._read_floor = int(raw)


def _last_seq(rec: GroupRecord) -> int:
    return rec.last_seq
