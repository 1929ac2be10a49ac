"""The predictive restore from phase events (``Phase``, ``_predict.note_phase``) through the pure core: a job's
phase start made while it is away from the group is a cue for its next ask; learned (the last two measures of each
phase), it plans the job's restore ahead of its ask when the group is idle, earlier than the cycle rule would. With
the policy off, phase events leave no trace; any ask drops the plan; the record stays bounded and strict to decode."""

from __future__ import annotations

import msgspec
import pytest
from timeslice_client.protocol import (
    MAX_PHASE_CUES,
    Cycle,
    Granted,
    GroupRecord,
    Phase,
    PhaseCue,
    Prediction,
    Restore,
    SetPolicy,
    Snapshot,
    decode_input,
    decode_record,
    encode,
)
from timeslice_orchestrator.core import LIMITS, apply

from .core_sim import G, Sim, commands, notices

HOLD_MS = 2_000
PHASE_MS = 3_000  # b's phase start -> its next ask, always
LATE_MS = 17_000  # b's release -> its phase start in the learning rounds (away 20 s in all)


def _phase(sim: Sim, job: str, name: str = "rollout", *, edge: str = "start", dt: int = 0) -> None:
    sim(Phase(group=G, job=job, name=name, edge=edge), dt=dt)  # type: ignore[arg-type]


def _a_turn(sim: Sim, *, dt: int = 100) -> None:
    """a asks ``dt`` after b's release, is switched in, holds HOLD_MS and releases with nobody waiting."""
    sim.settle(sim.acquire("a", dt=dt))
    sim.renew("a")
    sim.release("a", dt=HOLD_MS)


def _b_turn(sim: Sim) -> None:
    """b asks, is switched in (or granted at once), holds HOLD_MS and releases with nobody waiting."""
    actions = sim.acquire("b")
    if not notices(actions, Granted):
        sim.settle(actions)
    sim.renew("b")
    sim.release("b", dt=HOLD_MS)


def _learned(*, predict: bool = True, rounds: int = 2) -> Sim:
    """a and b take turns; b stays away 20 s each time and publishes its phase ``rollout`` PHASE_MS before it asks."""
    sim = Sim()
    sim.register("a", "n1")
    sim.register("b", "n1")
    if predict:
        sim(SetPolicy(group=G, predict=True))
    sim.hold("b")
    sim.release("b", dt=HOLD_MS)
    for _ in range(rounds):
        released = sim.now
        _a_turn(sim)
        _phase(sim, "b", dt=released + LATE_MS - sim.now)
        sim.now += PHASE_MS
        _b_turn(sim)
    return sim


def test_a_phase_start_is_learned_with_the_time_to_the_next_ask() -> None:
    sim = _learned()
    cue = sim.rec.cycles["b"].phases["rollout"]
    assert cue.asked and cue.gap_ms == PHASE_MS and cue.prev_gap_ms == PHASE_MS


def test_a_phase_start_plans_ahead_of_what_the_cycle_rule_would() -> None:
    sim = _learned()
    _a_turn(sim)  # a's release: the cycle rule expects b after its longest time away (20 s after b's release)
    by_cycle = sim.rec.plan
    assert by_cycle is not None and by_cycle.job == "b" and by_cycle.phase is None
    _phase(sim, "b", dt=100)  # b's rollout starts early this time
    plan = sim.rec.plan
    assert plan is not None and plan.job == "b" and plan.phase == "rollout", plan
    lead = 2 * sim.rec.cycles["b"].switch_in_ms
    assert plan.at_ms == sim.now + PHASE_MS - lead < by_cycle.at_ms


def test_the_phase_plan_restores_b_and_its_ask_is_granted_at_once() -> None:
    sim = _learned()
    _a_turn(sim)
    _phase(sim, "b", dt=100)
    plan = sim.rec.plan
    assert plan is not None
    snap, restore = commands(sim.tick(dt=plan.at_ms - sim.now))
    assert isinstance(snap, Snapshot) and snap.job == "a" and isinstance(restore, Restore) and restore.job == "b"
    for c in (snap, restore):
        sim.result(c)
    assert sim.rec.restored_ahead == "b"
    actions = sim.acquire("b", dt=PHASE_MS - (sim.now - plan.at_ms))
    (g,) = notices(actions, Granted)
    assert commands(actions) == [] and g.job == "b" and g.context_restored


