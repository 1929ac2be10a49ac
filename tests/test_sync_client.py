"""The blocking facade, against the orchestrator running as a real process."""

from __future__ import annotations

import threading

import pytest
from timeslice_client import TimeSliceClient

from .helpers import eventually_sync

pytestmark = pytest.mark.usefixtures("orchestrator_process")


def test_sync_client_round_trip(nats_url: str) -> None:
    with TimeSliceClient("a", "g10", nats_url) as a, TimeSliceClient("b", "g10", nats_url) as b:
        calls: list[int] = []

        @a.on_accelerators(timeout=10)
        def step(i: int) -> None:
            assert a.holding
            calls.append(i)

        step(1)
        step(2)
        assert calls == [1, 2]
        with b.on_accelerators(timeout=10) as g:
            assert g.epoch == 3
            eventually_sync(lambda: (h := a.status().holder) is not None and h.job == "b")
        eventually_sync(lambda: b.status().active_job == "b" and b.status().holder is None)
        assert "g10" in a.list_groups()


def test_sync_client_says_when_another_job_waits(nats_url: str) -> None:
    """``contended``: the orchestrator's word that another job waits (and the cue for an early suspend)."""
    with TimeSliceClient("a", "g11", nats_url) as a, TimeSliceClient("b", "g11", nats_url) as b:
        a.acquire(timeout=10)
        assert a.holding and not a.contended
        got: list[int] = []
        waiter = threading.Thread(target=lambda: got.append(b.acquire(timeout=20).epoch))
        waiter.start()
        eventually_sync(lambda: a.contended, what="a is told that b waits")
        a.release()
        assert not a.contended
        waiter.join(20)
        assert got == [2] and not b.contended
        b.release()
