"""The predictive restore (``SetPolicy.predict``, ``_predict``) through the pure core: plans, their cancellation at no
cost, the switch ahead of an ask, and a run with the policy on that matches one with it off until a prediction starts
(a cancelled prediction leaves no trace). The state machine (``test_core_properties``, ``core_predict_checks``) checks
the same rules against random runs; ``test_predict_stack.py`` runs it through the real stack."""

from __future__ import annotations

from typing import Literal

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from timeslice_client.protocol import (
    Acquire,
    Granted,
    GroupState,
    InputEvent,
    Phase,
    Release,
    Released,
    Restore,
    SetPolicy,
    Snapshot,
    Tick,
)
from timeslice_orchestrator.core import Action, Notify, Transition, apply

from .core_sim import G, Sim, commands, notices

AWAY_MS = 5_000  # how long each job stays away after its release (its generation phase, say)
HOLD_MS = 2_000


def _turns(sim: Sim, rounds: int) -> None:
    """a and b take turns: each holds, releases, and asks again AWAY_MS after its release (b first asks once a is
    away); every switch is answered at once."""
    for _ in range(rounds):
        for job in ("a", "b"):
            sim.settle(sim.acquire(job, dt=AWAY_MS - HOLD_MS if sim.rec.holder is None else 0))
            sim.renew(job)
            for c in commands(sim.release(job, dt=HOLD_MS)):
                sim.result(c)


def _a_turn(sim: Sim) -> Released:
    """a's next turn (it asks AWAY_MS after its last release, holds HOLD_MS, releases): the release's answer."""
    sim.settle(sim.acquire("a", dt=AWAY_MS - HOLD_MS))
    sim.renew("a")
    (rel,) = notices(sim.release("a", dt=HOLD_MS), Released)
    return rel  # type: ignore[no-any-return]


def _predicting() -> Sim:
    sim = Sim()
    sim.register("a", "n1")
    sim.register("b", "n1")
    sim(SetPolicy(group=G, predict=True))
    _turns(sim, 2)
    return sim


def test_a_release_with_nobody_waiting_predicts_the_job_whose_turn_comes() -> None:
    sim = _predicting()
    rel = _a_turn(sim)
    # b released HOLD_MS ago and stays away AWAY_MS; a comes back after AWAY_MS: b first.
    assert rel.pending_waiters == 0 and rel.snapshot_deferred and rel.ahead == "b"
    plan = sim.rec.plan
    assert plan is not None and plan.job == "b" and sim.now <= plan.at_ms <= sim.now + AWAY_MS - HOLD_MS
    assert sim.rec.state is GroupState.IDLE_YIELDED and sim.rec.active_job == "a"


def test_the_plan_starts_a_switch_nobody_waits_for_and_the_predicted_ask_is_granted_at_once() -> None:
    sim = _predicting()
    _a_turn(sim)
    plan = sim.rec.plan
    assert plan is not None
    snap, restore = commands(sim.tick(dt=plan.at_ms - sim.now))
    assert isinstance(snap, Snapshot) and snap.job == "a" and isinstance(restore, Restore) and restore.job == "b"
    assert sim.rec.switch is not None and sim.rec.switch.ahead == "b" and sim.rec.switch.to is None
    sim.result(snap)
    assert notices(sim.result(restore)) == [], "nobody is granted: nobody asked"
    assert sim.rec.state is GroupState.IDLE_YIELDED and sim.rec.active_job == "b" and sim.rec.restored_ahead == "b"
    actions = sim.acquire("b", dt=100)
    (g,) = notices(actions, Granted)
    assert commands(actions) == [] and g.job == "b" and g.context_restored, "its context was already back"
    assert sim.rec.restored_ahead is None


def test_the_predicted_job_asking_during_its_restore_takes_that_switch() -> None:
    sim = _predicting()
    _a_turn(sim)
    assert sim.rec.plan is not None
    snap, restore = commands(sim.tick(dt=sim.rec.plan.at_ms - sim.now))
    assert commands(sim.acquire("b", dt=10)) == [] and sim.rec.switch is not None
    assert sim.rec.switch.to is not None and sim.rec.switch.to.job == "b"
    sim.result(snap)
    (g,) = notices(sim.result(restore), Granted)
    assert g.job == "b" and g.context_restored


