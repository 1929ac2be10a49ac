"""Early suspend: a job that releases a group another job waits for begins its workloads' suspend at once, and
the agent's snapshot command takes that outcome; when no switch follows, its next acquire resumes it.

The agent's snapshot can be held at a gate (a test backend wrapping ``app_channel``), so what the workload
did before the agent's command reached it is seen without timing windows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
from timeslice_agent import Agent
from timeslice_agent._backend_api import Outcome
from timeslice_agent.backends import AppChannelBackend, register_backend
from timeslice_client import (
    AsyncTimeSliceClient,
    GroupRecord,
    HandlerError,
    HandlerResult,
    JobState,
    SuspendMode,
    Unavailable,
    WorkloadChannel,
)
from timeslice_client.bus import connect
from timeslice_client.protocol import (
    JobContext,
    OpKind,
    OpResult,
    Release,
    WorkloadCommand,
    WorkloadReply,
    decode_input,
    encode,
    subjects,
)
from timeslice_orchestrator.replay._model import OpBar
from timeslice_orchestrator.replay._summary import _op_figures

from .agent_harness import Recorder, timeslice
from .helpers import eventually, group_record
from .test_agent_flow import stack
from .workers import read_stream

NODE = "node-1"


class _Gated(AppChannelBackend):
    """``app_channel`` whose snapshots wait for the test's gate before the command goes to the workload."""

    gate: asyncio.Event | None = None

    async def snapshot(self, ctx: JobContext, op):  # type: ignore[no-untyped-def]
        assert _Gated.gate is not None
        async with asyncio.timeout(20):
            await _Gated.gate.wait()
        return await super().snapshot(ctx, op)


@pytest.fixture
def gate() -> Iterator[asyncio.Event]:
    _Gated.gate = ev = asyncio.Event()
    register_backend("app_channel", _Gated)
    try:
        yield ev
    finally:
        _Gated.gate = None
        register_backend("app_channel", AppChannelBackend)


@pytest.fixture(params=["apart", "beside"])
async def agent(nats_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Agent]:
    async with stack(nats_url, str(request.param)) as a:
        yield a


async def _waiting(c: AsyncTimeSliceClient, job: str) -> bool:
    return job in [w.job for w in (await group_record(c)).queue]


async def test_a_contended_release_suspends_at_once_and_the_agents_command_takes_it(
    nats_url: str, gate: asyncio.Event, agent: Agent
) -> None:
    log: list[str] = []
    async with AsyncTimeSliceClient("a", "ge", nats_url) as a, AsyncTimeSliceClient("b", "ge", nats_url) as b:
        ch = await a.register_workload(Recorder("a", log), node_id=NODE)
        await b.register_workload(Recorder("b", log), node_id=NODE)
        await a.acquire(timeout=10)
        assert not a.contended
        tb = asyncio.create_task(b.acquire(timeout=30))
        await eventually(lambda: a.contended, what="the orchestrator tells a that b waits")
        await a.release()
        assert not a.contended
        # The agent's snapshot is held at the gate, so nothing but a's own release began this suspend.
        await eventually(lambda: ch.suspended, what="a suspended")
        assert log == ["a:suspend"] and ch.early_taken == 0 and not tb.done()
        gate.set()
        gb = await tb
        assert gb.context_restored and gb.epoch == 2
        assert log == ["a:suspend"] and ch.early_taken == 1, "the command took the early suspend, not a second one"
        assert agent.jobs()["a"].state is JobState.SAVED
        # The agent's result says so: its elapsed time covers only the end of the suspend, work_ms all of it.
        results = {
            r.kind: r
            for _, _, subj, data in await read_stream(nats_url)
            if subj == subjects.agent_event(NODE, "ge")
            and isinstance(r := decode_input(data), OpResult)
            and r.epoch == 2
        }
        snap, restore = results[OpKind.SNAPSHOT], results[OpKind.RESTORE]
        assert snap.ok and snap.began_at_release and snap.bytes_moved == 100 and snap.work_ms is not None
        assert not restore.began_at_release and restore.work_ms is None, "b never ran: nothing for it to do"
        rc, out = await timeslice(nats_url, "events", "--group", "ge")
        assert rc == 0, out
        (line,) = [ln for ln in out.splitlines() if " op_result " in ln and "op=snapshot" in ln and "epoch=2" in ln]
        assert "began_at_release work_ms=" in line, line
        # Back to a: b suspends early too (a waits), the agent resumes a as usual.
        ta = asyncio.create_task(a.acquire(timeout=30))
        await eventually(lambda: _waiting(b, "a"), what="a waits")
        await eventually(lambda: b.contended, what="the orchestrator tells b that a waits")
        await b.release()
        ga = await ta
        assert ga.context_restored and not ch.suspended and ch.early_resumed == 0
        assert log[0] == "a:suspend" and sorted(log[1:]) == ["a:resume", "b:suspend"]
        await eventually(lambda: agent.jobs()["a"].state is JobState.RUNNING, what="a running on the agent")
        await a.release()


