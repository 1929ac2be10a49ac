"""Leader election for a hot-standby orchestrator (``timeslice_orchestrator._leadership``), on a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import KeyValueConfig, StreamConfig
from timeslice_orchestrator._leadership import (
    LEADER_BUCKET,
    LeaderRecord,
    Leadership,
    LeadershipChange,
    LeadershipError,
    LeaderWaitTimeout,
    NotLeader,
    read_leader,
)

from .conftest import ROOT
from .helpers import eventually, stop_process

TTL = 1


async def _quiet(exc: Exception) -> None:
    pass


class Instance:
    """One Leadership on its own connection, its ``run`` as a task of this test."""

    def __init__(self, nc: Any, name: str, **kw: Any) -> None:
        self.nc = nc
        self.changes: list[LeadershipChange] = []
        self.lead = Leadership(nc.jetstream(), instance_id=name, ttl_s=TTL, on_change=self.changes.append, **kw)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self.lead.run(self.stop))

    async def crash(self) -> None:
        """Like kill -9: no resign, the connection just goes away."""
        self.lead.resign_on_stop = False
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, LeadershipError):
            await asyncio.wait_for(self.task, 5)
        await self.nc.close()

    async def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(LeadershipError, asyncio.CancelledError):
            await asyncio.wait_for(self.task, 5)
        if not self.nc.is_closed:
            await self.nc.close()


@contextlib.asynccontextmanager
async def instances(url: str, *names: str, **kw: Any) -> AsyncIterator[list[Instance]]:
    made: list[Instance] = []
    try:
        for n in names:
            made.append(Instance(await nats.connect(url, error_cb=_quiet), n, **kw))
        yield made
    finally:
        for i in made:
            await i.close()


def leaders(xs: list[Instance]) -> list[Instance]:
    return [i for i in xs if i.lead.is_leader()]


async def elected(xs: list[Instance]) -> tuple[Instance, Instance]:
    """The instance elected leader (once one is) and the other one."""
    first = (await eventually(lambda: leaders(xs), timeout=5, what="a leader"))[0]
    return first, next(i for i in xs if i is not first)


def term_of(x: Instance) -> int:
    """The term ``x`` leads in (it leads)."""
    term = x.lead.term
    assert term is not None
    return term


async def test_two_instances_exactly_one_leader(nats_url: str) -> None:
    async with instances(nats_url, "a", "b") as xs:
        first = (await eventually(lambda: leaders(xs), timeout=5, what="a leader"))[0]
        # Over ~6 renewals nobody else ever believes it leads, and the record names the leader.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert leaders(xs) in ([first], []), [i.lead.instance_id for i in leaders(xs)]
            await asyncio.sleep(0.01)  # sampling interval, not waiting for an outcome
        assert first.lead.is_leader()
        rec = await read_leader(first.nc.jetstream())
        assert rec is not None and rec.holder == first.lead.instance_id and rec.term == first.lead.term
        other = next(i for i in xs if i is not first)
        assert other.lead.term is None and other.lead.holder == rec
        assert [c.leading for c in first.changes] == [True] and other.changes == []


async def test_crashed_leader_replaced_within_ttl_with_higher_term(nats_url: str) -> None:
    async with instances(nats_url, "a", "b") as xs:
        first, other = await elected(xs)
        old_term = term_of(first)
        t0 = time.monotonic()
        await first.crash()
        term = await other.lead.wait_leader(timeout=3)
        took = time.monotonic() - t0
        assert term > old_term
        assert took < TTL + 0.4, took  # expiry (<= TTL after the last renewal) + the marker + one campaign
        rec = await read_leader(other.nc.jetstream())
        assert rec == LeaderRecord(other.lead.instance_id, term, rec.since_ms if rec else 0)


async def test_closed_connection_steps_down_and_is_replaced(nats_url: str) -> None:
    async with instances(nats_url, "a", "b") as xs:
        first, other = await elected(xs)
        await first.nc.close()
        with pytest.raises(LeadershipError, match="connection closed"):
            await asyncio.wait_for(first.task, 5)
        assert not first.lead.is_leader() and first.changes[-1].leading is False
        await other.lead.wait_leader(timeout=3)


async def test_resign_hands_over_at_once(nats_url: str) -> None:
    async with instances(nats_url, "a", "b") as xs:
        first, other = await elected(xs)
        old = term_of(first)
        t0 = time.monotonic()
        assert await first.lead.resign() is True
        assert not first.lead.is_leader()  # believes it is out before anyone else can be in
        term = await other.lead.wait_leader(timeout=2)
        took = time.monotonic() - t0
        assert term > old and took < 0.3, took
        await asyncio.wait_for(first.task, 2)  # resign() without rejoin ends run()
        assert await first.lead.resign() is False  # idempotent


async def test_stop_resigns(nats_url: str) -> None:
    async with instances(nats_url, "a", "b") as xs:
        first, other = await elected(xs)
        t0 = time.monotonic()
        first.stop.set()
        await asyncio.wait_for(first.task, 2)
        await other.lead.wait_leader(timeout=2)
        assert time.monotonic() - t0 < 0.3
        assert [c.reason for c in first.changes] == ["elected", "resigned"]


async def test_terms_strictly_increase_over_many_handovers(nats_url: str) -> None:
    """20 handovers by resign (rejoining), by crash and by a fresh instance after the key and its marker
    are gone entirely: every term is new and larger than all before it."""
    terms: list[int] = []
    async with instances(nats_url, "a", "b", "c") as xs:
        for _round in range(16):  # resign handovers among three live instances
            cur = (await eventually(lambda: leaders(xs), timeout=5, what="a leader"))[0]
            assert cur.lead.term is not None
            terms.append(cur.lead.term)
            assert await cur.lead.resign(rejoin=True)

            def new_leader(c: Instance = cur) -> list[Instance]:
                return [i for i in leaders(xs) if i is not c]

            await eventually(new_leader, timeout=2, what="a new leader")
        for _round in range(2):  # crashes: the record expires
            cur = (await eventually(lambda: leaders(xs), timeout=5, what="a leader"))[0]
            assert cur.lead.term is not None
            terms.append(cur.lead.term)
            await cur.crash()
            xs.remove(cur)
            await eventually(lambda: leaders(xs), timeout=3, what="a leader after a crash")
        last = leaders(xs)[0]
        assert last.lead.term is not None
        terms.append(last.lead.term)
        for i in list(xs):
            await i.crash()
            xs.remove(i)
    nc = await nats.connect(nats_url, error_cb=_quiet)
    try:
        js = nc.jetstream()

        async def no_message_at_all() -> bool:  # the record expired and then its marker too
            try:
                await js.get_msg(f"KV_{LEADER_BUCKET}", subject=f"$KV.{LEADER_BUCKET}.orchestrator", direct=True)
            except nats.js.errors.NotFoundError:
                return True
            return False

        await eventually(no_message_at_all, timeout=5, interval=0.05, what="record and marker gone")
    finally:
        await nc.close()
    async with instances(nats_url, "d") as (fresh,):
        terms.append(await fresh.lead.wait_leader(timeout=3))
    assert len(terms) == 20
    assert all(b > a for a, b in itertools.pairwise(terms)), terms


async def test_takeover_without_ttl_markers(nats_url: str) -> None:
    """A bucket made without ``limit_marker_ttl``: an expiry writes nothing, the standby's re-read finds it."""
    nc = await nats.connect(nats_url, error_cb=_quiet)
    try:
        await nc.jetstream().create_key_value(KeyValueConfig(bucket=LEADER_BUCKET, history=1, direct=True))
    finally:
        await nc.close()
    async with instances(nats_url, "a", "b") as xs:
        first, other = await elected(xs)
        old = term_of(first)
        t0 = time.monotonic()
        await first.crash()
        assert await other.lead.wait_leader(timeout=3) > old
        assert time.monotonic() - t0 < TTL + 0.5


