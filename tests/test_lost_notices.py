"""Notices are core NATS (at most once): a job cut off from the bus when its grant is published never gets that
notice. The grant must reach it all the same once it hears again, and the group must not stall meanwhile.

Each client's connection runs through a TCP proxy on 127.0.0.1 whose ``cut()`` drops it (the server sees the
client go, the client reconnects once the proxy lets it)."""

from __future__ import annotations

import asyncio
import time

import pytest
from timeslice_client import AsyncTimeSliceClient, LeaseExpired

from .agent_harness import queue_behind
from .helpers import eventually
from .tcp_proxy import tcp_proxy

pytestmark = pytest.mark.usefixtures("orchestrator")

CUT_S = 1.0  # how long the connection stays cut (the fault's duration, not a wait for something)


async def test_a_waiter_cut_off_at_its_grant_is_granted_once_it_hears_again(nats_url: str) -> None:
    async with tcp_proxy(nats_url) as proxy:
        a = await AsyncTimeSliceClient("a", "lost1", nats_url).connect()
        b = await AsyncTimeSliceClient("b", "lost1", proxy.url, acquire_timeout_s=40).connect()
        try:
            ga, wait = await queue_behind(a, b, wait_s=40)
            assert b._nc is not None
            proxy.cut()
            await eventually(lambda: not b._nc.is_connected, what="b's connection is cut")  # type: ignore[union-attr]
            await a.release()

            async def granted_to_b() -> bool:
                rec = await a.status()
                return rec.holder is not None and rec.holder.job == "b"

            await eventually(granted_to_b, what="the orchestrator granted b (its notice went to nobody)")
            await asyncio.sleep(CUT_S)
            assert not wait.done()
            proxy.restore()
            t0 = time.monotonic()
            gb = await asyncio.wait_for(wait, 5)
            took = time.monotonic() - t0
            print(f"\nb granted {took * 1000:.0f} ms after its connection came back")
            assert gb.epoch == ga.epoch + 1
            assert b.holding
            await b.release()
            # The group works on: a gets it back at once.
            g = await a.acquire(timeout=10)
            assert g.epoch == gb.epoch + 1
            await a.release()
        finally:
            await b.close()
            await a.close()


async def test_a_holder_cut_off_past_its_lease_stops_holding_before_anyone_else_is_granted(nats_url: str) -> None:
    """The same for ``Revoked``, which a cut-off holder cannot hear: its lease runs out while it cannot renew, and
    the next job is granted. The holder stops believing it holds on its own clock, when its last renewal that the
    stream stored plus its lease has passed: before the orchestrator (which counts from that renewal's stream time)
    can grant anyone else. Its release then says the lease expired; once it hears again, the group works on."""
    async with tcp_proxy(nats_url) as proxy:
        a = await AsyncTimeSliceClient("a", "lost2", proxy.url, lease_s=2, confirm_s=1).connect()
        b = await AsyncTimeSliceClient("b", "lost2", nats_url).connect()
        try:
            ga, wait = await queue_behind(a, b, wait_s=40, observer=b)
            proxy.cut()
            t_cut = time.monotonic()
            await eventually(lambda: not a._nc.is_connected, what="a's connection is cut")  # type: ignore[union-attr]
            await eventually(lambda: not a.holding, timeout=5, interval=0.01, what="a gives its hold up")
            t_lost = time.monotonic()
            assert not wait.done(), "b was granted while a still believed it held the group"
            gb = await asyncio.wait_for(wait, 10)  # a's lease (2 s) ran out while it could not renew
            t_b = time.monotonic()
            assert gb.epoch == ga.epoch + 1
            print(
                f"\na gave its hold up {t_lost - t_cut:.2f} s after the cut, {(t_b - t_lost) * 1000:.0f} ms "
                "before b was granted"
            )
            with pytest.raises(LeaseExpired):
                await a.release()
            proxy.restore()
            await b.release()
            g = await a.acquire(timeout=10)  # heard again: the group works on
            assert g.epoch == gb.epoch + 1
            await a.release()
        finally:
            await b.close()
            await a.close()