def test_status_says_what_the_prediction_plans_runs_or_brought_back() -> None:
    from timeslice_cli._status import render_table

    sim = _predicting()
    _a_turn(sim)
    plan = sim.rec.plan
    assert plan is not None
    assert "predictive restore: b expected next, its restore starts in" in render_table([sim.rec], [], sim.now)
    cmds = commands(sim.tick(dt=plan.at_ms - sim.now))
    assert "predictive restore: bringing b's context back ahead of its ask" in render_table([sim.rec], [], sim.now)
    for c in cmds:
        sim.result(c)
    assert "predictive restore: b's context is back, ahead of its ask" in render_table([sim.rec], [], sim.now)
    sim.acquire("b", dt=10)
    assert "predictive restore: on" in render_table([sim.rec], [], sim.now)


def test_any_ask_before_the_plan_starts_drops_it_at_no_cost() -> None:
    sim = _predicting()
    _a_turn(sim)
    plan = sim.rec.plan
    assert plan is not None and plan.at_ms > sim.now, "the plan waits for b's time"
    actions = sim.acquire("a", dt=plan.at_ms - sim.now - 1)  # a comes back first
    (g,) = notices(actions, Granted)
    assert commands(actions) == [] and g.job == "a" and not g.context_restored, "nothing moved: a re-acquire"
    assert sim.rec.plan is None
    assert commands(sim.tick(dt=10 * AWAY_MS)) == [], "the plan is gone"


def test_a_wrong_prediction_costs_one_switch_back() -> None:
    sim = _predicting()
    _a_turn(sim)
    assert sim.rec.plan is not None
    for c in commands(sim.tick(dt=sim.rec.plan.at_ms - sim.now)):
        sim.result(c)
    assert sim.rec.active_job == "b"
    actions = sim.acquire("a", dt=10)  # a was expected later
    cmds = commands(actions)
    assert [(type(c), c.job) for c in cmds] == [(Snapshot, "b"), (Restore, "a")]
    g = sim.settle(actions)
    assert g.job == "a" and g.context_restored


def test_no_prediction_without_the_policy_or_history() -> None:
    sim = Sim()
    sim.register("a", "n1")
    sim.register("b", "n1")
    _turns(sim, 2)  # policy off
    rel = _a_turn(sim)
    assert rel.ahead is None and sim.rec.plan is None
    fresh = Sim()
    fresh.register("a", "n1")
    fresh.register("b", "n1")
    fresh(SetPolicy(group=G, predict=True))
    fresh.hold("a")
    (rel,) = notices(fresh.release("a"), Released)
    assert rel.ahead is None, "b has no cycle yet to predict from"


def test_turning_the_policy_off_drops_a_plan() -> None:
    sim = _predicting()
    _a_turn(sim)
    assert sim.rec.plan is not None
    sim(SetPolicy(group=G, predict=False))
    assert sim.rec.plan is None and commands(sim.tick(dt=10 * AWAY_MS)) == []


def test_a_job_whose_context_is_saved_on_a_lost_node_is_never_predicted() -> None:
    from timeslice_client.protocol import AgentLost

    sim = _predicting()
    sim.settle(sim.acquire("a", dt=AWAY_MS - HOLD_MS))
    sim.renew("a")
    sim(AgentLost(group=G, node="n1"))
    (rel,) = notices(sim.release("a", dt=HOLD_MS), Released)
    assert rel.ahead is None and "b" not in sim.rec.faulted


def _replayed(sim: Sim) -> tuple[list[tuple[str, str]], str]:
    """The stream ``sim`` wrote, through ``timeslice replay``'s fold: each prediction's (job, outcome), the summary."""
    from timeslice_orchestrator.replay import StreamEvent, fold_events, render_summary

    r = fold_events([StreamEvent(seq, ts, subject, data) for seq, ts, subject, data in sim.stream])
    assert r.violations == []
    outcomes = [(p.job, p.outcome) for p in r.groups[G].predictions]
    assert r.summary.groups[G].predictions == len(outcomes)
    assert r.summary.groups[G].predictions_hit == outcomes.count(("b", "hit"))
    return outcomes, render_summary(r)