async def test_with_early_suspend_off_the_workload_waits_for_the_agents_command(
    nats_url: str, gate: asyncio.Event
) -> None:
    log: list[str] = []
    async with (
        stack(nats_url, "apart"),
        AsyncTimeSliceClient("a", "go", nats_url) as a,
        AsyncTimeSliceClient("b", "go", nats_url) as b,
    ):
        ch = await a.register_workload(Recorder("a", log), node_id=NODE, early_suspend=False)
        await b.register_workload(Recorder("b", log), node_id=NODE)
        await a.acquire(timeout=10)
        tb = asyncio.create_task(b.acquire(timeout=30))
        await eventually(lambda: a.contended, what="the orchestrator tells a that b waits")
        await a.release()
        assert ch._early is None and log == [], "an early suspend begins inside release(), before it returns"
        gate.set()
        await tb
        assert log == ["a:suspend"] and ch.early_taken == 0 and ch.suspended


async def test_the_suspend_begins_before_the_stream_answers_and_a_failed_release_is_resumed_by_the_next_acquire(
    nats_url: str, gate: asyncio.Event
) -> None:
    """The early suspend begins once the release is written, not at the stream's answer: here the stream's
    answer never comes (the release goes out and its publish fails only after the suspend began), so the job
    still holds the group, and its next acquire (the same grant) resumes its state before it returns."""
    log: list[str] = []
    async with (
        stack(nats_url, "apart"),
        AsyncTimeSliceClient("a", "gf", nats_url) as a,
        AsyncTimeSliceClient("b", "gf", nats_url) as b,
    ):
        ch = await a.register_workload(Recorder("a", log), node_id=NODE)
        await b.register_workload(Recorder("b", log), node_id=NODE)
        g = await a.acquire(timeout=10)
        tb = asyncio.create_task(b.acquire(timeout=30))
        await eventually(lambda: a.contended, what="the orchestrator tells a that b waits")
        real = a._publish

        async def lost(msg: msgspec.Struct, msg_id: str | None = None, headers: dict[str, str] | None = None) -> int:
            if not isinstance(msg, Release):
                return await real(msg, msg_id, headers)
            assert a._nc is not None
            await a._nc.publish("test.lost.release", encode(msg))  # written, like the real one; never stored
            await eventually(lambda: ch.suspended, what="the suspend began before the stream's answer")
            raise Unavailable("the stream did not answer the release (test)", nats_url=nats_url)

        a._publish = lost  # type: ignore[method-assign]
        with pytest.raises(Unavailable):
            await a.release()
        a._publish = real  # type: ignore[method-assign]
        assert log == ["a:suspend"] and ch.suspended and ch.early_taken == 0
        g2 = await a.acquire(timeout=10)
        assert g2.epoch == g.epoch and not g2.context_restored, "a still held the group: the same grant"
        assert log == ["a:suspend", "a:resume"] and ch.early_resumed == 1 and not ch.suspended
        assert not tb.done()
        gate.set()
        await a.release()
        gb = await tb
        assert gb.epoch == g.epoch + 1 and ch.early_taken == 1 and log[-1] == "a:suspend"


