"""``on_accelerators()`` scopes of one client nest: only the outermost acquires and releases (issue 25, item 5).

The README shows both a decorated ``train_step`` and a ``with client.on_accelerators():`` block; calling the one
inside the other must keep the outer hold, for the async and the sync client alike."""

from __future__ import annotations

import asyncio

import pytest
from timeslice_client import AsyncTimeSliceClient, GroupState, TimeSliceClient

from .helpers import eventually

pytestmark = pytest.mark.usefixtures("orchestrator")


async def _released(c: AsyncTimeSliceClient) -> bool:
    st = await c.status()
    return st.state == GroupState.IDLE_YIELDED and st.holder is None


async def test_async_decorated_step_inside_a_block_keeps_the_hold(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "n1", nats_url) as a:

        @a.on_accelerators(timeout=10)
        async def train_step(x: int) -> int:
            assert a.holding
            return x + 1

        async with a.on_accelerators(timeout=10) as outer:
            assert await train_step(1) == 2
            assert a.holding and a.epoch == outer.epoch, "the inner scope released the outer hold"
            assert await train_step(2) == 3
            async with a.on_accelerators(timeout=10) as inner:
                assert inner == outer
            assert a.holding
            # the group's status (read after the grant: it reflects it) names a, at the outer scope's epoch
            st = await a.status()
            assert st.holder is not None and st.holder.job == "a" and st.epoch == outer.epoch, st
        # the outer exit released (and did not raise NotHolder)
        assert not a.holding
        assert await _released(a), "the group released once, by the outermost scope"
        assert (await a.status()).epoch == outer.epoch, "an inner scope took a grant of its own"
        # a decorated step alone still acquires and releases
        assert await train_step(3) == 4
        assert not a.holding


async def test_async_inner_scope_that_raises_keeps_the_hold(nats_url: str) -> None:
    class Boom(Exception):
        pass

    async with AsyncTimeSliceClient("a", "n2", nats_url) as a:
        async with a.on_accelerators(timeout=10) as outer:
            with pytest.raises(Boom):
                async with a.on_accelerators(timeout=10):
                    raise Boom
            assert a.holding and a.epoch == outer.epoch
        assert not a.holding


async def test_async_scope_borrows_a_hold_taken_with_acquire(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "n3", nats_url) as a:
        g = await a.acquire(timeout=10)
        async with a.on_accelerators(timeout=10) as inside:
            assert inside.epoch == g.epoch
        assert a.holding, "a scope released a hold it did not acquire"
        r = await a.release()
        assert r.epoch == g.epoch


async def test_async_scopes_of_two_tasks_share_one_hold(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "n4", nats_url) as a:
        first_in, first_out = asyncio.Event(), asyncio.Event()

        async def first() -> int:
            async with a.on_accelerators(timeout=10) as g:
                first_in.set()
                await asyncio.wait_for(first_out.wait(), 10)
                return g.epoch

        t = asyncio.create_task(first())
        await asyncio.wait_for(first_in.wait(), 10)
        async with a.on_accelerators(timeout=10) as g2:
            first_out.set()
            e1 = await asyncio.wait_for(t, 10)
            assert a.holding and e1 == g2.epoch, "the first task's exit released the second task's hold"
        assert not a.holding
        assert await _released(a)


def _sync_nested(nats_url: str) -> tuple[int, int, bool, bool]:
    with TimeSliceClient("s", "n5", nats_url) as s:

        @s.on_accelerators(timeout=10)
        def train_step() -> bool:
            return s.holding

        with s.on_accelerators(timeout=10) as outer:
            inside = train_step()
            still = s.holding
            with s.on_accelerators(timeout=10) as inner:
                assert inner == outer
            # the group's status (read after the grant: it reflects it) names s, at the outer scope's epoch
            r = s.status()
            held_epoch = r.epoch if r.holder is not None and r.holder.job == "s" else None
        assert not s.holding
        return outer.epoch, held_epoch, inside, still


async def test_sync_decorated_step_inside_a_block_keeps_the_hold(nats_url: str) -> None:
    epoch, held_epoch, inside, still = await asyncio.wait_for(asyncio.to_thread(_sync_nested, nats_url), 60)
    assert inside and still, "the inner scope released the outer hold"
    assert held_epoch == epoch
    async with AsyncTimeSliceClient("probe", "n5", nats_url) as probe:
        await eventually(lambda: _released(probe), what="the group released once, by the outermost scope")
        assert (await probe.status()).epoch == epoch, "an inner scope took a grant of its own"
