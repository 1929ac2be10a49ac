"""``timeslice replay``: the fold's intervals and summary maths on constructed streams, and a replay of a
real run (orchestrator + agent + two jobs on a real nats-server) equal to what the live orchestrator decided."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from timeslice_agent import Agent, AgentConfig
from timeslice_cli._replay import parse_time
from timeslice_client import AsyncTimeSliceClient, CallbackHandler, HandlerResult, SuspendMode
from timeslice_client.bus import connect
from timeslice_client.protocol import Granted, OpResult, Release, Released, decode_input, decode_notice, subjects
from timeslice_orchestrator.replay import Replay, StreamEvent, fold_events, read_window, render_summary
from timeslice_orchestrator.replay._summary import clipped, quantile

from .agent_harness import timeslice
from .helpers import eventually, group_record, running
from .replay_streams import MB, StreamBuilder, alternating, op_id

T0 = 1_000_000

# --------------------------------------------------------------------------- constructed streams


def test_alternating_holds_waits_switches_and_lanes() -> None:
    events, exp = alternating(3, t0=T0)
    r = fold_events(events)
    assert r.violations == []
    g = r.groups["g"]
    assert [(h.job, h.epoch, h.start_ms, h.end_ms) for h in g.holds] == exp.holds
    assert [h.end for h in g.holds] == ["released"] * 4
    # a's first grant restored nothing but went through the agent (45 ms); later grants waited in the queue
    assert [h.waited_ms for h in g.holds] == [45, 658, 658, 658]
    assert [(w.job, w.start_ms - T0, w.end_ms - T0 if w.end_ms else None, w.outcome, w.epoch) for w in g.waits] == [
        ("a", 100, 145, "granted", 1),
        ("b", 445, 1103, "granted", 2),
        ("a", 1403, 2061, "granted", 3),
        ("b", 2361, 3019, "granted", 4),
    ]
    assert [(s.epoch, s.to_job, s.snapshotted, s.granted) for s in g.switches] == [
        (1, "a", [], True),
        (2, "b", ["a"], True),
        (3, "a", ["b"], True),
        (4, "b", ["a"], True),
    ]
    assert [
        (s.start_ms - T0, s.restore_from_ms and s.restore_from_ms - T0, s.end_ms and s.end_ms - T0) for s in g.switches
    ][1] == (955, 1040, 1103)
    assert [(h.from_job, h.to_job, h.epoch, h.ms) for h in g.handoffs] == [
        ("a", "b", 2, 148),
        ("b", "a", 3, 148),
        ("a", "b", 4, 148),
    ]
    lane_a = r.nodes[("n1", "a")]
    assert [(s.state, s.start_ms - T0, s.end_ms - T0 if s.end_ms else None) for s in lane_a.states] == [
        ("IDLE", 0, 100),
        ("TRANSITIONING", 100, 145),
        ("RUNNING", 145, 955),
        ("TRANSITIONING", 955, 1040),
        ("SAVED", 1040, 1998),
        ("TRANSITIONING", 1998, 2061),
        ("RUNNING", 2061, 2871),
        ("TRANSITIONING", 2871, 2956),
        ("SAVED", 2956, None),
    ]
    assert [
        (o.op_id, o.kind, o.start_ms - T0, o.end_ms and o.end_ms - T0, o.ok, o.bytes, o.backend) for o in lane_a.ops
    ] == [
        (op_id("g", 1, "restore", "n1"), "restore", 105, 145, True, 0, "app_channel"),
        (op_id("g", 2, "snapshot", "n1"), "snapshot", 960, 1040, True, 256 * MB, "app_channel"),
        (op_id("g", 3, "restore", "n1"), "restore", 2001, 2061, True, 256 * MB, "app_channel"),
        (op_id("g", 4, "snapshot", "n1"), "snapshot", 2876, 2956, True, 256 * MB, "app_channel"),
    ]
    assert r.nodes[("n1", "b")].states[-1].state == "RUNNING"  # b is still loaded after its release
    assert [(p.name, p.start_ms - T0, p.end_ms and p.end_ms - T0) for p in r.phases["b"]] == [
        ("train", 1104, 1903),
        ("reward", 1914, 2313),
    ]


def test_a_restore_beside_the_snapshot_moves_its_lane_when_it_starts() -> None:
    """The agent overlapped b's restore with a's snapshot (``OpStarted.overlapped``): the stream passes the
    checker, the switch restores from the restore's start, and b's lane moves then, not after a's snapshot."""
    events, exp = alternating(3, t0=T0, overlap=True)
    r = fold_events(events)
    assert r.violations == []
    g = r.groups["g"]
    assert [(h.job, h.epoch, h.start_ms, h.end_ms) for h in g.holds] == exp.holds
    # switch 3 (b -> a) starts at b's release (1913); a's restore runs 1923-1973 beside b's snapshot 1918-1998
    s3 = next(s for s in g.switches if s.epoch == 3)
    assert (s3.start_ms - T0, s3.restore_from_ms and s3.restore_from_ms - T0, s3.end_ms and s3.end_ms - T0) == (
        1913,
        1923,
        1998,
    )
    lane_a = r.nodes[("n1", "a")]
    states = [(s.state, s.start_ms - T0, s.end_ms - T0 if s.end_ms else None) for s in lane_a.states]
    # a's context is back (RUNNING on the node) at 1973; the grant waits for b's snapshot (1998)
    assert states[4:7] == [("SAVED", 1040, 1923), ("TRANSITIONING", 1923, 1973), ("RUNNING", 1973, 2808)]
    assert next(h for h in g.holds if h.epoch == 3).start_ms - T0 == 1998
    assert [h.ms for h in g.handoffs] == [148, 85, 85]


