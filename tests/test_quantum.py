"""A group's quantum (``SetPolicy``, ``_quantum``): a holder that held past it while another job waits is asked,
once per hold, to yield (``YieldRequested``); never revoked for it. In the pure core, through the real stack with
``timeslice set-policy``, and who may set it. The state machine (``test_core_properties.py``) checks every request
against the rule too."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from timeslice_client import AsyncTimeSliceClient
from timeslice_client._names import subject_matches as matches
from timeslice_client.protocol import Granted, Renew, Revoked, SetPolicy, Tick, YieldRequested, subjects
from timeslice_orchestrator._auth_perms import permissions
from timeslice_orchestrator.core import next_deadline

from .agent_harness import timeslice
from .core_sim import G, Sim, notices
from .helpers import eventually

PATIENT: dict[str, Any] = dict(lease_ms=3_600_000, timeout_ms=3_600_000, waiter_ttl_ms=600_000, confirm_ms=600_000)
Q = 30_000


def holding(sim: Sim, job: str) -> None:
    (g,) = notices(sim.acquire(job, **PATIENT), Granted)
    sim.renew(job)  # confirmed
    assert g.job == job


def test_a_holder_past_its_quantum_while_another_waits_is_asked_once() -> None:
    sim = Sim()
    sim(SetPolicy(group=G, quantum_ms=Q))
    holding(sim, "a")
    granted_at = sim.rec.holder.granted_at_ms  # type: ignore[union-attr]
    assert next_deadline(sim.rec) != granted_at + Q  # nobody waits: no request due
    sim.acquire("b", dt=1_000, **PATIENT)
    assert next_deadline(sim.rec) == granted_at + Q
    assert notices(sim(Tick(group=G), dt=Q - 1_000 - 1), YieldRequested) == []  # a millisecond early
    (y,) = notices(sim(Tick(group=G), dt=1), YieldRequested)
    assert (y.job, y.epoch, y.held_ms, y.quantum_ms, y.waiters) == ("a", sim.rec.holder.epoch, Q, Q, 1)  # type: ignore[union-attr]
    # Once per hold; the hold stays valid (renewed, never revoked for it), and it ends when the job releases.
    assert notices(sim(Tick(group=G), dt=10 * Q), YieldRequested) == []
    assert notices(sim.renew("a"), Revoked) == [] and sim.rec.holder.job == "a"  # type: ignore[union-attr]
    (g,) = notices(sim.release("a", dt=5), Granted)
    sim.renew("b")
    assert g.job == "b"
    # The next holder has a quantum of its own, counted from its grant.
    sim.acquire("a", dt=1, **PATIENT)
    assert next_deadline(sim.rec) == sim.rec.holder.granted_at_ms + Q  # type: ignore[union-attr]


def test_a_waiter_that_comes_after_the_quantum_ran_out_gets_the_holder_asked_at_once() -> None:
    sim = Sim()
    sim(SetPolicy(group=G, quantum_ms=Q))
    holding(sim, "a")
    assert notices(sim(Tick(group=G), dt=2 * Q), YieldRequested) == []  # alone: nobody to yield to
    (y,) = notices(sim.acquire("b", dt=1, **PATIENT), YieldRequested)
    assert y.job == "a" and y.held_ms > Q


def test_no_quantum_no_request_and_setting_zero_turns_it_off() -> None:
    sim = Sim()
    holding(sim, "a")
    sim.acquire("b", **PATIENT)
    assert notices(sim(Tick(group=G), dt=10 * Q), YieldRequested) == []
    (y,) = notices(sim(SetPolicy(group=G, quantum_ms=Q)), YieldRequested)  # held past it already: asked now
    assert sim.rec.quantum_ms == Q
    assert y.job == "a"
    sim(SetPolicy(group=G, quantum_ms=0))
    assert sim.rec.quantum_ms == 0 and next_deadline(sim.rec) != sim.rec.holder.granted_at_ms + Q  # type: ignore[union-attr]


def test_only_the_operator_identities_may_set_a_policy() -> None:
    subject = "ts.v1.ctl.g.set_policy"
    for role, ident, allowed in (
        ("admin", None, True),
        ("local", None, True),
        ("orchestrator", None, True),
        ("job", "a", False),
        ("agent", "n1", False),
        ("reader", None, False),
    ):
        perms = permissions(role, ident)
        ok = any(matches(p, subject) for p in perms["pub"]["allow"]) and not any(
            matches(p, subject) for p in perms["pub"].get("deny", ())
        )
        assert ok == allowed, (role, perms["pub"])


async def test_set_policy_and_yield_requested_through_the_stack(orchestrator: object, nats_url: str) -> None:
    async with (
        AsyncTimeSliceClient("long", "g-quantum", nats_url, bind_process=False) as long_job,
        AsyncTimeSliceClient("next", "g-quantum", nats_url, bind_process=False) as next_job,
    ):
        await long_job.acquire(timeout=10)  # the group exists once a job asked for it
        await long_job.release()
        rc, out = await timeslice(nats_url, "set-policy", "--group", "g-quantum", "--quantum-s", "0.3", "--json")
        assert rc == 0, out
        assert json.loads(out) == {"group": "g-quantum", "quantum_ms": 300}
        assert (await long_job.status()).quantum_ms == 300
        # (before the call: the hold counts from the stream's time of the acquire, and a claim returns at its PubAck,
        # after that time; read after the call, the quantum looked 2 ms short once under load)
        granted = time.monotonic()
        await long_job.acquire(timeout=10)
        waiting = asyncio.create_task(next_job.acquire(timeout=30))
        await eventually(lambda: long_job.yield_requested, timeout=10, what="the holder asked to yield")
        assert time.monotonic() - granted >= 0.3 and long_job.contended and long_job.holding
        assert not waiting.done()  # a request, not a revocation: the hold is still the holder's
        rc, out = await timeslice(nats_url, "status", "--group", "g-quantum")
        assert rc == 0 and "quantum: 0.3s (the holder was asked to yield)" in out, out
        await long_job.release()
        await asyncio.wait_for(waiting, 10)
        assert next_job.holding and not next_job.yield_requested and not long_job.yield_requested
        await next_job.release()
    rc, out = await timeslice(nats_url, "set-policy", "--group", "nosuch", "--quantum-s", "1")
    assert rc != 0 and "no group 'nosuch'" in out and "Traceback" not in out


@pytest.mark.parametrize("bad", ["-1", "700000"])
async def test_set_policy_refuses_a_quantum_out_of_range(nats_url: str, bad: str) -> None:
    rc, out = await timeslice(nats_url, "set-policy", "--group", "g", "--quantum-s", bad)
    assert rc != 0 and "--quantum-s must lie between" in out


def test_replay_shows_who_was_asked_to_yield_and_each_waiters_class() -> None:
    from timeslice_orchestrator.replay import fold_events, render_summary

    from .replay_streams import StreamBuilder

    b = StreamBuilder()
    t = 1_000_000
    b.add(t, subjects.ctl("g", "set_policy"), SetPolicy(group="g", quantum_ms=Q))
    b.acquire(t + 10, "a", "ra", **PATIENT)
    b.add(t + 20, subjects.job("g", "a", "renew"), Renew(group="g", job="a", request_id="c", epoch=1))
    b.acquire(t + 100, "b", "rb", priority=3, **PATIENT)
    b.tick(t + 10 + Q)  # a's quantum ran out while b waited
    b.release(t + 10 + Q + 500, "a", "ra", 1)
    r = fold_events(b.events)
    assert r.violations == []
    hold_a, hold_b = r.groups["g"].holds
    assert hold_a.yield_requested_ms == t + 10 + Q and hold_b.yield_requested_ms is None
    assert [(w.job, w.priority) for w in r.groups["g"].waits] == [("b", 3)]
    assert r.summary.groups["g"].yield_requests == 1
    text = render_summary(r)
    assert "asked to yield" in text and "g/a at epoch 1, released 500 ms later" in text
