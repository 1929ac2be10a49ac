"""Groups the orchestrator stopped serving because their record is unusable, and where that is recorded.

A quarantined group's inputs are refused with ``ErrorCode.QUARANTINED`` while every other group goes on. The fact
goes into the stream (``Quarantined`` on ``ts.v1.group.<group>.quarantine``, which ``timeslice status`` reads),
into the metrics (``timeslice_groups_quarantined``) and into the log. An operator repairs the record, or deletes
it (the group then starts afresh, above the last epoch the stream shows for it: ``_records.fresh_record``),
and restarts the orchestrator; a group that then loads is announced as lifted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from timeslice_client.protocol import (
    STREAM,
    Acquire,
    ErrorCode,
    InputEvent,
    Quarantined,
    Refused,
    Release,
    Renew,
    encode,
    subjects,
)

from .metrics import OrchestratorMetrics

__all__ = ["Quarantine", "read_quarantined"]

log = logging.getLogger("timeslice.orchestrator")

_decoder = msgspec.json.Decoder(Quarantined)


class Quarantine:
    def __init__(self, nc: NATS, metrics: OrchestratorMetrics) -> None:
        self._nc = nc
        self._metrics = metrics
        self.groups: dict[str, str] = {}

    async def add(self, group: str, reason: str) -> None:
        self.groups[group] = reason
        self._metrics.quarantined = len(self.groups)
        log.error("group %s quarantined: %s; every other group goes on", group, reason, extra={"group": group})
        await self._record(Quarantined(group=group, reason=reason[:512]))

    async def refuse(self, group: str, ev: InputEvent, reason: str) -> None:
        """Tell the job behind an input to a quarantined group why it is not served (``ErrorCode.QUARANTINED``)."""
        if isinstance(ev, Acquire | Release | Renew):
            await self._nc.publish(
                subjects.notice(group, ev.job),
                encode(
                    Refused(
                        group=group, job=ev.job, request_id=ev.request_id, code=ErrorCode.QUARANTINED, message=reason
                    )
                ),
            )

    async def lift_stale(self, loaded: set[str], timeout_s: float = 5.0) -> None:
        """Announce as lifted every group the stream shows quarantined that loaded fine this time."""
        try:
            async with asyncio.timeout(timeout_s):
                shown = await read_quarantined(self._nc.jetstream())
        except Exception as exc:
            log.warning("could not read the quarantined groups from the stream: %r", exc)
            return
        for group in sorted(set(shown) & loaded - set(self.groups)):
            log.info("group %s: its record loads again; quarantine lifted", group, extra={"group": group})
            await self._record(Quarantined(group=group, reason="the record loads again", lifted=True))

    async def _record(self, fact: Quarantined) -> None:
        js = self._nc.jetstream()
        with contextlib.suppress(Exception):  # the log and the metric have it already
            await js.publish(subjects.group_quarantine(fact.group), encode(fact), timeout=2)


async def read_quarantined(js: JetStreamContext) -> dict[str, str]:
    """The groups whose latest ``Quarantined`` fact in the stream is not lifted, with the reason."""
    info = await js.stream_info(STREAM, subjects_filter=subjects.quarantines)
    out: dict[str, str] = {}
    for subject in sorted((info.state.subjects or {}).keys())[:1000]:
        msg = await js.get_last_msg(STREAM, subject)
        if msg.data is None:
            continue
        try:
            fact = _decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if not fact.lifted:
            out[fact.group] = fact.reason
    return out
