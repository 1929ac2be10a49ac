"""The predictive restore through the real stack: nats-server, the orchestrator, node-1's agent (beside it and
apart), two jobs taking turns as an RL run's phases do, the policy set with ``timeslice set-policy --predict``. The
pure core's rules are pinned in ``test_predict.py`` and the state machine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from timeslice_agent import Agent
from timeslice_client import AsyncTimeSliceClient

from .agent_harness import Recorder, timeslice
from .helpers import eventually, group_record
from .test_agent_flow import stack

NODE = "node-1"
GROUP = "gpred"
AWAY_S = 0.3  # a's generation phase between its turns, beside b's turn: b is away for less


@pytest.fixture(params=["beside", "apart"])
async def agent(nats_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Agent]:
    async with stack(nats_url, request.param) as a:
        yield a


async def _turn(job: AsyncTimeSliceClient) -> str | None:
    """``job`` takes the group, works a moment and releases it; the job its release expects next (None: none)."""
    await job.acquire(timeout=30)
    await asyncio.sleep(0.05)  # (its training phase: time passes, nothing is waited for)
    return (await job.release()).ahead


async def test_the_job_expected_next_finds_its_context_back_and_a_wrong_guess_costs_one_switch(
    nats_url: str, agent: Agent
) -> None:
    log: list[str] = []
    async with AsyncTimeSliceClient("a", GROUP, nats_url) as a, AsyncTimeSliceClient("b", GROUP, nats_url) as b:
        await a.register_workload(Recorder("a", log), node_id=NODE)
        await b.register_workload(Recorder("b", log), node_id=NODE)
        assert await _turn(a) is None  # the group exists now
        rc, out = await timeslice(nats_url, "set-policy", "--group", GROUP, "--predict", "--json")
        assert rc == 0 and json.loads(out) == {"group": GROUP, "predict": True}, out
        # Rounds of turns: b is away only while a works, a also while it generates after b's turn. The core learns
        # how long each stays away (from the policy on: no history is kept without it). b's releases may already
        # expect a next, rightly (a asks after its generation phase, before b comes back).
        for _ in range(2):
            assert await _turn(b) in (None, "a")
            await asyncio.sleep(AWAY_S)  # (a's generation phase: nobody holds the group)
            await _turn(a)
        # a's release: b (away a moment) asks before a (away for longer) comes back.
        assert await _turn(b) in (None, "a")
        await asyncio.sleep(AWAY_S)
        assert await _turn(a) == "b"
        rec = await eventually(
            lambda: _restored_ahead(a, "b"), timeout=30, what="b's context brought back while the group is idle"
        )
        assert rec.holder is None and rec.active_job == "b"
        assert sorted(log[-2:]) == ["a:suspend", "b:resume"], log  # (beside each other where the node has room)
        before = len(log)
        g = await b.acquire(timeout=30)
        assert g.context_restored and len(log) == before, "granted at once: its context was already back"
        await asyncio.sleep(0.05)
        await b.release()
        await asyncio.sleep(AWAY_S)
        assert await _turn(a) == "b"
        await eventually(lambda: _restored_ahead(a, "b"), timeout=30, what="b's context back ahead of its ask")
        # A wrong guess: a comes back before b. It waits for one switch back, and nothing is lost or doubled.
        before = len(log)
        g = await a.acquire(timeout=30)
        assert g.context_restored and sorted(log[before:]) == ["a:resume", "b:suspend"], log
        await a.release()
    rc, out = await timeslice(nats_url, "check", "--group", GROUP, "--json")
    assert rc == 0, out
    rc, out = await timeslice(nats_url, "replay", "--group", GROUP)
    assert rc == 0, out
    shown = out.split("predictive restores", 1)[1]
    assert f"{GROUP}/b: started, its job granted next" in shown, out
    assert f"{GROUP}/b: started, another job granted next" in shown, out
    rc, out = await timeslice(nats_url, "replay", "--group", GROUP, "--json")
    assert rc == 0
    (tl,) = json.loads(out)["groups"].values()
    ended = [p["outcome"] for p in tl["predictions"] if p["outcome"]]  # (a's last release predicts b once more)
    assert "hit" in ended and ended[-1] == "missed", tl["predictions"]


async def _restored_ahead(client: AsyncTimeSliceClient, job: str) -> object | None:
    rec = await group_record(client)
    return rec if rec.restored_ahead == job and rec.switch is None else None


async def test_a_release_that_names_a_job_next_is_never_followed_by_a_claim(nats_url: str, agent: Agent) -> None:
    """The releasing client's next acquire goes through the orchestrator (no claim) when the release names a job
    expected next: the prediction's switch may come first, and a claim assumes no decision before it."""
    log: list[str] = []
    async with (
        AsyncTimeSliceClient("a", "gclaim", nats_url) as a,
        AsyncTimeSliceClient("b", "gclaim", nats_url) as b,
    ):
        await a.register_workload(Recorder("a", log), node_id=NODE)
        await b.register_workload(Recorder("b", log), node_id=NODE)
        await _turn(a)
        rc, out = await timeslice(nats_url, "set-policy", "--group", "gclaim", "--predict")
        assert rc == 0, out
        for _ in range(2):
            await _turn(b)
            await asyncio.sleep(AWAY_S)
            await _turn(a)
        await _turn(b)
        await asyncio.sleep(AWAY_S)
        assert await _turn(a) == "b"
        assert a._claim is None, "a claim offered after a release that named b"
        g = await a.acquire(timeout=30)  # the prediction's switch (if it started) is undone: a is served
        assert g.epoch > 0 and a.holding
        await a.release()
    rc, out = await timeslice(nats_url, "check", "--group", "gclaim", "--json")
    assert rc == 0, out