@asynccontextmanager
async def _alone_again(
    nats_url: str, a_handler: Recorder
) -> AsyncIterator[tuple[AsyncTimeSliceClient, WorkloadChannel]]:
    """a holds, b starts waiting (a is told), b gives up, a releases: nobody waits any more, so no switch. a's
    client is closed at the end."""
    a = AsyncTimeSliceClient("a", "gw", nats_url)
    try:
        ch = await a.register_workload(a_handler, node_id=NODE)
        await a.acquire(timeout=10)
        async with AsyncTimeSliceClient("b", "gw", nats_url) as b:
            tb = asyncio.create_task(b.acquire(timeout=30))
            await eventually(lambda: a.contended, what="the orchestrator tells a that b waits")
            tb.cancel()
            with pytest.raises(asyncio.CancelledError):
                await tb
            await eventually(lambda: _gone(a), what="b's wait withdrawn")
        r = await a.release()
        assert r.pending_waiters == 0 and r.snapshot_deferred
        yield a, ch
    finally:
        await a.close()


async def _gone(c: AsyncTimeSliceClient) -> bool:
    return not (await group_record(c)).queue


async def _nobody_holds(c: AsyncTimeSliceClient) -> GroupRecord | None:
    rec = await group_record(c)
    return rec if rec.holder is None else None


async def test_no_switch_after_an_early_suspend_resumes_it_before_the_next_acquire_returns(
    nats_url: str, agent: Agent
) -> None:
    log: list[str] = []
    async with _alone_again(nats_url, Recorder("a", log)) as (a, ch):
        g = await a.acquire(timeout=10)
        assert not g.context_restored, "alone: the orchestrator granted without a restore"
        assert log == ["a:suspend", "a:resume"] and ch.early_resumed == 1 and ch.early_taken == 0
        assert not ch.suspended
        assert agent.jobs()["a"].state is JobState.RUNNING, "the agent never moved a"
        await a.release()


class _ResumeFails(Recorder):
    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        raise RuntimeError("no device memory")


async def test_a_failed_resume_after_an_early_suspend_fails_the_acquire_and_gives_the_group_back(
    nats_url: str, agent: Agent
) -> None:
    log: list[str] = []
    async with _alone_again(nats_url, _ResumeFails("a", log)) as (a, _):
        with pytest.raises(HandlerError, match="no device memory") as exc:
            await a.acquire(timeout=10)
        assert "restart the job" in str(exc.value)
        assert not a.holding
        # The orchestrator answered the release; its record is written after the answer.
        rec = await eventually(lambda: _nobody_holds(a), what="the grant was given back")
        assert rec.holder is None and rec.epoch == 2


# --------------------------------------------------------------------------- the channel's side, command by command


