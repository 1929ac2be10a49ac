"""``timeslice status`` and ``timeslice events`` as real processes against a real nats-server, with the
orchestrator and an agent running in this event loop."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from nats.aio.msg import Msg
from timeslice_agent import Agent, AgentConfig
from timeslice_cli._events import Event, format_line, parse_since, to_json
from timeslice_client import AsyncTimeSliceClient, HandlerResult, SuspendMode
from timeslice_client.bus import connect, kv_keys
from timeslice_client.protocol import GROUPS_BUCKET, JOBS_BUCKET, GroupRecord, encode

from .agent_harness import queued, start_cli, timeslice
from .helpers import eventually, running
from .workers import read_stream

pytestmark = pytest.mark.usefixtures("orchestrator")
NODE = "node-s"


@pytest.fixture
async def agent(nats_url: str) -> AsyncIterator[Agent]:
    async with running(Agent(AgentConfig(node_id=NODE, nats_url=nats_url))) as a:
        yield a


class Noop:
    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return HandlerResult(bytes_moved=2048, device_bytes_freed=2048)

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return HandlerResult(bytes_moved=2048)


async def _kv_state(nats_url: str, group: str) -> tuple[Any, list[Any]]:
    """The group's stored record and its jobs' stored contexts, as plain JSON values."""
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        rec = json.loads((await (await js.key_value(GROUPS_BUCKET)).get(group)).value or b"null")
        jobs_kv = await js.key_value(JOBS_BUCKET)
        jobs = [json.loads((await jobs_kv.get(k)).value or b"null") for k in await kv_keys(nc, JOBS_BUCKET)]
        return rec, sorted((j for j in jobs if j["group"] == group), key=lambda j: (j["job"], j["node"]))
    finally:
        await nc.close()


async def test_status_shows_the_stored_records_and_job_states(nats_url: str, agent: Agent) -> None:
    g = "gst"
    async with AsyncTimeSliceClient("a", g, nats_url) as a, AsyncTimeSliceClient("b", g, nats_url) as b:
        await a.register_workload(Noop(), node_id=NODE)
        await b.register_workload(Noop(), node_id=NODE)
        await a.acquire(timeout=10)
        tb = asyncio.create_task(b.acquire(timeout=30))
        await eventually(queued(a, g, "b"), what="b queued")

        async def cli_matches_kv() -> dict[str, Any] | None:
            before = await _kv_state(nats_url, g)
            rc, out = await timeslice(nats_url, "status", "--group", g, "--json")
            assert rc == 0, out
            if await _kv_state(nats_url, g) != before:
                return None  # a renewal moved the record meanwhile: read again
            doc: dict[str, Any] = json.loads(out)
            assert doc["groups"] == [before[0]] and doc["jobs"] == before[1], (doc, before)
            return doc

        doc = await eventually(cli_matches_kv, timeout=30, what="status --json equals the KV records")
        assert doc["groups"][0]["holder"]["job"] == "a" and [w["job"] for w in doc["groups"][0]["queue"]] == ["b"]
        assert {(j["job"], j["node"], j["state"]) for j in doc["jobs"]} == {("a", NODE, "RUNNING"), ("b", NODE, "IDLE")}

        rc, out = await timeslice(nats_url, "status")
        assert rc == 0, out
        lines = out.splitlines()
        row = next(ln for ln in lines if ln.startswith(g))
        assert row.split()[:4] == [g, "LOCKED", "a", "1"], row
        assert "b " in row.split("a", 2)[-1] and row.rstrip().endswith("s"), row  # the queue, with b's wait
        assert any(f"a@{NODE} RUNNING" in ln and f"b@{NODE} IDLE" in ln for ln in lines), out
        assert any(f"{NODE} (loaded: a)" in ln for ln in lines), out
        await a.release()
        await tb
        await b.release()


async def test_status_of_an_unused_group_reads_idle(nats_url: str) -> None:
    rc, out = await timeslice(nats_url, "status", "--group", "nobody-here", "--json")
    assert rc == 0, out
    doc = json.loads(out)
    assert doc["groups"] == [json.loads(encode(GroupRecord(group="nobody-here")))] and doc["jobs"] == []


class Proc:
    """A long-running ``timeslice`` subcommand whose stdout lines the test reads."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    @classmethod
    async def start(cls, nats_url: str, *args: str) -> Proc:
        return cls(await start_cli(nats_url, *args))

    async def until(self, pred: Any, timeout: float = 30) -> str:
        """The first line (from now on) for which ``pred`` holds."""
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = (await self.proc.stdout.readline()).decode()
                assert line, f"exited: rc={await self.proc.wait()} {await self._stderr()}"
                self.lines.append(line)
                if pred(line):
                    return line

    async def _stderr(self) -> str:
        assert self.proc.stderr is not None
        return (await self.proc.stderr.read()).decode()

    async def interrupt(self) -> int:
        """Ctrl-C: the command stops cleanly."""
        self.proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(20):
            await self.proc.communicate()
        assert self.proc.returncode is not None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


async def test_status_watch_follows_changes(nats_url: str) -> None:
    g = "gwatch"
    watch = await Proc.start(nats_url, "status", "--watch", "--json", "--group", g)
    try:
        await watch.until(lambda ln: json.loads(ln)["groups"][0]["state"] == "IDLE")
        async with AsyncTimeSliceClient("a", g, nats_url) as a:
            grant = await a.acquire(timeout=10)
            line = await watch.until(lambda ln: (json.loads(ln)["groups"][0]["holder"] or {}).get("job") == "a")
            assert json.loads(line)["groups"][0]["epoch"] == grant.epoch
            await a.release()
            await watch.until(lambda ln: json.loads(ln)["groups"][0]["state"] == "IDLE_YIELDED")
        assert await watch.interrupt() == 0
    finally:
        watch.kill()