def test_a_phase_start_without_a_measure_or_on_a_busy_group_plans_nothing() -> None:
    sim = _learned()
    _a_turn(sim)
    sim.acquire("a", dt=10)  # a asks again (drops any plan) and holds: the group is not idle
    sim.renew("a")
    _phase(sim, "b", dt=10)
    assert sim.rec.plan is None
    sim.release("a", dt=10)
    sim.acquire("a", dt=10)
    sim.renew("a")
    sim.release("a", dt=10)
    by_cycle = sim.rec.plan  # (the cycle rule may plan at that release)
    _phase(sim, "b", name="never-measured", dt=1)
    assert sim.rec.plan == by_cycle, "a phase never measured plans nothing"


@pytest.mark.parametrize("late", [False, True])
def test_no_phase_plan_when_the_loaded_job_is_expected_back_first(late: bool) -> None:
    """Cautious as the cycle rule: a, whose context is loaded, comes back (by its cycle) before b's phase says b asks;
    late (its time has passed), it is still expected at any moment."""
    sim = _learned()
    _a_turn(sim)
    a = sim.rec.cycles["a"]
    assert a.released_ms == sim.now and not a.asked
    away = 500 if late else 1_000 + PHASE_MS - 1  # b's phase starts 1 s after a's release: a back before b asks
    sim.rec = msgspec.structs.replace(
        sim.rec, plan=None, cycles={**sim.rec.cycles, "a": msgspec.structs.replace(a, gap_ms=away, prev_gap_ms=away)}
    )
    _phase(sim, "b", dt=1_000)
    assert sim.rec.plan is None


@pytest.mark.parametrize("who", ["a", "b"])
def test_any_ask_drops_a_phase_plan(who: str) -> None:
    sim = _learned()
    _a_turn(sim)
    _phase(sim, "b", dt=100)
    plan = sim.rec.plan
    assert plan is not None and plan.at_ms > sim.now + 1
    actions = sim.acquire(who, dt=1)
    assert sim.rec.plan is None and (sim.rec.switch is None or sim.rec.switch.ahead is None)
    if who == "a":
        (g,) = notices(actions, Granted)
        assert g.job == "a" and commands(actions) == [], "nothing moved: a re-acquire"
    assert commands(sim.tick(dt=10 * PHASE_MS)) == [], "the plan is gone"


def test_an_end_and_the_holders_phases_teach_nothing() -> None:
    sim = _learned()
    before = sim.rec.cycles["b"]
    sim.hold("b")
    _phase(sim, "b", dt=10)  # while b holds: not away
    _phase(sim, "b", name="train", dt=10)
    sim.release("b", dt=10)
    _phase(sim, "b", edge="end", dt=10)  # an end: nothing
    c = sim.rec.cycles["b"]
    assert c.phases == before.phases, c


def test_an_unregistered_jobs_phase_is_ignored() -> None:
    sim = _learned()
    rec = sim.rec
    _phase(sim, "stranger", dt=10)
    assert sim.rec is rec and "stranger" not in sim.rec.cycles


@pytest.mark.parametrize("edge", ["start", "end"])
@pytest.mark.parametrize("holding", [False, True])
def test_with_the_policy_off_a_phase_event_leaves_no_trace(edge: str, holding: bool) -> None:
    sim = _learned(predict=False)
    if holding:
        sim.hold("b")
    rec = sim.rec
    assert rec.cycles == {} and rec.plan is None
    new, actions = apply(rec, Phase(group=G, job="b", name="rollout", edge=edge), sim.now + 10, sim.seq + 1)  # type: ignore[arg-type]
    assert new is rec and actions == [], "the same record: not even its last_seq moves"


