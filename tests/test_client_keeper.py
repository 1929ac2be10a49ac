"""The client's keeper renews a waiter's place and a holder's lease on time, woken by an alarm rather than at
once on every acquire (which would put its work in the window where the orchestrator answers)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg
from timeslice_client import AsyncTimeSliceClient
from timeslice_client.bus import connect
from timeslice_client.protocol import Renew, decode_input, subjects

from .helpers import subscribed

pytestmark = pytest.mark.usefixtures("orchestrator")


class _Renewals:
    """Counts the Renew messages a job publishes (waiting ones carry no epoch, holding ones do)."""

    def __init__(self) -> None:
        self.waiting = 0
        self.holding = 0
        self.changed = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        ev = decode_input(msg.data)
        assert isinstance(ev, Renew)
        if ev.epoch is None:
            self.waiting += 1
        else:
            self.holding += 1
        self.changed.set()

    async def until(self, *, waiting: int = 0, holding: int = 0, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while self.waiting < waiting or self.holding < holding:
                self.changed.clear()
                await self.changed.wait()


@contextlib.asynccontextmanager
async def _renewals(nats_url: str, group: str, job: str) -> AsyncIterator[_Renewals]:
    """Counts ``job``'s Renew messages in ``group`` while the block runs (subscribed before it starts)."""
    nc = await connect(nats_url)
    try:
        renewals = _Renewals()
        await subscribed(nc, subjects.job(group, job, "renew"), renewals.on_msg)
        yield renewals
    finally:
        await nc.close()


async def test_waiting_place_is_renewed_past_its_ttl(nats_url: str) -> None:
    async with (
        _renewals(nats_url, "gk1", "b") as renewals,
        AsyncTimeSliceClient("a", "gk1", nats_url) as a,
        # A 0.3 s place: dropped by the orchestrator unless renewed every 0.1 s.
        AsyncTimeSliceClient("b", "gk1", nats_url, waiter_ttl_s=0.3) as b,
    ):
        ga = await a.acquire(timeout=10)
        wait = asyncio.create_task(b.acquire(timeout=30))
        await renewals.until(waiting=8)  # well past two TTLs
        assert not wait.done(), "the waiter lost its place although it renewed it"
        await a.release()
        gb = await asyncio.wait_for(wait, 10)
        assert gb.epoch == ga.epoch + 1
        await b.release()


async def test_lease_is_renewed_after_quick_cycles(nats_url: str) -> None:
    async with (
        _renewals(nats_url, "gk2", "a") as renewals,
        AsyncTimeSliceClient("a", "gk2", nats_url, lease_s=1, confirm_s=0.3) as a,
    ):
        for _ in range(3):  # grants that come at once: the keeper is not woken for their waits
            await a.acquire(timeout=10)
            await a.release()
        g = await a.acquire(timeout=10)
        await renewals.until(holding=4)  # renewed every third of the lease: held past the whole lease
        assert a.holding
        r = await a.release()
        assert r.epoch == g.epoch
