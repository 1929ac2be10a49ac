"""``SharedLoop``'s call limit: a blocking call ends by its ``timeout`` even when nothing on the loop would wake
it (the limit bounds the loop's select itself), the coroutine is cancelled and its cleanup runs (for at most
``INTERRUPT_GRACE_S``), and the loop serves the next calls as before."""

from __future__ import annotations

import asyncio
import time

import pytest
from timeslice_client._shared_loop import INTERRUPT_GRACE_S, CallTimeout, SharedLoop


@pytest.fixture
def shared() -> SharedLoop:
    loop = SharedLoop("test-shared-loop")
    loop.start()
    yield loop  # type: ignore[misc]
    assert loop.stop(10)


def test_a_call_waiting_on_nothing_ends_at_its_limit_and_its_cleanup_runs(shared: SharedLoop) -> None:
    cleaned: list[str] = []

    async def forever() -> None:
        try:
            await asyncio.get_running_loop().create_future()  # no timer, no I/O: only the limit ends it
        finally:
            cleaned.append("cleanup")

    t0 = time.monotonic()
    with pytest.raises(CallTimeout, match=r"over 0\.3 s"):
        shared.run(forever(), 0.3)
    took = time.monotonic() - t0
    assert 0.3 <= took < 0.3 + INTERRUPT_GRACE_S, took
    assert cleaned == ["cleanup"]


def test_the_loop_serves_calls_after_one_ran_past_its_limit(shared: SharedLoop) -> None:
    async def forever() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(CallTimeout):
        shared.run(forever(), 0.1)

    async def nap(s: float) -> str:
        await asyncio.sleep(s)
        return "woke"

    # The limit of the call before is gone: a longer sleep than it now runs to its end.
    t0 = time.monotonic()
    assert shared.run(nap(0.25), 5) == "woke"
    assert time.monotonic() - t0 >= 0.25
    assert shared.run(nap(0), None) == "woke"


def test_a_cleanup_that_outlasts_the_grace_is_left_and_the_call_still_ends(shared: SharedLoop) -> None:
    async def stubborn() -> None:
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            await asyncio.sleep(INTERRUPT_GRACE_S + 5)  # a cleanup slower than the call waits for

    t0 = time.monotonic()
    with pytest.raises(CallTimeout):
        shared.run(stubborn(), 0.1)
    took = time.monotonic() - t0
    assert 0.1 + INTERRUPT_GRACE_S <= took < 0.1 + INTERRUPT_GRACE_S + 2, took


def test_a_call_within_its_limit_returns_its_value_and_raises_its_own_errors(shared: SharedLoop) -> None:
    async def value() -> int:
        await asyncio.sleep(0.01)
        return 7

    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("its own")

    assert shared.run(value(), 1) == 7
    with pytest.raises(ValueError, match="its own"):
        shared.run(fails(), 1)