def test_turning_the_policy_off_forgets_the_phase_cues() -> None:
    sim = _learned()
    _a_turn(sim)
    _phase(sim, "b", dt=100)
    assert sim.rec.plan is not None
    sim(SetPolicy(group=G, predict=False))
    rec: GroupRecord = sim.rec
    assert rec.plan is None and rec.cycles == {}


# --------------------------------------------------------------------------- bounds


def test_a_job_keeps_the_cues_of_its_latest_phase_names_only() -> None:
    sim = _learned()
    names = [f"p{i}" for i in range(3 * MAX_PHASE_CUES)]
    for name in names:
        _phase(sim, "a", name=name, dt=1)  # a is away: each start is kept
    kept = sim.rec.cycles["a"].phases
    assert sorted(kept) == sorted(names[-MAX_PHASE_CUES:])


def test_the_jobs_with_cues_are_bounded_by_max_cycles() -> None:
    sim = Sim()
    sim(SetPolicy(group=G, predict=True))
    jobs = [f"j{i}" for i in range(LIMITS.max_cycles + 8)]
    for job in jobs:
        sim.register(job, "n1")
        _phase(sim, job, dt=1)
    assert len(sim.rec.cycles) == LIMITS.max_cycles
    assert set(sim.rec.cycles) == set(jobs[-LIMITS.max_cycles :])


def _record(cycle: Cycle) -> bytes:
    return encode(GroupRecord(group=G, predict=True, cycles={"b": cycle}))


def test_a_record_with_too_many_or_too_long_phase_names_is_refused_at_decoding() -> None:
    ok = Cycle(phases={f"p{i}": PhaseCue(gap_ms=1) for i in range(MAX_PHASE_CUES)})
    assert decode_record(_record(ok)).cycles["b"] == ok
    with pytest.raises(msgspec.ValidationError):
        decode_record(_record(Cycle(phases={f"p{i}": PhaseCue() for i in range(MAX_PHASE_CUES + 1)})))
    with pytest.raises(msgspec.ValidationError):
        decode_record(_record(Cycle(phases={"x" * 65: PhaseCue()})))
    plan = GroupRecord(group=G, predict=True, plan=Prediction(job="b", at_ms=1, phase="x" * 65))
    with pytest.raises(msgspec.ValidationError):
        decode_record(encode(plan))
    forged = encode(Phase(group=G, job="b", name="rollout", edge="start")).replace(b"rollout", b"r" * 10_000)
    with pytest.raises(msgspec.ValidationError):
        decode_input(forged)


def test_records_without_phase_cues_read_as_before() -> None:
    """Cycle and Prediction leave their defaults out (``omit_defaults``): a record without phase cues or with a
    cycle-rule plan is what an orchestrator older than them wrote, and reads."""
    rec = GroupRecord(group=G, predict=True, cycles={"b": Cycle(gap_ms=5)}, plan=Prediction(job="b", at_ms=7))
    raw = encode(rec)
    assert b"phase" not in raw and decode_record(raw) == rec
    old = b'{"group":"g","predict":true,"cycles":{"b":{"released_ms":-1,"asked":true,"gap_ms":5}}}'
    assert decode_record(old).cycles["b"] == Cycle(gap_ms=5)


# --------------------------------------------------------------------------- what people see


def test_status_and_replay_say_a_phase_planned_it() -> None:
    from timeslice_cli._status import render_table
    from timeslice_orchestrator.replay import StreamEvent, fold_events, render_summary

    sim = _learned()
    _a_turn(sim)
    _phase(sim, "b", dt=100)
    assert sim.rec.plan is not None
    text = render_table([sim.rec], [], sim.now)
    assert "predictive restore: b expected next (its phase rollout started), its restore starts in" in text, text
    for c in commands(sim.tick(dt=sim.rec.plan.at_ms - sim.now)):
        sim.result(c)
    sim.acquire("b", dt=10)
    r = fold_events([StreamEvent(seq, ts, subject, data) for seq, ts, subject, data in sim.stream])
    assert r.violations == []
    last = r.groups[G].predictions[-1]
    assert (last.job, last.outcome, last.phase) == ("b", "hit", "rollout")
    assert "g/b: started, its job granted next (planned at its phase rollout's start)" in render_summary(r)
