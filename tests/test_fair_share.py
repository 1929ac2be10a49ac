"""Weighted fair share (``SetPolicy.shares``, ``_fair_share``): among waiters of the same effective priority, the one
with the least recent held time per share goes first. The decay and the bounds of the usage, the choice, the pure core
(held time converging to the shares, each choice said in the record, the StateChanged, replay and status), the wire
and the CLI's checks, and a run through the real stack with ``timeslice set-policy --share``. The no-starvation bound
is checked by ``test_fair_share_properties.py``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from timeslice_client import AsyncTimeSliceClient
from timeslice_client.errors import InvalidId
from timeslice_client.protocol import (
    MAX_SHARE,
    MAX_SHARES,
    FairPick,
    Granted,
    SetPolicy,
    Tick,
    Usage,
    WaiterRecord,
    decode_input,
    encode,
    validate_id,
)
from timeslice_orchestrator._fair_share import charge, choose, decayed
from timeslice_orchestrator.core import LIMITS, Limits, Transition

from .agent_harness import timeslice
from .core_sim import G, Sim, notices
from .helpers import eventually

PATIENT: dict[str, Any] = dict(lease_ms=3_600_000, timeout_ms=3_600_000, waiter_ttl_ms=600_000, confirm_ms=600_000)
HALF = LIMITS.usage_half_life_ms


# --------------------------------------------------------------------------- the decay and the bounds of usage


def test_usage_halves_every_half_life_in_eighths_on_a_grid_of_stream_time() -> None:
    u = Usage(held_ms=1_000_000, at_ms=0)
    assert decayed(u, 0, HALF) == 1_000_000
    assert [decayed(u, n * HALF, HALF) for n in range(4)] == [1_000_000, 500_000, 250_000, 125_000]
    step = HALF // 8
    eighths = [decayed(u, k * step, HALF) for k in range(9)]
    assert eighths == sorted(eighths, reverse=True) and eighths[-1] == 500_000
    for k, v in enumerate(eighths):
        assert abs(v - 1_000_000 * 2 ** (-k / 8)) <= 1, (k, v)
    # On a grid of stream time: within one step nothing decays, and decaying in two goes is decaying in one.
    assert decayed(Usage(held_ms=800, at_ms=step + 1), 2 * step - 1, HALF) == 800
    once = decayed(u, 5 * step + 7, HALF)
    twice = decayed(Usage(held_ms=decayed(u, 2 * step + 3, HALF), at_ms=2 * step + 3), 5 * step + 7, HALF)
    assert abs(once - twice) <= 1
    assert decayed(u, 100 * HALF, HALF) == 0 and decayed(u, 10**12, 0) == 1_000_000  # (0: no decay)


def test_a_hold_is_charged_to_its_job_and_past_the_cap_the_least_used_job_is_forgotten() -> None:
    limits = Limits(max_usage_jobs=3)
    usage: dict[str, Usage] = {}
    charge(usage, "a", 4_000, 10_000, limits)
    charge(usage, "a", 1_000, 11_000, limits)  # decayed (not at all, within a step), then added
    assert usage == {"a": Usage(held_ms=5_000, at_ms=11_000)}
    charge(usage, "b", 2_000, 12_000, limits)
    charge(usage, "c", 3_000, 13_000, limits)
    charge(usage, "d", 2_500, 14_000, limits)  # a fourth: b, the least, is forgotten (it counts as none)
    assert sorted(usage) == ["a", "c", "d"]
    charge(usage, "e", 10**20, 15_000, limits)  # capped: an exact number in JSON
    assert usage["e"].held_ms == 2**53 and "d" not in usage


# --------------------------------------------------------------------------- the choice


def waiter(job: str, at: int, priority: int = 0) -> WaiterRecord:
    return WaiterRecord(
        job=job,
        request_id=f"{job}-r",
        enqueued_at_ms=at,
        deadline_ms=at + 10**9,
        alive_until_ms=at + 10**9,
        lease_ms=60_000,
        waiter_ttl_ms=60_000,
        confirm_ms=60_000,
        priority=priority,
    )


def test_the_least_usage_per_share_goes_first_among_equal_effective_priorities() -> None:
    now = 1_000_000
    queue = [waiter("a", now - 30), waiter("b", now - 20), waiter("c", now - 10)]
    usage = {"a": Usage(held_ms=9_000, at_ms=now), "b": Usage(held_ms=4_000, at_ms=now)}
    # Off: first come, first served, whatever the usage.
    assert choose(queue, now, LIMITS, {}, usage) == (0, None)
    # c has used nothing: it goes first, ahead of b (4 s / 1), then a (9 s / 1).
    i, pick = choose(queue, now, LIMITS, {"a": 1}, usage)
    assert i == 2
    assert pick == FairPick(job="c", at_ms=now, held_ms=0, share=1, over="b", over_held_ms=4_000, over_share=1)
    # With a share of 3, a's 9 s count 3 s: less than b's 4 s (b weighs 1, unnamed).
    i, pick = choose(queue[:2], now, LIMITS, {"a": 3}, usage)
    assert i == 0 and pick is not None and (pick.over, pick.share) == ("b", 3)
    # Equal usage per share: whoever asked first.
    i, pick = choose(queue[:2], now, LIMITS, {"a": 9, "b": 4}, usage)
    assert i == 0 and pick is not None and pick.over == "b"


def test_class_and_ageing_come_before_fair_share() -> None:
    now = 1_000_000
    ageing = LIMITS.priority_ageing_ms
    heavy = {"a": Usage(held_ms=10**9, at_ms=now)}
    # A higher class goes first however much it used: no pick of fair share's to tell.
    assert choose([waiter("b", now - 10), waiter("a", now, priority=1)], now, LIMITS, {"a": 1}, heavy) == (1, None)
    # One ageing period more of waiting is one class: the heavy user that waited longer goes first.
    assert choose([waiter("a", now - ageing), waiter("b", now)], now, LIMITS, {"a": 1}, heavy) == (0, None)
    # Within one period, the waits are equal and fair share decides.
    i, pick = choose([waiter("a", now - ageing + 1), waiter("b", now)], now, LIMITS, {"a": 1}, heavy)
    assert i == 1 and pick is not None and pick.over == "a"


# --------------------------------------------------------------------------- through the pure core


def behind_a_higher_class(
    shares: dict[str, int] | None, rounds: int, hold_ms: dict[str, int]
) -> tuple[Sim, dict[str, int]]:
    """Two batch jobs, ``a`` and ``b``, that always want the group, behind ``x``, a job of a higher class that wants it
    back after each of their holds: whenever x releases, both wait, and the group passes to one of them. Each holds
    for its ``hold_ms``, releases, and asks again at once. Returns the sim and each job's held time."""
    sim = Sim()
    if shares is not None:
        sim(SetPolicy(group=G, shares=shares))
    sim.acquire("x", priority=9, **PATIENT)
    sim.renew("x")
    sim.acquire("a", dt=1, **PATIENT)
    sim.acquire("b", dt=1, **PATIENT)
    held = dict.fromkeys(hold_ms, 0)
    for _ in range(rounds):
        h = sim.rec.holder
        assert h is not None
        (g,) = notices(sim.release(h.job, dt=hold_ms[h.job]), Granted)
        held[h.job] += hold_ms[h.job]
        sim.renew(g.job)  # confirmed, as its client does
        sim.acquire(h.job, priority=9 if h.job == "x" else 0, **PATIENT)
    return sim, held


