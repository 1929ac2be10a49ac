"""The blocking facade, against the orchestrator running as a real process."""

from __future__ import annotations

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