async def test_wait_leader_times_out_while_another_leads(nats_url: str) -> None:
    async with instances(nats_url, "a") as (a,):
        await a.lead.wait_leader(timeout=3)
        async with instances(nats_url, "b") as (b,):
            with pytest.raises(LeaderWaitTimeout, match="current holder: a"):
                await b.lead.wait_leader(timeout=0.5)


async def test_confirm_is_a_fenced_write(nats_url: str) -> None:
    async with instances(nats_url, "a", "b") as xs:
        first, other = await elected(xs)
        assert await first.lead.confirm() == first.lead.term
        with pytest.raises(NotLeader):
            await other.lead.confirm()


def test_config_is_checked() -> None:
    js: Any = object()
    with pytest.raises(LeadershipError, match="whole seconds"):
        Leadership(js, ttl_s=0)
    with pytest.raises(LeadershipError, match="renew_s"):
        Leadership(js, ttl_s=1, renew_s=0.9, margin_s=0.2)


async def test_read_leader_without_bucket_and_bad_bucket(nats_url: str) -> None:
    nc = await nats.connect(nats_url, error_cb=_quiet)
    try:
        js = nc.jetstream()
        assert await read_leader(js) is None
        await js.add_stream(
            StreamConfig(name=f"KV_{LEADER_BUCKET}", subjects=[f"$KV.{LEADER_BUCKET}.>"], max_msgs_per_subject=1)
        )
        with pytest.raises(LeadershipError, match="allow_msg_ttl"):
            await Leadership(js).run(asyncio.Event())
    finally:
        await nc.close()


