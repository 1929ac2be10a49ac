"""``timeslice advise`` against a real stack: two jobs run alone, each in a group of its own; the command predicts
them sharing one group; then they share one, and the prediction is held against the measured run. Also: what the
command says when it cannot predict."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from timeslice_client import AsyncTimeSliceClient

from .agent_harness import timeslice
from .conftest import OrchestratorProcess

# Compares wall-clock runs (shared against solo or predicted): one CI worker runs these modules one after another
# (``--dist loadgroup``), so they never load the 2 cores against each other.
pytestmark = pytest.mark.xdist_group("wall_clock")

STEPS = 6
HOLD_S = 0.08  # each step's phase on the accelerators: slept inside the hold, as a GPU phase leaves the CPU free
GAP_S = 0.12  # and off them (reward scoring): the other job's turn when they share


async def job(url: str, name: str, group: str, start: asyncio.Event | None = None) -> float:
    """``STEPS`` steps of a hold and a gap; returns when its last release returned (monotonic s)."""
    async with AsyncTimeSliceClient(name, group, url, bind_process=False) as c:
        await c.connect()
        if start is not None:
            await start.wait()
        for i in range(STEPS):
            async with c.on_accelerators(timeout=30):
                await asyncio.sleep(HOLD_S)
            if i < STEPS - 1:
                await asyncio.sleep(GAP_S)
        return time.monotonic()


async def test_advise_predicts_the_shared_run_of_two_jobs_run_alone(
    orchestrator_process: OrchestratorProcess, nats_url: str
) -> None:
    for name in ("adv-a", "adv-b"):  # alone, one after the other, each in its own group
        await job(nats_url, name, f"solo-{name}")
    rc, out = await timeslice(nats_url, "advise", "adv-a@solo-adv-a", "adv-b@solo-adv-b", "--json")
    assert rc == 0, out
    doc = json.loads(out)
    rc, ranked = await timeslice(
        nats_url, "advise", "adv-a@solo-adv-a", "adv-b@solo-adv-b", "--priority", "adv-b=5", "--json"
    )
    assert rc == 0, ranked
    assert [t["priority"] for t in json.loads(ranked)["traces"]] == [0, 5]
    rc, out2 = await timeslice(nats_url, "advise", "adv-a@solo-adv-a", "adv-b@solo-adv-b", "--priority", "zz=1")
    assert rc != 0 and "--priority names zz" in out2
    predicted = doc["prediction"]["makespan_s"]
    assert [t["holds"] for t in doc["traces"]] == [STEPS, STEPS]
    for t in doc["traces"]:
        assert t["held_s"] == pytest.approx(STEPS * HOLD_S, rel=0.25)
        gaps = [s for on, s in t["phases"] if not on]
        assert len(gaps) == STEPS - 1 and min(gaps) >= GAP_S * 0.9
    alone = sum(t["wall_s"] for t in doc["traces"])
    assert doc["prediction"]["back_to_back_s"] == pytest.approx(alone)
    assert predicted < alone  # each one's gaps hold the other's phases on the accelerators

    start = asyncio.Event()
    runs = [asyncio.create_task(job(nats_url, name, "adv-shared", start)) for name in ("adv-a", "adv-b")]
    await asyncio.sleep(0)  # both connect first (their connects are not the run's time)
    begun = time.monotonic()
    start.set()
    measured = max(await asyncio.gather(*runs)) - begun
    print(f"advise: predicted {predicted:.3f} s, measured {measured:.3f} s ({predicted / measured:.2f}x)")
    assert predicted == pytest.approx(measured, rel=0.15)


async def test_advise_says_what_it_cannot_predict(orchestrator_process: OrchestratorProcess, nats_url: str) -> None:
    await job(nats_url, "adv-c", "solo-c")
    rc, out = await timeslice(nats_url, "advise", "adv-c", "nobody")
    assert rc != 0 and "job 'nobody' has no finished hold" in out and "Traceback" not in out
    rc, out = await timeslice(nats_url, "advise", "adv-c")
    assert rc != 0 and "at least two jobs" in out
    rc, out = await timeslice(nats_url, "advise", "adv-c", "x y")
    assert rc == 2 and "Traceback" not in out  # not an id: a usage error
    rc, out = await timeslice(nats_url, "advise", "adv-c", "adv-c", "--snapshot-s", "-1")
    assert rc == 2
    rc, out = await timeslice(nats_url, "advise", "adv-c", "adv-c", "--priority", "adv-c=10")
    assert rc == 2 and "between 0 and 9" in out