@pytest.mark.parametrize(
    ("started", "asker", "outcome", "said"),
    [
        (True, "b", "hit", "started, its job granted next"),
        (False, "a", "dropped", "planned, dropped: a job asked"),
        (True, "a", "missed", "started, another job granted next"),
    ],
)
def test_replay_shows_each_prediction_and_how_it_ended(started: bool, asker: str, outcome: str, said: str) -> None:
    sim = _predicting()
    _a_turn(sim)
    plan = sim.rec.plan
    assert plan is not None and plan.at_ms > sim.now + 1
    if started:
        for c in commands(sim.tick(dt=plan.at_ms - sim.now)):
            sim.result(c)
    sim.settle(sim.acquire(asker, dt=1))
    outcomes, text = _replayed(sim)
    assert outcomes[-1] == ("b", outcome) and f"g/b: {said}" in text, text


# --------------------------------------------------------------------------- no trace


def _plain(actions: list[Action]) -> list[Action]:
    """Actions with what only the policy adds left out: a release's ``ahead`` and the reasons of state changes."""
    out: list[Action] = []
    for a in actions:
        if isinstance(a, Notify) and isinstance(a.notice, Released):
            out.append(Notify(msgspec.structs.replace(a.notice, ahead=None)))
        elif isinstance(a, Transition):
            out.append(Transition(msgspec.structs.replace(a.change, reason="")))
        else:
            out.append(a)
    return out


_JOB = st.sampled_from(["a", "b", "c"])


@st.composite
def _events(draw: st.DrawFn) -> list[tuple[int, InputEvent]]:
    """A run of acquires, releases (of the holder, as clients make them), ticks, agents' answers and phase events,
    with time."""
    steps: list[tuple[int, InputEvent]] = []
    for i in range(draw(st.integers(5, 40))):
        dt = draw(st.sampled_from([0, 10, 500, 2_000, 5_000, 20_000]))
        kind = draw(st.sampled_from(["turn", "turn", "turn", "acquire", "release", "tick", "answer", "phase"]))
        if kind == "turn":  # a job's turn, as an RL phase: it asks, is switched in, holds a while and releases
            steps.append((dt, Acquire(group=G, job=draw(_JOB), request_id=f"r{i}", lease_ms=60_000)))
            steps.append((0, Tick(group="answer")))
            steps.append((0, Tick(group="answer")))
            steps.append(
                (draw(st.sampled_from([10, 1_000, 3_000])), Release(group=G, job="?", request_id="?", epoch=0))
            )
        elif kind == "acquire":
            steps.append((dt, Acquire(group=G, job=draw(_JOB), request_id=f"r{i}", lease_ms=60_000)))
        elif kind == "release":
            steps.append((dt, Release(group=G, job="?", request_id="?", epoch=0)))  # the holder's, at run time
        elif kind == "tick":
            steps.append((dt, Tick(group=G)))
        elif kind == "phase":  # what timeslice_client.phase publishes, from any job (away, waiting or holding)
            name = draw(st.sampled_from(["rollout", "reward"]))
            edge: Literal["start", "end"] = draw(st.sampled_from(["start", "start", "end"]))
            steps.append((dt, Phase(group=G, job=draw(_JOB), name=name, edge=edge)))
        else:
            steps.append((dt, Tick(group="answer")))  # every pending operation answered, at run time
    return steps