# ---- real processes ------------------------------------------------------------------------------------


class Worker:
    def __init__(self, tmp: Path, url: str, name: str) -> None:
        self.out = tmp / f"leader-{name}.jsonl"
        self.out.touch()
        self.err = tmp / f"leader-{name}.stderr"
        with open(self.err, "ab") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.workers.leader_worker",
                    "--nats-url",
                    url,
                    "--out",
                    str(self.out),
                    "--instance",
                    name,
                    "--ttl",
                    str(TTL),
                ],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )

    def events(self, ev: str | None = None) -> list[dict[str, Any]]:
        lines = [json.loads(x) for x in self.out.read_text().splitlines() if x.strip()]
        return [e for e in lines if ev is None or e["ev"] == ev]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        stop_process(self.proc, grace_s=10, kill_wait_s=5)


@contextlib.asynccontextmanager
async def _leading_worker(nats_url: str, tmp_path: Path) -> AsyncIterator[tuple[Worker, int]]:
    """A ``leader_worker`` process once it believes it leads: it and its term; closed (woken first, were it stopped)
    when the block ends."""
    w = Worker(tmp_path, nats_url, "w")
    try:
        await eventually(lambda: w.events("believes"), timeout=20, what=f"the worker leads ({w.err})")
        yield w, w.events("elected")[0]["term"]
    finally:
        w.close()


async def test_sigstopped_leader_never_believes_after_resume(nats_url: str, tmp_path: Path) -> None:
    async with _leading_worker(nats_url, tmp_path) as (w, w_term), instances(nats_url, "b") as (b,):
        os.kill(w.proc.pid, signal.SIGSTOP)
        stopped = time.time()
        b_term = await b.lead.wait_leader(timeout=5)
        assert b_term > w_term
        os.kill(w.proc.pid, signal.SIGCONT)
        fenced = (await eventually(lambda: w.events("fenced"), timeout=5, what="the fenced write"))[0]
        cont = w.events("cont")[0]
        assert cont["is_leader"] is False, cont  # the window had passed: nothing needed to run first
        assert fenced["ok"] is False and fenced["error"] == "NotLeader", fenced
        await eventually(lambda: w.events("lost"), timeout=5, what="the worker notices it lost")
        # While b leads, the worker never believed it leads after the pause.
        assert b.lead.is_leader()
        assert [e for e in w.events("believes") if e["t"] > stopped] == []
        assert w.proc.poll() is None
    assert w.proc.returncode == 0, w.err.read_text()


async def test_kill9_leader_process_replaced(nats_url: str, tmp_path: Path) -> None:
    async with _leading_worker(nats_url, tmp_path) as (w, w_term), instances(nats_url, "b") as (b,):
        t0 = time.monotonic()
        w.proc.kill()
        term = await b.lead.wait_leader(timeout=5)
        took = time.monotonic() - t0
        assert term > w_term and took < TTL + 0.4, took