def test_held_time_converges_to_the_shares() -> None:
    _, held = behind_a_higher_class({"a": 3, "b": 1}, 800, {"x": 5_000, "a": 5_000, "b": 5_000})
    assert 2.8 <= held["a"] / held["b"] <= 3.2, held
    # Holds of different lengths: it is held time that is shared, not turns (b waits for 9 of a's holds: well within
    # an ageing period, which would otherwise put it first).
    _, held = behind_a_higher_class({"a": 3, "b": 1}, 800, {"x": 1_000, "a": 2_000, "b": 6_000})
    assert 2.8 <= held["a"] / held["b"] <= 3.2, held
    # Off (the default), the same jobs take turns: first come, first served, and no usage is kept.
    sim, held = behind_a_higher_class(None, 800, {"x": 1_000, "a": 2_000, "b": 6_000})
    assert held["a"] * 3 == held["b"] and sim.rec.usage == {} and sim.rec.picked is None


def test_two_jobs_alone_take_turns_whatever_their_shares() -> None:
    """Fair share orders the waiters; it never keeps the group from a waiter. With two jobs alone, the one that
    releases is not waiting when the group passes on, so they take turns (docs/scheduling.md says so)."""
    sim = Sim()
    sim(SetPolicy(group=G, shares={"a": 3, "b": 1}))
    sim.acquire("a", **PATIENT)
    sim.renew("a")
    sim.acquire("b", dt=1, **PATIENT)
    order = []
    for _ in range(6):
        h = sim.rec.holder
        assert h is not None
        (g,) = notices(sim.release(h.job, dt=1_000), Granted)
        order.append(g.job)
        sim.renew(g.job)
        sim.acquire(h.job, **PATIENT)
    assert order == ["b", "a"] * 3 and sim.rec.picked is None