async def _two_handoffs(nats_url: str, g: str) -> None:
    async with AsyncTimeSliceClient("a", g, nats_url) as a, AsyncTimeSliceClient("b", g, nats_url) as b:
        await a.acquire(timeout=10)
        tb = asyncio.create_task(b.acquire(timeout=10))
        await eventually(queued(a, g, "b"), what="b queued")
        await a.release()
        await tb
        await b.release()


async def test_events_json_lists_what_was_published(nats_url: str) -> None:
    await _two_handoffs(nats_url, "gev")
    await _two_handoffs(nats_url, "other")
    stream = await read_stream(nats_url)
    rc, out = await timeslice(nats_url, "events", "--json")
    assert rc == 0, out
    rows = [json.loads(ln) for ln in out.splitlines()]
    # the whole stream, in order, with what each message said
    assert [r["seq"] for r in rows][: len(stream)] == [seq for seq, _, _, _ in stream]
    for r, (seq, ms, subject, data) in zip(rows, stream, strict=False):
        assert (r["seq"], r["time_ms"], r["subject"], r["data"]) == (seq, ms, subject, json.loads(data))

    rc, out = await timeslice(nats_url, "events", "--group", "gev", "--json")
    assert rc == 0, out
    mine = [seq for seq, _, _, data in stream if json.loads(data).get("group") == "gev"]
    assert [json.loads(ln)["seq"] for ln in out.splitlines()] == mine
    types = [json.loads(ln)["data"]["type"] for ln in out.splitlines()]
    assert types.count("granted") == 2 and types.count("release") == 2 and "state_changed" in types

    rc, out = await timeslice(nats_url, "events", "--group", "gev")
    assert rc == 0, out
    lines = out.splitlines()
    assert len(lines) == len(mine)
    granted = [ln for ln in lines if " granted " in ln]
    assert len(granted) == 2 and "job=a epoch=1" in granted[0] and "job=b epoch=2" in granted[1], granted
    (contended,) = [ln for ln in lines if " contended " in ln]  # b began to wait while a held the group
    assert "job=a epoch=1 waiters=1" in contended, contended
    assert all(" gev " in ln for ln in lines), lines


async def test_events_since(nats_url: str) -> None:
    await _two_handoffs(nats_url, "gsince")
    stream = await read_stream(nats_url)
    cut_seq, cut_ms = stream[len(stream) // 2][:2]
    cut = datetime.fromtimestamp(cut_ms / 1000, UTC)
    rc, out = await timeslice(nats_url, "events", "--json", "--since", cut.isoformat())
    assert rc == 0, out
    assert [json.loads(ln)["seq"] for ln in out.splitlines()] == [s for s, ms, _, _ in stream if ms >= cut_ms]
    assert json.loads(out.splitlines()[0])["seq"] <= cut_seq
    rc, out = await timeslice(nats_url, "events", "--json", "--since", "1h")
    assert rc == 0 and len(out.splitlines()) == len(stream), out
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    rc, out = await timeslice(nats_url, "events", "--since", future)
    assert rc == 0 and out == "", out
    rc, out = await timeslice(nats_url, "events", "--since", "yesterday")
    assert rc != 0 and "--since 'yesterday'" in out, out


async def test_events_follow_prints_new_events_until_interrupted(nats_url: str) -> None:
    g = "gfollow"
    async with AsyncTimeSliceClient("a", g, nats_url) as a:
        await a.acquire(timeout=10)
        await a.release()
        follow = await Proc.start(nats_url, "events", "--follow", "--group", g)
        try:
            await follow.until(lambda ln: " release " in ln)  # what was there already
            again = await a.acquire(timeout=10)  # a claim: nobody waited
            await follow.until(lambda ln: " acquire " in ln and f"claim={again.epoch}" in ln)
            line = await follow.until(lambda ln: " granted " in ln and f"epoch={again.epoch}" in ln)
            assert "job=a" in line
            await a.release()
            await follow.until(lambda ln: " release " in ln and f"epoch={again.epoch}" in ln)
            assert await follow.interrupt() == 0
        finally:
            follow.kill()


def test_parse_since() -> None:
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert parse_since("10m", now) == now - timedelta(minutes=10)
    assert parse_since("30s", now) == now - timedelta(seconds=30)
    assert parse_since("2h", now) == now - timedelta(hours=2)
    assert parse_since("1.5d", now) == now - timedelta(hours=36)
    assert parse_since("2026-11-30T10:00:00Z") == datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
    assert parse_since("2026-11-30T10:00:00+02:00") == datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
    local = parse_since("2026-11-30T10:00:00")
    assert local.tzinfo is not None and local.replace(tzinfo=None) == datetime(2026, 11, 30, 10, 0)
    for bad in ("", "10", "m10", "10 minutes", "yesterday"):
        with pytest.raises(Exception, match="duration"):
            parse_since(bad)


@pytest.mark.parametrize("ns", [1796117798340999700, 1796117798340000000, 1796117798340999999])
def test_event_time_is_the_servers_millisecond(ns: int) -> None:
    """The stream's nanoseconds floored to ms, in integers: through nats-py's float metadata a time just
    before a millisecond boundary (…340.9997 ms) read as the next one (…341)."""
    msg = Msg(None, "ts.v1.notice.g.b", f"$JS.ACK.TIMESLICE.c.1.10.10.{ns}.0", b'{"type": "released"}')  # type: ignore[arg-type]
    ev = Event.of(msg)
    assert json.loads(to_json(ev))["time_ms"] == ns // 1_000_000 == 1796117798340
    assert format_line(ev).startswith(f"{ev.time:%Y-%m-%dT%H:%M:%S}.340Z      10 released")