LONG_S = 1.0  # b's time away in the learning rounds (its release -> its next ask)
ROLLOUT_S = 0.3  # b's phase "rollout" (published with the real client) -> its next ask


async def test_a_phase_start_brings_the_jobs_context_back_before_its_ask(nats_url: str, agent: Agent) -> None:
    """b publishes its phase ``rollout`` with ``AsyncTimeSliceClient.phase`` while away; the core learns how long after
    its start b asks, and at the next start (this time right after a's release, far earlier than b's time away says)
    plans b's restore from it: b's acquire is granted at once, ``context_restored``, and replay names the phase."""
    log: list[str] = []
    async with AsyncTimeSliceClient("a", "gphase", nats_url) as a, AsyncTimeSliceClient("b", "gphase", nats_url) as b:
        await a.register_workload(Recorder("a", log), node_id=NODE)
        await b.register_workload(Recorder("b", log), node_id=NODE)
        await _turn(b)  # the group exists now
        rc, out = await timeslice(nats_url, "set-policy", "--group", "gphase", "--predict")
        assert rc == 0, out
        for _ in range(2):  # learning: b stays away LONG_S, its rollout starts ROLLOUT_S before it asks
            await _turn(a)
            await asyncio.sleep(LONG_S - ROLLOUT_S)  # (b's other work: the group is idle, a's context loaded)
            async with b.phase("rollout"):
                await asyncio.sleep(ROLLOUT_S)
            await _turn(b)
        cue = (await group_record(a)).cycles["b"].phases["rollout"]
        assert cue.gap_ms >= 0 and cue.prev_gap_ms >= 0, cue
        await _turn(a)
        async with b.phase("rollout"):  # at once, this time
            await asyncio.sleep(ROLLOUT_S)
        # (the restore was planned ROLLOUT_S less twice b's switch in after the start: on a loaded machine it may
        # still run; wait for it rather than for a time)
        await eventually(lambda: _restored_ahead(a, "b"), timeout=30, what="b's context back from its phase's cue")
        before = len(log)
        g = await b.acquire(timeout=30)
        assert g.context_restored and len(log) == before, "granted at once: its context was already back"
        await b.release()
    rc, out = await timeslice(nats_url, "check", "--group", "gphase", "--json")
    assert rc == 0, out
    rc, out = await timeslice(nats_url, "replay", "--group", "gphase")
    assert rc == 0, out
    assert "gphase/b: started, its job granted next (planned at its phase rollout's start)" in out, out
