"""The client's keeper: the background task that renews its waits and its hold (see ``AsyncTimeSliceClient``).

A function of the client, not a method, so that the client's module stays one job: the calls a job makes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from ._publish_rules import request_id
from .errors import Unavailable
from .protocol import Renew

if TYPE_CHECKING:
    from ._async_client import AsyncTimeSliceClient

__all__ = ["keep"]

log = logging.getLogger("timeslice.client")


async def keep(self: AsyncTimeSliceClient) -> None:
    """Renew waiters' places and the holder's lease, each a third of its window ahead; a hold whose lease this
    client can no longer prove is lost (``_Hold.alive``)."""
    while True:
        self._wake.clear()  # before looking, so a wake-up during the renewals below is not lost
        now = time.monotonic()
        nxt = now + 3600
        force, self._renew_now = self._renew_now, False
        for rid, due in list(self._waiting.items()):
            next_due = due
            if due <= now or force:
                self._waiting[rid] = next_due = now + self.waiter_ttl_ms / 3000
                await _renew(self, Renew(group=self.group_id, job=self.job_id, request_id=rid))
            nxt = min(nxt, next_due)
        hold = self._hold
        if hold is not None and hold.alive(now):
            if hold.next_renew <= now or force:
                hold.next_renew = now + hold.lease_ms / 3000
                rid, sent = request_id(), time.monotonic()
                hold.renew_ids.append(rid)
                if await _renew(self, Renew(group=self.group_id, job=self.job_id, request_id=rid, epoch=hold.epoch)):
                    hold.renewal_stored(sent)
            nxt = min(nxt, hold.next_renew, hold.valid_until)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, nxt - time.monotonic())):
                await self._wake.wait()


async def _renew(self: AsyncTimeSliceClient, msg: Renew) -> bool:
    """Whether the stream stored it."""
    try:
        await self._publish(msg)
    except Unavailable as exc:
        log.warning("renewal not delivered: %s", exc, extra={"group": self.group_id, "job": self.job_id})
        return False
    return True