class _Log:
    """A handler that logs (action, tags) and fails its next suspend when told to."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.fail_next_suspend = False

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        if self.fail_next_suspend:
            self.fail_next_suspend = False
            raise RuntimeError("injected")
        self.calls.append(("suspend", tuple(sorted(tags))))
        return HandlerResult(bytes_moved=7, device_bytes_freed=7)

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        self.calls.append(("resume", tuple(sorted(tags))))
        return HandlerResult(bytes_moved=7)


def _cmd(action: str, n: int, tags: tuple[str, ...] = ("weights",)) -> WorkloadCommand:
    return WorkloadCommand(op_id=f"op-{n}", action=action, mode=SuspendMode.OFFLOAD, tags=tags, epoch=n)  # type: ignore[arg-type]


@pytest.fixture
async def channel(nats_url: str) -> AsyncIterator[tuple[WorkloadChannel, _Log]]:
    """A channel whose thread runs but that never registers (no agent): its commands are handed to it directly."""
    nc = await connect(nats_url)
    h = _Log()
    ch = WorkloadChannel(nc, "j", "g", h, node_id=NODE, tags=("weights",))
    await ch._open()
    try:
        yield ch, h
    finally:
        await ch.close()
        await nc.close()


async def _handle(ch: WorkloadChannel, cmd: WorkloadCommand) -> WorkloadReply:
    """The command's answer, worked out on the channel's thread as a command from the agent would be."""
    return await ch._on_thread(ch._answer(cmd))


async def test_the_suspend_command_takes_the_early_outcome_failure_included(
    channel: tuple[WorkloadChannel, _Log],
) -> None:
    ch, h = channel
    assert ch.suspend_early() and not ch.suspend_early(), "one at a time"
    reply = await _handle(ch, _cmd("suspend", 1))
    assert reply.ok and reply.bytes_moved == 7 and h.calls == [("suspend", ("weights",))] and ch.suspended
    assert reply.began_at_release
    assert not ch.suspend_early(), "already suspended"
    resumed = await _handle(ch, _cmd("resume", 2))
    assert resumed.ok and not resumed.began_at_release and not ch.suspended
    h.fail_next_suspend = True
    assert ch.suspend_early()
    reply = await _handle(ch, _cmd("suspend", 3))
    assert not reply.ok and reply.error == "RuntimeError: injected", "the early failure is the command's answer"
    assert reply.began_at_release
    assert h.calls == [("suspend", ("weights",)), ("resume", ("weights",))] and not ch.suspended
    assert ch.early_taken == 2


async def test_a_command_other_than_the_registered_suspend_finds_the_state_as_it_expects(
    channel: tuple[WorkloadChannel, _Log],
) -> None:
    ch, h = channel
    assert ch.suspend_early()
    reply = await _handle(ch, _cmd("suspend", 1, tags=("kv_cache",)))
    assert reply.ok and ch.suspended
    assert h.calls == [("suspend", ("weights",)), ("resume", ("weights",)), ("suspend", ("kv_cache",))]
    assert (await _handle(ch, _cmd("resume", 2, tags=("kv_cache",)))).ok
    h.calls.clear()
    assert ch.suspend_early()
    assert (await _handle(ch, _cmd("resume", 3))).ok and not ch.suspended
    assert h.calls == [("suspend", ("weights",)), ("resume", ("weights",))], "a resume resumes the early suspend"
    assert ch.early_taken == 0 and not await ch.settle()


async def test_suspend_early_is_refused_when_switched_off_closed_or_not_the_agents_to_drive(nats_url: str) -> None:
    nc = await connect(nats_url)
    try:
        off = WorkloadChannel(nc, "j", "g", _Log(), node_id=NODE, early_suspend=False)
        assert not off.suspend_early() and off._early is None
        for other in (("app_endpoint",), ("noop",), ("freeze",), ("cuda",)):
            assert not WorkloadChannel(nc, "j", "g", _Log(), node_id=NODE, backends=other).suspend_early(), other
        both = WorkloadChannel(nc, "j", "g", _Log(), node_id=NODE, backends=("app_channel", "freeze"))
        assert not both.suspend_early(), "not started: the channel's thread does not run yet"
        await both._open()
        try:
            assert both.suspend_early()
            early = await both._on_thread(both._take_early())
            assert early is not None and early.result is not None and both.suspended
        finally:
            await both.close()
        assert not both.suspend_early(), "closed"
    finally:
        await nc.close()


def test_outcomes_compose_their_work_time_and_whether_it_began_at_release() -> None:
    app = Outcome(100, 100, 40.0, True)
    assert app + Outcome() == Outcome(100, 100, 40.0, True), "freeze after app_channel reports no time of its own"
    assert Outcome() + Outcome() == Outcome(), "no backend reported a time: none"
    assert Outcome(1, 0, 2.0) + Outcome(2, 0, 3.0) == Outcome(3, 0, 5.0, False)


def _snapshot_of_400_mb(op_id: str, epoch: int, **timing: Any) -> OpBar:
    """A snapshot that moved 400 MB, from 0 (``timing``: when it ended, what the agent and the workload measured)."""
    return OpBar(op_id=op_id, kind="snapshot", epoch=epoch, start_ms=0, bytes=400_000_000, ok=True, **timing)


def test_replay_rates_a_suspend_begun_at_release_by_the_workloads_whole_call() -> None:
    """The agent saw 2 ms of a 40 ms copy of 400 MB: 10 GB/s, not 200 GB/s."""
    early = _snapshot_of_400_mb("o1", 2, end_ms=2, elapsed_ms=2.0, work_ms=40.0, began_at_release=True)
    plain = _snapshot_of_400_mb("o2", 4, end_ms=40, elapsed_ms=40.0, work_ms=39.0)  # the agent saw all of it
    assert early.copy_ms == 40.0 and early.duration_ms == 2.0 and plain.copy_ms == 40.0
    assert _op_figures([early]) == (2.0, pytest.approx(10.0))
    assert _op_figures([plain]) == (40.0, pytest.approx(10.0))


async def test_a_close_right_after_the_release_leaves_the_early_suspend_to_the_agents_command(
    channel: tuple[WorkloadChannel, _Log],
) -> None:
    """The job closes right after a contended release: the close waits for the suspend begun at the release, and
    the agent's command that comes meanwhile takes it; the handler ran once (it used to run twice in a row, the
    waiter's grant waiting for both)."""
    ch, h = channel
    assert ch.suspend_early()
    await ch._on_thread(ch._quiesce())  # what close() waits for before it unregisters
    reply = await _handle(ch, _cmd("suspend", 1))
    assert reply.ok and reply.began_at_release and reply.bytes_moved == 7
    assert h.calls == [("suspend", ("weights",))], "one suspend, not two"
    assert ch.suspended and ch.early_taken == 1


