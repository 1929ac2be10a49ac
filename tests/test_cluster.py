"""timeslice on a 3-node NATS cluster (tests/cluster.py: real nats-servers on loopback).

* ``parse_servers`` reads comma-separated server lists and names the bad entry;
* the orchestrator (in-process, replicas 3) and two jobs on different nodes hand a group back and forth while
  the node that leads the TIMESLICE stream is killed and restarted: every acquire succeeds, the invariant checker
  finds no overlap in the stream, and the stall the kill caused is measured (printed);
* the real ``timeslice orchestrator --nats-url a,b,c --replicas 3`` process, and a blocking client on the same
  comma-separated URL; a later start with another replica count warns and keeps the stream as it is.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS
from timeslice_client import AsyncTimeSliceClient, LockLost, TimeSliceClient
from timeslice_client._internal.bus_layout import BusConfig
from timeslice_client.bus import InvalidNatsUrl, connect, parse_servers
from timeslice_client.errors import Unavailable
from timeslice_client.handlers import HandlerResult
from timeslice_client.protocol import AGENTS_BUCKET, GROUPS_BUCKET, JOBS_BUCKET, STREAM, SuspendMode, subjects
from timeslice_client.workload import WorkloadChannel
from timeslice_orchestrator.invariants import StreamChecker
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .cluster import NatsCluster
from .conftest import OrchestratorProcess
from .helpers import eventually, running
from .workers import read_stream

GROUP = "gcl"


# --------------------------------------------------------------------------- parse_servers


@pytest.mark.parametrize(
    ("text", "servers"),
    [
        ("nats://127.0.0.1:4222", ["nats://127.0.0.1:4222"]),
        ("nats://a:1, nats://b:2 ,tls://c:3", ["nats://a:1", "nats://b:2", "tls://c:3"]),
        ("a:1,b", ["nats://a:1", "nats://b"]),
        ("nats://user:pw@h:4222", ["nats://user:pw@h:4222"]),
        ("ws://h:8080/nats,wss://g:443", ["ws://h:8080/nats", "wss://g:443"]),
    ],
)
def test_parse_servers_reads_lists(text: str, servers: list[str]) -> None:
    assert parse_servers(text) == servers
    assert parse_servers(text.split(",")) == servers


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("nats://a:1,,nats://b:2", ""),
        ("nats://a:1,http://b:2", "http://b:2"),
        ("nats://a:1,nats://:2", "nats://:2"),
        ("nats://a:1,nats://b:99999", "nats://b:99999"),
        ("nats://a:x", "nats://a:x"),
        ("nats://a:0", "nats://a:0"),
        ("nats://a:1/path", "nats://a:1/path"),
        ("nats://a:1,ws://b:2", "ws://b:2"),
        ("", ""),
    ],
)
def test_parse_servers_names_the_bad_entry(text: str, bad: str) -> None:
    with pytest.raises(InvalidNatsUrl) as info:
        parse_servers(text)
    assert info.value.entry == bad and repr(bad) in str(info.value)


def test_bad_urls_are_refused_before_any_connection() -> None:
    with pytest.raises(InvalidNatsUrl):
        asyncio.run(connect("nats://127.0.0.1:1,bogus://x"))
    with pytest.raises(InvalidNatsUrl):
        WorkloadChannel(NATS(), "j", "g", _NoHandler(), nats_url="nats://a:1,:x")
    from timeslice_agent import AgentConfig

    with pytest.raises(ValueError, match="bogus"):
        AgentConfig(nats_url="nats://a:1,bogus://b")
    assert AgentConfig(nats_url="a:1, b:2").nats_url == "nats://a:1,nats://b:2"


class _NoHandler:
    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        raise AssertionError("not called")

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        raise AssertionError("not called")


# --------------------------------------------------------------------------- handoffs through a leader kill


@dataclass
class _Handoffs:
    grants: list[tuple[float, str, int]] = field(default_factory=list)  # (monotonic s, job, epoch)
    lost: list[tuple[float, str, str]] = field(default_factory=list)  # holds lost before their release (stall)
    unanswered: int = 0  # releases stored whose answer came after request_timeout_s (the client raised Unavailable)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def after(self, t: float) -> list[tuple[float, str, int]]:
        return [g for g in self.grants if g[0] > t]


async def _hand_off(client: AsyncTimeSliceClient, log: _Handoffs, limit: int = 10_000) -> int:
    """Acquire and release until told to stop (at most ``limit`` times); every acquire must succeed."""
    for n in range(limit):
        if log.stop.is_set():
            return n
        grant = await client.acquire(timeout=60)
        log.grants.append((time.monotonic(), client.job_id, grant.epoch))
        try:
            await client.release()
        except LockLost as exc:  # revoked while the bus stalled (e.g. its confirmation could not be stored)
            log.lost.append((time.monotonic(), client.job_id, str(exc)))
        except Unavailable as exc:  # stored in the stream but not answered within request_timeout_s: it still counts
            assert "release was not answered" in str(exc)
            log.unanswered += 1
    return limit


async def _on(url: str, name: str) -> NATS:
    """A connection to the servers in the order given (the first one first), the cluster's others as fallback."""
    return await connect(url, name=name, dont_randomize=True)