def test_each_choice_is_in_the_record_the_state_change_replay_and_status() -> None:
    from timeslice_cli._status import render_table
    from timeslice_orchestrator.replay import fold_events, render_summary
    from timeslice_orchestrator.replay._model import StreamEvent

    sim = Sim()
    sim(SetPolicy(group=G, shares={"a": 1, "b": 1}))
    for job in ("a", "b", "x"):
        sim.register(job, "n1")
    sim.hold("a")
    sim.release("a", dt=10_000)  # a held 10 s
    sim.hold("b")
    sim.release("b", dt=1_000)  # b held 1 s
    sim.hold("x")
    sim.acquire("a", dt=10, **PATIENT)
    sim.acquire("b", dt=10, **PATIENT)  # a asked first, but b used less
    actions = sim.release("x", dt=10)
    (change,) = [a.change for a in actions if isinstance(a, Transition)]
    assert change.reason == (
        "fair share: b first (1.0 s held recently / share 1), ahead of a (10.0 s / share 1); then restoring"
    ), change
    pick = sim.rec.picked
    assert pick is not None and (pick.job, pick.over, pick.held_ms, pick.over_held_ms) == ("b", "a", 1_000, 10_000)
    assert sim.settle(actions).job == "b"
    sim.renew("b")
    assert sim.settle(sim.release("b", dt=500)).job == "a"  # one waiter: no choice to tell
    assert sim.rec.picked == pick
    r = fold_events([StreamEvent(seq, ts, subject, data) for seq, ts, subject, data in sim.stream])
    assert r.violations == []  # the stream checker folds the same choices (and mutual exclusion holds)
    assert [(c.job, c.over) for c in r.groups[G].fair_shares] == [("b", "a")]
    assert r.summary.groups[G].fair_share_choices == 1
    text = render_summary(r)
    assert "put first by fair share" in text and "g: fair share: b first (1.0 s held recently" in text, text
    table = render_table([sim.rec], [], sim.now)
    assert "fair share: a=1 held 10.0s, b=1 held 1.5s, x=1 held " in table, table
    assert "last fair share: b first" in table, table


def test_holds_that_end_by_a_lapse_are_charged_and_policy_changes_keep_or_forget_usage() -> None:
    sim = Sim()
    sim(SetPolicy(group=G, shares={"a": 2}))
    sim.acquire("a", confirm_ms=1_000)  # never confirmed: the grant lapses after 1 s
    sim(Tick(group=G), dt=1_000)
    assert sim.rec.holder is None and sim.rec.usage == {"a": Usage(held_ms=1_000, at_ms=sim.now)}
    sim(SetPolicy(group=G, shares={"a": 5, "b": 2}))  # other shares: the usage stays
    assert sim.rec.shares == {"a": 5, "b": 2} and "a" in sim.rec.usage
    before = sim.rec
    sim(SetPolicy(group=G, quantum_ms=1_000))  # shares left out: left as they are
    assert sim.rec.shares == before.shares and sim.rec.usage == before.usage
    sim(SetPolicy(group=G, shares={}))  # off: forgotten
    assert (sim.rec.shares, sim.rec.usage, sim.rec.picked) == ({}, {}, None)


# --------------------------------------------------------------------------- the wire and the CLI's checks