def test_alternating_summary_maths() -> None:
    events, exp = alternating(3, t0=T0)
    s = fold_events(events).summary
    assert (s.since_ms, s.until_ms) == (T0, exp.end_ms)
    gs = s.groups["g"]
    window = exp.end_ms - T0
    held = sum(end - start for _, _, start, end in exp.holds if end is not None)
    assert gs.window_ms == window and gs.duty_cycle == pytest.approx(held / window)
    assert (gs.grants, gs.switches, gs.handoffs, gs.faults, gs.lease_expiries) == (4, 4, 3, 0, 0)
    assert gs.wait_p50_ms == pytest.approx(658) and gs.wait_p95_ms == pytest.approx(658)
    assert gs.snapshot_p50_ms == pytest.approx(80) and gs.restore_p50_ms == pytest.approx(60)
    assert gs.snapshot_gbps == pytest.approx(256 * MB / 0.080 / 1e9)
    assert gs.restore_gbps == pytest.approx(256 * MB / 0.060 / 1e9)  # restores that moved nothing are left out
    assert gs.handoff_p50_ms == pytest.approx(148)
    assert s.jobs["a"].held_ms == (955 - 145) + (2871 - 2061)
    assert s.jobs["b"].waited_ms == (1103 - 445) + (3019 - 2361)
    assert s.jobs["a"].phase_ms == {"train": 799 * 2, "reward": 399 * 2}
    text = render_summary(fold_events(events))
    assert "g  " in text and "%" in text and "80.0 ms" in text and "3.36" in text and "TRAIN" in text


def test_window_clips_intervals_and_figures() -> None:
    events, _ = alternating(3, t0=T0)
    since, until = T0 + 1500, T0 + 2500  # inside b's hold (1103..1913), a's wait and a's next hold (2061..2871)
    r = fold_events(events, since_ms=since, until_ms=until)
    g = r.groups["g"]
    assert [(h.job, h.epoch) for h in g.holds] == [("b", 2), ("a", 3)]
    assert g.holds[1].end_ms is None  # still held at `until`: the fold stops there
    gs = r.summary.groups["g"]
    assert gs.window_ms == 1000
    assert gs.duty_cycle == pytest.approx(((1913 - 1500) + (2500 - 2061)) / 1000)
    assert (gs.grants, gs.switches, gs.handoffs) == (1, 1, 1)
    assert r.summary.jobs["a"].held_ms == 2500 - 2061
    assert r.summary.jobs["a"].waited_ms == 2061 - 1500


def test_lease_expiry_fault_and_failed_op() -> None:
    b = StreamBuilder("h")
    b.register(T0, "a", "n1")
    b.register(T0, "b", "n1")
    b.acquire(T0 + 10, "a", "a1", confirm_ms=1_000)
    b.op(T0 + 11, T0 + 20, "n1", "a", "restore", 1)
    b.tick(T0 + 1_020)  # never renewed: the confirmation window ends, the grant is revoked
    b.acquire(T0 + 1_100, "b", "b1")
    b.op(T0 + 1_101, T0 + 1_150, "n1", "a", "snapshot", 2, ok=False, error="cannot offload")
    b.op(T0 + 1_151, T0 + 1_170, "n1", "b", "restore", 2)
    r = fold_events(b.events)
    g = r.groups["h"]
    assert [(h.job, h.epoch, h.end) for h in g.holds] == [("a", 1, "grant not confirmed in time"), ("b", 2, "")]
    assert [(f.job, f.ts_ms - T0) for f in g.faults] == [("a", 1_150)] and "cannot offload" in g.faults[0].reason
    gs = r.summary.groups["h"]
    assert (gs.lease_expiries, gs.faults, gs.handoffs) == (1, 1, 1)
    assert gs.snapshot_p50_ms is None  # the only snapshot failed
    snap = r.nodes[("n1", "a")].ops[-1]
    assert (snap.kind, snap.ok, snap.error) == ("snapshot", False, "cannot offload")
    assert r.nodes[("n1", "a")].states[-1].state == "FAULTED"