@settings(max_examples=300, deadline=None)
@given(_events())
def test_until_a_prediction_starts_the_policy_changes_no_decision(steps: list[tuple[int, InputEvent]]) -> None:
    """The same run with the policy on and off: every action is the same (but for ``Released.ahead`` and reasons)
    until a predictive restore starts; plans dropped before they started left no trace. With the policy off, a phase
    event does what a tick at its time does (nothing but expiries): no trace in the record."""
    on, off = Sim(), Sim()
    for sim in (on, off):
        for job in ("a", "b", "c"):
            sim.register(job, "n1")
    on(SetPolicy(group=G, predict=True))
    sent: dict[str, Snapshot | Restore] = {}
    planned = False
    for dt, step in steps:
        ev: InputEvent | None = step
        if isinstance(step, Release):
            h = off.rec.holder
            ev = None if h is None else Release(group=G, job=h.job, request_id=h.request_id, epoch=h.epoch)
        if isinstance(step, Tick) and step.group == "answer":
            sw, tr = off.rec.switch, off.rec.trailing
            for i, op in enumerate((sw.ops if sw else ()) + (tr.ops if tr else ())):
                cmd, gap = sent[op.op_id], dt if i == 0 else 0
                got_on, got_off = on.result(cmd, dt=gap), off.result(cmd, dt=gap)
                if not _same(on, off, got_on, got_off):
                    event("a prediction started")
                    return
                sent.update((c.op_id, c) for c in commands(got_off))
        elif ev is not None:
            before_off = off.rec
            got_on, got_off = on(ev, dt=dt), off(ev, dt=dt)
            if isinstance(ev, Phase):  # with the policy off, a phase event changes nothing but what time does
                quiet = apply(before_off, Tick(group=G), off.now, off.seq)
                assert (off.rec, got_off) == quiet, "a phase event left a trace with the policy off"
                event("a phase event" + (" planned" if on.rec.plan is not None and on.rec.plan.phase else ""))
            planned = planned or on.rec.plan is not None
            if not _same(on, off, got_on, got_off):
                event("a prediction started")
                return
            sent.update((c.op_id, c) for c in commands(got_off))
    if planned:
        event("plans made and dropped before they started")


def _same(on: Sim, off: Sim, got_on: list[Action], got_off: list[Action]) -> bool:
    """Check that both runs decided the same in this step; False once a prediction started (from there on the runs
    may differ: that is its point)."""
    if on.rec.switch is not None and on.rec.switch.ahead is not None:
        return False
    assert _plain(got_on) == _plain(got_off), (got_on, got_off)
    fields = ("predict", "cycles", "plan", "restored_ahead", "last_seq", "since_ms")
    a = {k: v for k, v in msgspec.structs.asdict(on.rec).items() if k not in fields}
    b = {k: v for k, v in msgspec.structs.asdict(off.rec).items() if k not in fields}
    assert a == b, (on.rec, off.rec)
    return True


def test_a_hostile_release_notice_is_refused_by_its_bounds() -> None:
    """``Released.ahead`` from the bus is an id: a longer one is refused at decoding (the client logs an undecodable
    notice and goes on), never acted on."""
    from timeslice_client.protocol import decode_notice, encode

    ok = Released(group=G, job="a", request_id="r", epoch=1, pending_waiters=0, snapshot_deferred=True, ahead="b")
    assert decode_notice(encode(ok)) == ok
    forged = encode(ok).replace(b'"ahead":"b"', b'"ahead":"' + b"x" * 10_000 + b'"')
    with pytest.raises(msgspec.ValidationError):
        decode_notice(forged)


def test_a_hostile_sequence_header_moves_no_read_floor() -> None:
    """The ``Ts-Seq`` header of a notice is a stream sequence (at most 20 digits): a longer or non-numeric one is
    ignored (``int()`` of thousands of digits would raise in the notice callback)."""
    from types import SimpleNamespace

    from timeslice_client import AsyncTimeSliceClient
    from timeslice_client.protocol import NOTICE_SEQ_HEADER

    client = AsyncTimeSliceClient("a", G, "nats://127.0.0.1:1")
    for raw in ("9" * 5000, "-3", "12a", ""):
        client._heard(SimpleNamespace(headers={NOTICE_SEQ_HEADER: raw}))  # type: ignore[arg-type]
        assert client._read_floor == 0
    client._heard(SimpleNamespace(headers={NOTICE_SEQ_HEADER: "41"}))  # type: ignore[arg-type]
    assert client._read_floor == 41
