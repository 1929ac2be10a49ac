"""``timeslice_orchestrator.advise``: jobs' recorded phases replayed on one group through the pure core.

The simulation is checked against runs worked out by hand, against the lock's own rules (one holder at a time, every
phase run, nothing revoked in runs longer than the core's windows) over generated phase sequences, and the traces
against replays built by hand."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from timeslice_orchestrator import AdviseError
from timeslice_orchestrator.advise import JobTrace, Phase, SwitchCost, predict, simulate, trace_of, traces
from timeslice_orchestrator.replay import GroupTimeline, HoldInterval, JobLane, OpBar, Replay, Summary

HOP = 0.001
FREE = SwitchCost()


def on(s: float) -> Phase:
    return Phase(True, s)


def off(s: float) -> Phase:
    return Phase(False, s)


def trace(job: str, *phases: Phase, cost: SwitchCost = FREE) -> JobTrace:
    return JobTrace(job, "g", phases, sum(p.seconds for p in phases), cost)


def holds_of(log: dict[str, list[tuple[str, float]]]) -> list[tuple[float, float, str]]:
    out = []
    for job, events in log.items():
        granted = None
        for kind, t in events:
            if kind == "grant":
                granted = t
            elif kind == "release":
                assert granted is not None
                out.append((granted, t, job))
                granted = None
    return sorted(out)


def test_two_jobs_take_turns_as_worked_out_by_hand() -> None:
    # a: 1 s on, 1 s off, 1 s on. b the same. b asks at 0 too and waits for a's first hold; a's second hold waits
    # for b's first; so: a 0-1, b 1-2, a 2-3, b 3-4 (plus bus passes), with free switches.
    a = trace("a", on(1), off(1), on(1))
    b = trace("b", on(1), off(1), on(1))
    p = predict([a, b], hop_s=HOP)
    assert p.makespan_s == pytest.approx(4.0, abs=0.02)
    assert p.back_to_back_s == pytest.approx(6.0)
    assert p.switches == 3 and p.duty_cycle == pytest.approx(1.0, abs=0.02)
    a_out, b_out = p.jobs
    assert a_out.shared_s == pytest.approx(3.0, abs=0.02) and a_out.waited_s == pytest.approx(0.0, abs=0.02)
    assert b_out.waited_s == pytest.approx(1.0, abs=0.02) and b_out.switched_in == 2
    assert p.notes and "free" in p.notes[0]  # no switch costs known: the report says so


def test_switch_costs_in_order_and_beside() -> None:
    cost = SwitchCost(snapshot_s=0.2, restore_s=0.1, source="given")
    a = trace("a", on(1), off(0.5), on(1), cost=cost)
    b = trace("b", on(1), off(0.5), on(1), cost=cost)
    in_order = predict([a, b], hop_s=HOP)
    beside = predict([a, b], hop_s=HOP, room=True)
    # In order: every switch to a job whose context was saved costs its snapshot and then its restore.
    assert in_order.makespan_s > beside.makespan_s > predict([trace("a", *a.phases), trace("b", *b.phases)]).makespan_s
    # b's first grant follows a's snapshot only (b never ran: nothing to restore); the next two are full switches.
    assert in_order.switching_s == pytest.approx(0.2 + 2 * 0.3, abs=0.03)
    # With room the incoming job is granted on its restore: the outgoing snapshot leaves the critical path.
    assert beside.switching_s == pytest.approx(0.0 + 2 * 0.1, abs=0.03)
    assert beside.switch_median_s == pytest.approx(0.1, abs=0.01)
    assert not in_order.notes


def test_switch_costs_longer_than_the_cores_resend_are_paid_whole() -> None:
    # The core sends a command again after resend_ms (3 s) while it waits for its answer; the simulated agent answers
    # each operation once, as the real one does, so a 21.3 s snapshot holds the switch for 21.3 s, not 3.
    cost = SwitchCost(snapshot_s=21.3, restore_s=2.5, source="given")
    a = trace("a", on(30), off(1), on(30), cost=cost)
    b = trace("b", on(30), off(1), on(30), cost=cost)
    in_order = predict([a, b], hop_s=HOP)
    # b's first grant waits for a's snapshot; the two switches after it cost a snapshot and a restore each.
    assert in_order.switching_s == pytest.approx(21.3 + 2 * (21.3 + 2.5), abs=0.1)
    # With room, a restore runs beside the other job's snapshot (each job's own snapshot ended during the other's
    # 30 s hold): the switches back cost the restore alone.
    assert predict([a, b], hop_s=HOP, room=True).switch_median_s == pytest.approx(2.5, abs=0.01)


def test_a_job_alone_in_a_prediction_of_two_waits_for_nothing() -> None:
    # b never overlaps a (it starts with a long stretch off the accelerators): each runs as alone.
    a = trace("a", on(0.5), off(0.2), on(0.5))
    b = trace("b", off(2.0), on(0.5))
    p = predict([a, b], hop_s=HOP)
    assert p.makespan_s == pytest.approx(2.5, abs=0.02)
    assert all(o.waited_s < 0.01 for o in p.jobs)


def test_holds_and_waits_longer_than_the_cores_windows_are_kept_alive() -> None:
    # Two hours on the accelerators while the other job waits: the simulated clients renew as the real one does, so
    # no lease lapses and no wait is dropped (the core's waiter window is at most 10 minutes).
    a = trace("a", on(7200), off(1), on(10))
    b = trace("b", on(3600))
    p = predict([a, b], hop_s=HOP)
    assert p.makespan_s == pytest.approx(7200 + 3600 + 10, abs=1)
    assert [o.held_s for o in p.jobs] == pytest.approx([7210, 3600], abs=0.1)


def test_a_prediction_takes_two_jobs_each_once() -> None:
    with pytest.raises(AdviseError):
        predict([trace("a", on(1))])
    with pytest.raises(AdviseError):
        predict([trace("a", on(1)), trace("a", on(1))])


phases = st.lists(st.tuples(st.booleans(), st.floats(min_value=0.0, max_value=5.0)), min_size=1, max_size=12)
costs = st.tuples(st.floats(min_value=0, max_value=0.5), st.floats(min_value=0, max_value=0.5))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(phases, costs), min_size=2, max_size=4), st.booleans())
def test_any_jobs_hold_one_at_a_time_and_run_every_phase(jobs: list, room: bool) -> None:  # type: ignore[type-arg]
    ts = [
        trace(f"j{i}", *(Phase(acc, s) for acc, s in ph), cost=SwitchCost(c[0], c[1], "given"))
        for i, (ph, c) in enumerate(jobs)
    ]
    run = simulate({t.job: t.phases for t in ts}, {t.job: t.cost for t in ts}, hop_s=HOP, room=room)
    held = holds_of(run.log)
    for (_, end, _), (start, _, _) in itertools.pairwise(held):
        assert start >= end - 1e-9  # never two holders at once
    for t in ts:
        kinds = [k for k, _ in run.log[t.job]]
        assert kinds.count("grant") == t.holds == kinds.count("release") and kinds[-1] == "end"
        mine = sum(e - s for s, e, j in held if j == t.job)
        assert mine == pytest.approx(t.held_s, abs=1e-6)
    p = predict(ts, hop_s=HOP, room=room)
    assert p.makespan_s >= max(t.wall_s for t in ts) - 1e-9
    assert p.makespan_s >= sum(t.held_s for t in ts) - 1e-9
    # Never worse than one after the other, with every switch paid in full and every bus pass counted.
    worst = sum(t.wall_s for t in ts) + sum(t.holds * (t.cost.snapshot_s + t.cost.restore_s + 6 * HOP) for t in ts)
    assert p.makespan_s <= worst + 1e-6


def replay_of(holds: dict[str, list[HoldInterval]], lanes: dict[tuple[str, str], JobLane] | None = None) -> Replay:
    return Replay(
        since_ms=0,
        until_ms=0,
        groups={g: GroupTimeline(group=g, holds=hs) for g, hs in holds.items()},
        nodes=lanes or {},
        phases={},
        summary=Summary(0, 0),
    )


def hold(job: str, start: int, end: int, waited: int = 0) -> HoldInterval:
    return HoldInterval(job=job, epoch=1, start_ms=start, end_ms=end, waited_ms=waited)


def test_a_trace_is_the_jobs_holds_and_the_gaps_between_its_release_and_next_acquire() -> None:
    r = replay_of({"g": [hold("a", 1_000, 1_400, waited=5), hold("a", 2_000, 2_100, waited=300), hold("b", 0, 10)]})
    t = trace_of(r, "a")
    # Asked at 995, held 400 ms; released at 1400, asked again at 1700 (granted at 2000: its 300 ms wait is not its
    # own, the simulation puts back what sharing makes it), held 100 ms.
    assert t.phases == (on(0.4), off(0.3), on(0.1))
    assert t.wall_s == pytest.approx(1.105) and t.started_ms == 995 and t.group == "g"
    assert t.cost.source == "none"


def test_a_job_in_several_groups_is_named_with_its_group() -> None:
    r = replay_of({"g1": [hold("a", 0, 100)], "g2": [hold("a", 200, 300), hold("b", 0, 50)]})
    with pytest.raises(AdviseError, match="a@GROUP"):
        trace_of(r, "a")
    assert trace_of(r, "a", "g2").phases == (on(0.1),)
    with pytest.raises(AdviseError, match="no finished hold"):
        trace_of(r, "c")
    with pytest.raises(AdviseError, match="twice"):
        traces(r, ["a@g1", "a@g2"])
    with pytest.raises(AdviseError, match="at least two"):
        traces(r, ["b"])


def test_switch_costs_are_the_medians_of_the_jobs_operations_that_moved_its_context() -> None:
    def op(kind: str, ms: float, moved: int, ok: bool = True) -> OpBar:
        return OpBar(
            op_id=f"{kind}{ms}", kind=kind, epoch=1, start_ms=0, end_ms=int(ms), bytes=moved, elapsed_ms=ms, ok=ok
        )

    lane = JobLane(
        node="n",
        job="a",
        group="g",
        ops=[
            op("snapshot", 100, 10),
            op("snapshot", 300, 10),
            op("snapshot", 200, 10),
            op("snapshot", 5, 0),
            op("restore", 50, 10),
            op("restore", 900, 10, ok=False),
        ],
    )
    other = JobLane(node="n", job="b", group="g", ops=[op("snapshot", 9_000, 10)])
    r = replay_of({"g": [hold("a", 0, 100), hold("b", 100, 200)]}, {("n", "a"): lane, ("n", "b"): other})
    cost = trace_of(r, "a").cost
    assert (cost.snapshot_s, cost.restore_s, cost.source, cost.samples) == (0.2, 0.05, "measured", 4)
    given = SwitchCost(1.0, 2.0, "given")
    assert [t.cost for t in traces(r, ["a", "b"], {"*": given})] == [given, given]


def test_a_job_asking_at_a_higher_class_waits_less_in_the_prediction() -> None:
    import dataclasses

    steps = (on(1), off(0.2)) * 5
    ts = [trace(j, *steps) for j in ("a", "b", "c")]
    fifo = predict(ts, hop_s=HOP)
    ranked = predict([ts[0], ts[1], dataclasses.replace(ts[2], priority=9)], hop_s=HOP)
    waited = {o.job: o.waited_s for o in ranked.jobs}
    assert waited["c"] < min(waited["a"], waited["b"])  # c goes first whenever it waits
    assert {o.job: o.waited_s for o in fifo.jobs}["c"] > waited["c"]
    assert ranked.makespan_s == pytest.approx(fifo.makespan_s, abs=0.05)  # the same work, only reordered