def test_duplicates_and_other_groups_are_skipped() -> None:
    events, _ = alternating(1, t0=T0)
    other, _ = alternating(1, group="other", t0=T0)
    mixed = sorted(
        [*events, *[StreamEvent(e.seq + 1000, e.ts_ms, e.subject, e.data) for e in other]], key=lambda e: e.seq
    )
    with_dupes = [*mixed[:10], *mixed[5:10], *mixed[10:]]
    one = fold_events(with_dupes, group="g")
    assert set(one.groups) == {"g"} and all(k[1] in {"a", "b"} and lane.group == "g" for k, lane in one.nodes.items())
    assert one.to_json()["groups"] == fold_events(events).to_json()["groups"]
    assert set(fold_events(mixed).groups) == {"g", "other"}


def test_empty_stream_and_quantiles() -> None:
    r = fold_events([])
    assert r.groups == {} and r.summary.groups == {} and "no group" in render_summary(r)
    assert quantile([], 0.5) is None
    assert quantile([5.0], 0.95) == 5.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([float(i) for i in range(101)], 0.95) == pytest.approx(95.0)
    assert clipped(10, 20, 0, 100) == 10 and clipped(10, None, 0, 15) == 5 and clipped(10, 20, 30, 40) == 0


def test_parse_time() -> None:
    now = 1_800_000_000_000
    assert parse_time("10m", now) == now - 600_000
    assert parse_time("1.5h", now) == now - 5_400_000
    assert parse_time("now", now) == now
    assert parse_time("1790000000000", now) == 1_790_000_000_000
    assert parse_time("2026-11-30T10:00:00Z", now) == parse_time("2026-11-30T11:00:00+01:00", now)
    assert parse_time("2026-11-30T10:00:00", now) == int(dt.datetime(2026, 11, 30, 10).timestamp() * 1000)  # local
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_time("yesterday", now)


# --------------------------------------------------------------------------- a real run


@pytest.fixture
async def agent(nats_url: str) -> AsyncIterator[Agent]:
    async with running(Agent(AgentConfig(node_id="node-1", nats_url=nats_url))) as a:
        yield a