async def test_handoffs_survive_killing_the_stream_leader(cluster: NatsCluster) -> None:
    u = cluster.urls
    # write_attempts: the orchestrator's KV write gives up after 8 attempts, which a fast-failing error during
    # an election (no responders) spends in about 3.5 s, less than one election: bounded by count, not time.
    cfg = OrchestratorConfig(nats_url=cluster.url, bus=BusConfig(replicas=3), write_attempts=40)
    async with running(Orchestrator(cfg), timeout=30):
        nc_a = await _on(f"{u[0]},{u[1]},{u[2]}", "job-a")
        nc_b = await _on(f"{u[1]},{u[2]},{u[0]}", "job-b")
        assert nc_a.connected_url is not None and nc_b.connected_url is not None
        assert nc_a.connected_url.port != nc_b.connected_url.port  # the jobs sit on different nodes
        log = _Handoffs()
        # fast_reacquire off: a claim refused by the cluster's in-flight check (10164) fails the acquire (below)
        a = AsyncTimeSliceClient("job-a", GROUP, cluster.url, nc=nc_a, fast_reacquire=False)
        b = AsyncTimeSliceClient("job-b", GROUP, cluster.url, nc=nc_b, fast_reacquire=False)
        try:
            _, replicas, _ = await cluster.stream_info_replicas(STREAM)
            assert replicas == 3
            for bucket in (GROUPS_BUCKET, AGENTS_BUCKET, JOBS_BUCKET):
                assert (await cluster.stream_info_replicas(f"KV_{bucket}"))[1] == 3
            tasks = [asyncio.create_task(_hand_off(c, log)) for c in (a, b)]
            await eventually(lambda: len(log.grants) >= 30, timeout=20, what="30 handoffs before the kill")
            leader = await cluster.stream_leader(STREAM)
            t_kill = time.monotonic()
            cluster.kill(leader)
            try:
                await eventually(lambda: len(log.after(t_kill)) >= 30, timeout=40, what="30 handoffs after the kill")
            except AssertionError:
                print(
                    f"\nstuck: {len(log.after(t_kill))} grants after the kill; tasks {tasks}; lost {log.lost}; "
                    f"record {await a.status()}"
                )
                raise
            first_after = log.after(t_kill)[0][0] - t_kill
            new_leader = await cluster.stream_leader(STREAM)
            t_restart = time.monotonic()
            await cluster.restart(leader)
            await cluster.wait_current(STREAM)
            caught_up = time.monotonic() - t_restart
            await eventually(
                lambda: len(log.after(time.monotonic() - 0.5)) >= 5 or len(log.after(t_restart)) >= 30,
                timeout=30,
                what="handoffs after the restart",
            )
            log.stop.set()
            done = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            log.stop.set()
            for c in (a, b):
                await c.close()
            await nc_a.close()
            await nc_b.close()
        times = [g[0] for g in log.grants]
        gaps = [y - x for x, y in itertools.pairwise(times)]
        around = [y - x for x, y in itertools.pairwise(times) if y > t_kill and x < t_kill + 30]
        typical = sorted(gaps)[len(gaps) // 2]
        print(
            f"\ncluster: killed stream leader n{leader} (new leader n{new_leader}): first grant "
            f"{first_after:.2f} s after the kill, longest gap between grants {max(around):.2f} s "
            f"(median gap {typical * 1000:.1f} ms); restarted node caught up in {caught_up:.2f} s; "
            f"{len(log.grants)} grants ({done[0]} + {done[1]}), {len(log.lost)} holds lost in the stall {log.lost}, "
            f"{log.unanswered} releases unanswered within 5 s"
        )
        epochs = [g[2] for g in log.grants]
        assert len(set(epochs)) == len(epochs)
        assert {g[1] for g in log.grants} == {"job-a", "job-b"}
        checker = StreamChecker()
        checker.feed_all(await read_stream(cluster.url))
        st = checker.stats[GROUP]
        assert st.grants >= len({g[2] for g in log.grants}) and st.max_epoch >= max(epochs)
        assert checker.unpublished_grants() == []


# --------------------------------------------------------------------------- the real CLI on a, b, c


def test_the_orchestrator_process_takes_a_comma_separated_url(
    cluster: NatsCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = OrchestratorProcess(cluster.url, tmp_path / "orchestrator.log", args=("--replicas", "3"))
    proc.start()
    try:
        proc.wait_ready(timeout=30)
        with TimeSliceClient("job-s", GROUP, cluster.url) as c:
            grant = c.acquire(timeout=20)
            assert grant.epoch == 1
            c.release()
    finally:
        proc.stop()
    assert asyncio.run(cluster.stream_info_replicas(STREAM))[1] == 3

    async def restart_with_one_replica() -> None:
        with caplog.at_level(logging.WARNING, logger="timeslice.bus"):
            cfg = OrchestratorConfig(nats_url=cluster.url, bus=BusConfig(replicas=1))
            async with running(Orchestrator(cfg), timeout=30):
                pass

    asyncio.run(restart_with_one_replica())
    warned = [r.getMessage() for r in caplog.records if r.name == "timeslice.bus"]
    assert any(f"stream {STREAM} has 3 replica(s) but 1 were asked for" in m and "--replicas 1" in m for m in warned), (
        warned
    )
    assert asyncio.run(cluster.stream_info_replicas(STREAM))[1] == 3  # kept as it was


# --------------------------------------------------------------------------- sequence-checked publishes (claims)


async def test_a_check_refused_for_a_write_in_flight_counts_as_superseded(cluster: NatsCluster) -> None:
    """A cluster refuses a sequence check with err_code 10164 ('wrong last sequence', no number) while another
    write of the subject is in flight: ``publish_stored`` counts it as superseded (a claim then falls back to a
    plain acquire) instead of raising Unavailable (which failed the acquire)."""
    from nats.js.api import StreamConfig
    from timeslice_client._grants import _Superseded
    from timeslice_client._publish_rules import publish_stored

    nc = await connect(cluster.url)
    try:
        js = nc.jetstream(timeout=5)
        await js.add_stream(StreamConfig(name="CLAIMS", subjects=["claims.>"], num_replicas=3))
        last = (await js.publish("claims.g.a", b"0")).seq

        async def claim(i: int) -> int:
            check = {
                "Nats-Msg-Id": f"c{i}",
                "Nats-Expected-Last-Subject-Sequence": str(last),
                "Nats-Expected-Last-Subject-Sequence-Subject": "claims.g.>",
            }
            return await publish_stored(js, "claims.g.a", b"c", headers=check, timeout=5, nats_url=cluster.url)

        results = await asyncio.gather(*(claim(i) for i in range(4)), return_exceptions=True)
    finally:
        await nc.close()
    assert sum(isinstance(r, int) for r in results) == 1, results
    assert all(isinstance(r, _Superseded) for r in results if not isinstance(r, int)), results


async def test_a_retried_publish_with_the_same_message_id_is_stored_once(cluster: NatsCluster) -> None:
    """What makes ``publish_stored``'s retry after a timeout safe (in a cluster a timed-out write may have been
    committed, so the retry may be a second copy): the stream drops a message whose ``Nats-Msg-Id`` it stored
    within its duplicate window and answers with the first one's sequence. On a cluster this holds for a
    sequence-checked publish too (the duplicate is found before the check)."""
    from nats.js.api import StreamConfig

    nc = await connect(cluster.url)
    try:
        js = nc.jetstream(timeout=5)
        await js.add_stream(StreamConfig(name="DUPES", subjects=["dupes.>"], num_replicas=3, duplicate_window=60))
        first = await js.publish("dupes.a", b"1", headers={"Nats-Msg-Id": "m1"})
        again = await js.publish("dupes.a", b"1", headers={"Nats-Msg-Id": "m1"})
        assert (again.seq, again.duplicate) == (first.seq, True)
        check = {"Nats-Msg-Id": "m2", "Nats-Expected-Last-Subject-Sequence": str(first.seq)}
        stored = await js.publish("dupes.a", b"2", headers=check)
        retried = await js.publish("dupes.a", b"2", headers=check)
        assert (retried.seq, retried.duplicate) == (stored.seq, True)
        assert (await js.stream_info("DUPES")).state.messages == 2
    finally:
        await nc.close()


async def test_no_claims_on_a_replicated_stream(cluster: NatsCluster) -> None:
    """A replicated stream checks a claim's ``Nats-Expected-Last-Subject-Sequence`` (a wildcard filter) without the
    writes of other subjects still in flight, so it stored a claim 1 ms after another job's acquire in
    bench/chaos.py: the client held from its PubAck while the orchestrator refused the claim and granted the epoch
    to the other job. On a cluster, re-acquires go through the orchestrator: no acquire in the stream is a claim."""
    cfg = OrchestratorConfig(nats_url=cluster.url, bus=BusConfig(replicas=3), write_attempts=40)
    async with running(Orchestrator(cfg), timeout=30):
        async with AsyncTimeSliceClient("job-a", "gnoclaim", cluster.url) as a:
            for _ in range(3):
                await a.acquire(timeout=20)
                await a.release()
            assert a._claims is False
        acquires = [
            msgspec.json.decode(data)
            for _, _, subject, data in await read_stream(cluster.url)
            if subject == subjects.job("gnoclaim", "job-a", "acquire")
        ]
        assert len(acquires) == 3 and all(x["claim_epoch"] is None for x in acquires), acquires


async def test_an_orchestrator_started_before_the_cluster_answers_waits_for_it(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    """Two of three servers down: JetStream has no quorum and its API does not answer. An orchestrator (a standby
    started beside a busy cluster, in bench/stream_leader.py) used to exit on the first unanswered stream lookup;
    it waits, says why, and is ready once the cluster answers."""
    cluster.stop(1)
    cluster.stop(2)
    log = tmp_path / "orchestrator.log"
    orch = OrchestratorProcess(cluster.urls[0], log, args=("--replicas", "3"))
    orch.start()
    try:
        await eventually(
            lambda: "not answering yet" in log.read_text(errors="replace"),
            timeout=60,
            interval=0.1,
            what="the orchestrator says it waits for the stream",
        )
        assert orch.proc is not None and orch.proc.poll() is None, log.read_text(errors="replace")
        await cluster.restart(1)
        await cluster.restart(2)
        orch.nats_url = cluster.url
        await asyncio.to_thread(orch.wait_ready, 90)
    finally:
        orch.stop()


def test_jetstream_temporarily_unavailable_is_retried() -> None:
    """A cluster whose servers are coming back answers 503 / 10008 ("JetStream system temporarily unavailable") for
    a moment (seen in this module's wait-for-the-cluster test under load: the orchestrator exited on it); stored
    publishes and the bus setup retry it, as they retry a timeout. Other API errors are not retried."""
    from nats.js.errors import APIError, ServiceUnavailableError
    from timeslice_client._publish_rules import transient

    assert transient(
        ServiceUnavailableError(code=503, err_code=10008, description="JetStream system temporarily unavailable")
    )
    assert not transient(APIError(code=400, err_code=10058, description="stream name already in use"))