async def test_a_suspend_of_a_suspended_state_does_not_run_the_handler_again(
    channel: tuple[WorkloadChannel, _Log],
) -> None:
    ch, h = channel
    assert (await _handle(ch, _cmd("suspend", 1))).ok
    again = await _handle(ch, _cmd("suspend", 2))  # another op id: an agent that lost track (restarted)
    assert again.ok and h.calls == [("suspend", ("weights",))] and ch.suspended
    assert (await _handle(ch, _cmd("resume", 3))).ok and not ch.suspended


async def test_a_release_within_its_minimum_hold_begins_no_suspend(nats_url: str) -> None:
    """A job switched in that gives the group back at once while another waits keeps it (its minimum hold): no switch
    follows, so its workloads do not suspend at that release (its grant said how long its window runs:
    ``Granted.min_hold_ms``), and its re-acquire finds them as they were. Its next, unkept release suspends early as
    usual, and the switch takes that suspend."""
    log: list[str] = []
    async with (
        stack(nats_url, "apart") as agent,
        AsyncTimeSliceClient("a", "gk", nats_url) as a,
        AsyncTimeSliceClient("b", "gk", nats_url) as b,
    ):
        await a.register_workload(Recorder("a", log), node_id=NODE)
        chb = await b.register_workload(Recorder("b", log), node_id=NODE)
        await a.acquire(timeout=10)
        await a.release()
        rc, out = await timeslice(nats_url, "set-policy", "--group", "gk", "--min-hold-s", "60")
        assert rc == 0, out
        await b.acquire(timeout=10)  # switched in: a's context goes out
        assert log == ["a:suspend"]
        ta = asyncio.create_task(a.acquire(timeout=60))
        await eventually(lambda: b.contended, what="the orchestrator tells b that a waits")
        await b.release()
        assert (await b.status()).kept_for == "b"
        g = await b.acquire(timeout=10)  # taken back within its window: no switch, nothing to resume
        assert not g.context_restored and not ta.done()
        assert log == ["a:suspend"] and chb.early_resumed == 0 and not chb.suspended
        await eventually(lambda: b.contended, what="b's new hold is told that a waits")
        await b.release()  # this hold came without a switch: the group passes on, b suspends at the release
        ga = await asyncio.wait_for(ta, 20)
        assert ga.context_restored and log[0] == "a:suspend" and sorted(log[1:]) == ["a:resume", "b:suspend"]
        assert chb.early_taken == 1, "the switch took b's early suspend, not a second one"
        # (granted on a's restore, b's snapshot may still be finishing beside it)
        await eventually(lambda: agent.jobs()["b"].state is JobState.SAVED, what="b saved")
        await a.release()