def test_set_policy_shares_on_the_wire() -> None:
    old = b'{"type":"set_policy","group":"g","quantum_ms":7,"min_hold_ms":null}'  # before shares existed
    ev = decode_input(old)
    assert isinstance(ev, SetPolicy) and ev.shares is None
    assert b"shares" not in encode(SetPolicy(group="g", quantum_ms=1))  # left out: an older orchestrator reads it
    ok = {"type": "set_policy", "group": "g", "shares": {"a-1": 1, "B_2": MAX_SHARE}}
    assert decode_input(json.dumps(ok).encode()) == SetPolicy(group="g", shares={"a-1": 1, "B_2": MAX_SHARE})
    for shares in (
        {"a": 0},
        {"a": MAX_SHARE + 1},
        {"a": 1.5},
        {"-a": 1},
        {"a b": 1},
        {"a\n": 1},
        {"x" * 65: 1},
        {f"j{i}": 1 for i in range(MAX_SHARES + 1)},
    ):
        with pytest.raises(msgspec.ValidationError):
            decode_input(json.dumps({"type": "set_policy", "group": "g", "shares": shares}).encode())
    # The pattern on the wire is validate_id's rule.
    for job in ("a", "A-b_9", "9", "x" * 64, "-a", "_a", "a.b", "a\n", "", "x" * 65, "é"):
        try:
            validate_id("job", job)
            valid = True
        except InvalidId:
            valid = False
        raw = json.dumps({"type": "set_policy", "group": "g", "shares": {job: 1}}).encode()
        try:
            decode_input(raw)
            decoded = True
        except msgspec.ValidationError:
            decoded = False
        assert valid == decoded, job


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--share", "a"], "--share wants JOB=WEIGHT, not 'a'"),
        (["--share", "a=0"], "the weight must be a whole number from 1 to 1000"),
        (["--share", "a=x"], "the weight must be a whole number from 1 to 1000"),
        (["--share", "a.b=2"], "invalid job id"),
        (["--share", "a=1", "--share", "a=2"], "names job 'a' twice"),
        (["--share", "a=1", "--no-shares"], "give --share or --no-shares, not both"),
        ([f"--share=j{i}=1" for i in range(MAX_SHARES + 1)], f"at most {MAX_SHARES} jobs may have a share"),
    ],
)
async def test_set_policy_refuses_shares_it_cannot_send(args: list[str], says: str, nats_url: str) -> None:
    rc, out = await timeslice(nats_url, "set-policy", "--group", "g", *args)
    assert rc != 0 and says in out, out


# --------------------------------------------------------------------------- through the real stack


async def test_fair_share_through_the_stack(orchestrator: object, nats_url: str) -> None:
    """Without an agent nothing moves at a switch, but the lock decides as with one. a holds a while, b briefly; with
    equal shares set by ``timeslice set-policy``, b goes first though a asked first; status and replay say why."""
    group = "g-fair"
    async with (
        AsyncTimeSliceClient("a", group, nats_url, bind_process=False) as a,
        AsyncTimeSliceClient("b", group, nats_url, bind_process=False) as b,
        AsyncTimeSliceClient("x", group, nats_url, bind_process=False) as x,
    ):
        await x.acquire(timeout=10)  # the group exists once a job asked for it
        await x.release()
        rc, out = await timeslice(
            nats_url, "set-policy", "--group", group, "--share", "a=1", "--share", "b=1", "--json"
        )
        assert rc == 0, out
        assert json.loads(out) == {"group": group, "shares": {"a": 1, "b": 1}}
        assert (await a.status()).shares == {"a": 1, "b": 1}
        await a.acquire(timeout=10)
        await asyncio.sleep(0.5)  # a's work on the accelerators: it holds half a second
        await a.release()
        await b.acquire(timeout=10)
        await b.release()  # b holds as long as a round trip
        await x.acquire(timeout=10)

        async def waiting(*jobs: str) -> bool:
            return [w.job for w in (await x.status()).waiters] == list(jobs)

        a_waits = asyncio.create_task(a.acquire(timeout=30))
        await eventually(lambda: waiting("a"), what="a waits")
        b_waits = asyncio.create_task(b.acquire(timeout=30))
        await eventually(lambda: waiting("a", "b"), what="a and b wait, a first")
        await x.release()
        await asyncio.wait_for(b_waits, 10)  # b first: less held time per share
        assert not a_waits.done()
        await b.release()
        await asyncio.wait_for(a_waits, 10)
        await a.release()

        async def status_says() -> str | None:
            rc, out = await timeslice(nats_url, "status", "--group", group)
            return out if rc == 0 and "last fair share: b first" in out else None

        out = await eventually(status_says, what="status says fair share's choice")
        assert "fair share: a=1 held " in out and ", b=1 held " in out, out
        rc, out = await timeslice(nats_url, "replay", "--group", group)
        assert rc == 0 and "put first by fair share" in out and "fair share: b first" in out, out
        rc, out = await timeslice(nats_url, "set-policy", "--group", group, "--no-shares")
        assert rc == 0 and "no fair share (first come, first served" in out, out
        assert (await a.status()).shares == {}