def _handler(nbytes: int) -> CallbackHandler:
    def moved(mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return HandlerResult(bytes_moved=nbytes, device_bytes_freed=nbytes)

    return CallbackHandler(suspend=moved, resume=moved)


async def _queued(c: AsyncTimeSliceClient, job: str) -> bool:
    return job in [w.job for w in (await group_record(c)).queue]


@pytest.mark.usefixtures("orchestrator")
async def test_replay_of_a_real_run_equals_the_live_decisions(nats_url: str, agent: Agent) -> None:
    group, rounds = "gr", 3
    nc = await connect(nats_url)
    notices = await nc.subscribe(f"ts.v1.notice.{group}.>", max_msgs=0)
    results = await nc.subscribe(subjects.agent_event("node-1", group))
    live: list[Any] = []
    async with AsyncTimeSliceClient("a", group, nats_url) as a, AsyncTimeSliceClient("b", group, nats_url) as b:
        await a.register_workload(_handler(3 * MB), node_id="node-1")
        await b.register_workload(_handler(5 * MB), node_id="node-1")
        clients = {"a": a, "b": b}
        await a.acquire(timeout=10)
        holder, other = "a", "b"
        for _ in range(rounds):
            async with clients[holder].phase("train"):
                waiting = asyncio.create_task(clients[other].acquire(timeout=10))
                await eventually(functools.partial(_queued, clients[holder], other), what=f"{other} queued")
            await clients[holder].release()
            await waiting
            holder, other = other, holder
        await clients[holder].release()
        await eventually(lambda: agent.jobs()[other].state == "SAVED", what="last snapshot settled")
        agent_states = {j: str(c.state) for j, c in agent.jobs().items()}

    # what the live orchestrator decided, as its notices told the jobs
    async def drain(sub: Any) -> list[bytes]:
        out = []
        with contextlib.suppress(TimeoutError):
            while True:
                out.append((await sub.next_msg(timeout=0.5)).data)
        return out

    live = [decode_notice(d) for d in await drain(notices)]
    op_results = [ev for d in await drain(results) if isinstance(ev := decode_input(d), OpResult)]
    await nc.close()
    grants = [n for n in live if isinstance(n, Granted)]
    releases = [n for n in live if isinstance(n, Released)]
    assert len(grants) == rounds + 1 and len(releases) == rounds + 1

    events = await read_window(nats_url, group=group)
    replay = fold_events(events, group=group)
    assert replay.violations == []
    holds = replay.groups[group].holds
    # same holders, same epochs
    assert [(h.job, h.epoch) for h in holds] == [(n.job, n.epoch) for n in grants]
    assert [(h.job, h.epoch) for h in holds] == [(n.job, n.epoch) for n in releases]
    # same intervals: a grant's lease deadline is its decision time + the confirmation window (3 s, the
    # default); a hold ends at the stream time of the release the Released notice answered
    release_ts = {
        (ev.job, ev.request_id): e.ts_ms
        for e in events
        if e.subject.endswith(".release")
        for ev in [decode_input(e.data)]
        if isinstance(ev, Release)
    }
    for h, g, rel in zip(holds, grants, releases, strict=True):
        assert h.start_ms == g.lease_deadline_ms - 3_000
        assert h.waited_ms == g.waited_ms and h.context_restored == g.context_restored
        assert h.end_ms == release_ts[(rel.job, rel.request_id)]
    # the node lanes show the agent's operations, with their epochs and bytes
    bars = {o.op_id: o for lane in replay.nodes.values() for o in lane.ops}
    assert {r.op_id for r in op_results} == set(bars)
    for res in op_results:
        bar = bars[res.op_id]
        assert (bar.kind, bar.epoch, bar.ok, bar.bytes, bar.backend) == (
            res.kind,
            res.epoch,
            True,
            res.bytes_moved,
            "app_channel",
        )
        assert bar.start_ms <= bar.end_ms  # type: ignore[operator]
    assert {k: lane.states[-1].state for k, lane in replay.nodes.items()} == {
        ("node-1", holder): "RUNNING",
        ("node-1", other): "SAVED",
    }
    assert agent_states == {holder: "RUNNING", other: "SAVED"}  # what the agent itself said
    summary = replay.summary.groups[group]
    assert (summary.grants, summary.handoffs, summary.switches) == (rounds + 1, rounds, rounds + 1)
    assert summary.snapshot_p50_ms is not None and summary.restore_p50_ms is not None
    assert [p.name for p in replay.phases["a"]] == ["train"] * ((rounds + 1) // 2)

    # the command prints the same fold as JSON
    rc, out = await timeslice(nats_url, "replay", "--group", group, "--json")
    assert rc == 0, out
    assert json.loads(out)["groups"] == json.loads(json.dumps(replay.to_json()))["groups"]
    rc, out = await timeslice(nats_url, "replay")
    assert rc == 0 and f"{group} " in out and "SNAPSHOT p50" in out, out
    # a window: the holds that reach into it, figures over it
    since = holds[2].start_ms
    rc, out = await timeslice(nats_url, "replay", "--group", group, "--since", str(since), "--json")
    assert rc == 0, out
    window = json.loads(out)
    assert [h["epoch"] for h in window["groups"][group]["holds"]] == [h.epoch for h in holds[2:]]
    assert window["summary"]["groups"][group]["grants"] == len(holds) - 2


async def test_replay_of_an_empty_server(nats_url: str) -> None:
    rc, out = await timeslice(nats_url, "replay")
    assert rc == 2 and "does not exist" in out, out
    rc, out = await timeslice(nats_url, "replay", "--since", "yesterday")
    assert rc == 2 and "ISO 8601" in out, out


def test_exports() -> None:
    import timeslice_orchestrator.replay as replay

    assert {
        "read_window",
        "fold_events",
        "render_summary",
        "write_html",
        "Replay",
        "Summary",
        "GroupSummary",
        "JobSummary",
        "StreamEvent",
        "GroupTimeline",
        "JobLane",
    } <= set(replay.__all__)
    assert all(hasattr(replay, name) for name in replay.__all__)


def test_replay_json_is_builtins() -> None:
    events, _ = alternating(2, t0=T0)
    r: Replay = fold_events(events)
    again = json.loads(json.dumps(r.to_json()))
    assert again["nodes"][0]["node"] == "n1" and again["summary"]["groups"]["g"]["switches"] == 3
