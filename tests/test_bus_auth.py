"""The bus's trust boundary against a real nats-server with auth on and real credentials (issue 24).

Every attack is tried by a process holding a valid job credential of its own ("mallory"): refused by the server
(a permissions violation, which only ``error_cb`` reports: the violating publish raises nothing, it times out) or
by the orchestrator (the subject is the sender's identity; a payload speaking for another job or node is rejected),
and the victim's state is unchanged after a barrier that went through the orchestrator after the attack. On the code
before issue 24 (no auth) each of these attacks succeeded, so each test fails there at its first assertion.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS
from timeslice_client import AsyncTimeSliceClient
from timeslice_client.bus import TlsFiles, connect
from timeslice_client.errors import Unavailable
from timeslice_client.protocol import (
    ClearFault,
    Granted,
    OpKind,
    OpResult,
    Refused,
    Release,
    Renew,
    Revoked,
    Snapshot,
    SuspendMode,
    WorkloadCommand,
    decode_notice,
    encode,
    subjects,
)
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .agent_harness import queue_behind, recorded_switch
from .auth_stack import SecureBus, Violations, start_secure_bus
from .helpers import eventually, group_record, running, subscribed

G = "g"


@pytest.fixture
async def orch(bus: SecureBus) -> AsyncIterator[Orchestrator]:
    cfg = OrchestratorConfig(nats_url=bus.url, creds=bus.creds("orchestrator"))
    async with running(Orchestrator(cfg)) as o:
        yield o


async def _conn(
    bus: SecureBus, role: str, ident: str | None = None, groups: tuple[str, ...] = ()
) -> tuple[NATS, Violations]:
    v = Violations()
    nc = await connect(bus.url, creds=bus.creds(role, ident, groups), error_cb=v)
    return nc, v


@contextlib.asynccontextmanager
async def _mallory(bus: SecureBus) -> AsyncIterator[tuple[NATS, Violations]]:
    nc, v = await _conn(bus, "job", "mallory")
    try:
        yield nc, v
    finally:
        await nc.close()


async def _refused(nc: NATS, v: Violations, subject: str, data: bytes = b"{}", *, reply: str = "") -> None:
    """Publish ``data`` on ``subject`` and wait for the server's permissions violation about it."""
    await nc.publish(subject, data, reply=reply)
    await nc.flush()
    await eventually(lambda: v.about(subject), timeout=5, what=f"a permissions violation for {subject}")


def _client(bus: SecureBus, job: str, **kw: object) -> AsyncTimeSliceClient:
    return AsyncTimeSliceClient(job, G, bus.url, creds=bus.creds("job", job), request_timeout_s=2.0, **kw)  # type: ignore[arg-type]


async def _barrier(bus: SecureBus) -> None:
    """An acquire and release that went through the orchestrator after everything published before it."""
    async with AsyncTimeSliceClient("barrier", "g-barrier", bus.url, creds=bus.creds("job", "barrier")) as c:
        await c.acquire(timeout=10)
        await c.release()


async def _holder(c: AsyncTimeSliceClient) -> str | None:
    rec = await group_record(c)
    return rec.holder.job if rec.holder else None


async def _waiting(c: AsyncTimeSliceClient, job: str) -> bool:
    return job in [w.job for w in (await group_record(c)).queue]


# --------------------------------------------------------------------------- connections


async def test_a_connection_without_credentials_is_refused(bus: SecureBus) -> None:
    with pytest.raises(Unavailable, match=r"(?i)authorization violation") as info:
        await connect(bus.url, connect_timeout_s=1)
    assert "--creds" in str(info.value)


async def test_credentials_of_another_operator_are_refused(bus: SecureBus, tmp_path: Path) -> None:
    other = start_secure_bus(tmp_path / "other")
    try:
        with pytest.raises(Unavailable, match=r"(?i)authorization violation"):
            await connect(bus.url, creds=other.creds("job", "a"), connect_timeout_s=1)
    finally:
        other.stop()


async def test_tls_and_mutual_tls_connect(tmp_path: Path) -> None:
    tls = start_secure_bus(tmp_path / "tls", tls=True)
    mtls = start_secure_bus(tmp_path / "mtls", mtls=True)
    try:
        assert tls.certs is not None and mtls.certs is not None
        assert tls.url.startswith("tls://")
        nc = await connect(tls.url, creds=tls.creds("reader"), tls=TlsFiles(ca=tls.certs.ca))
        assert nc.connected_url is not None and nc.connected_url.scheme == "tls"
        await nc.jetstream().account_info()
        await nc.close()
        with pytest.raises(Unavailable):  # the server's certificate is not one the system trusts
            await connect(tls.url, creds=tls.creds("reader"), connect_timeout_s=1)
        c = mtls.certs
        with pytest.raises(Unavailable):  # no client certificate
            await connect(mtls.url, creds=mtls.creds("reader"), tls=TlsFiles(ca=c.ca), connect_timeout_s=1)
        nc = await connect(mtls.url, creds=mtls.creds("reader"), tls=TlsFiles(c.ca, c.client_cert, c.client_key))
        await nc.jetstream().account_info()
        await nc.close()
    finally:
        tls.stop()
        mtls.stop()


async def test_credentials_files_are_private(bus: SecureBus) -> None:
    path = bus.creds("job", "a")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(bus.auth.path.stat().st_mode) == 0o700
    for f in bus.auth.path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


async def test_a_revoked_credential_no_longer_connects(bus: SecureBus) -> None:
    path = bus.creds("job", "a")
    nc = await connect(bus.url, creds=path)
    await nc.close()
    bus.auth.revoke(bus.issued[str(path)].user_key)
    bus.reload()

    async def refused() -> bool:
        try:
            c = await connect(bus.url, creds=path, connect_timeout_s=0.5)
        except Unavailable as exc:
            return "authorization violation" in str(exc).lower()
        await c.close()
        return False

    await eventually(refused, timeout=10, what="the revoked credential refused after the reload")
    nc = await connect(bus.url, creds=bus.creds("job", "a"))  # a fresh one for the same job still works
    await nc.close()


# --------------------------------------------------------------------------- attacks on the lock


async def test_forged_release_with_the_holders_epoch_is_refused(bus: SecureBus, orch: Orchestrator) -> None:
    async with _client(bus, "a") as a, _client(bus, "b") as b, _mallory(bus) as (nc, v):
        g, wait_b = await queue_behind(a, b, wait_s=30)
        forged = encode(Release(group=G, job="a", request_id="forged", epoch=g.epoch))
        await _refused(nc, v, subjects.job(G, "a", "release"), forged)
        # on its own subject, naming the victim: stored, and refused by the orchestrator
        sub = await nc.subscribe(subjects.notice(G, "mallory"))
        await nc.jetstream().publish(subjects.job(G, "mallory", "release"), forged)
        notice = decode_notice((await sub.next_msg(timeout=5)).data)
        assert isinstance(notice, Refused) and "payload names job 'a'" in notice.message
        await _barrier(bus)
        assert await _holder(a) == "a" and a.holding and not wait_b.done()
        await a.release()
        assert (await wait_b).epoch == g.epoch + 1
        await b.release()


async def test_a_client_claiming_another_jobs_id_gets_nothing(bus: SecureBus, orch: Orchestrator) -> None:
    async with _client(bus, "a") as a:
        await a.acquire(timeout=10)
        v = Violations()
        fake = AsyncTimeSliceClient("b", G, bus.url, creds=bus.creds("job", "mallory"), request_timeout_s=0.5)
        fake_nc = await connect(bus.url, creds=bus.creds("job", "mallory"), error_cb=v)
        fake._nc, fake._own_nc = fake_nc, True
        try:
            with pytest.raises(Unavailable):
                await fake.acquire(timeout=5)
            assert v.about(subjects.notice(G, "b"), "subscription")
            assert v.about(subjects.job(G, "b", "acquire"))
        finally:
            await fake.close()
        await _barrier(bus)
        rec = await group_record(a)
        assert rec.holder is not None and rec.holder.job == "a" and not rec.queue
        await a.release()


async def test_forged_granted_and_revoked_notices_are_refused(bus: SecureBus, orch: Orchestrator) -> None:
    async with _client(bus, "a") as a, _client(bus, "b") as b, _mallory(bus) as (nc, v):
        g, wait_b = await queue_behind(a, b, wait_s=30)
        rid = (await group_record(a)).queue[0].request_id
        await _refused(
            nc,
            v,
            subjects.notice(G, "b"),
            encode(
                Granted(
                    group=G,
                    job="b",
                    request_id=rid,
                    epoch=g.epoch + 1,
                    waited_ms=1,
                    context_restored=False,
                    lease_deadline_ms=2**41,
                    waiters=0,
                )
            ),
        )
        await _refused(
            nc, v, subjects.notice(G, "a"), encode(Revoked(group=G, job="a", epoch=g.epoch, reason="forged"))
        )
        await _barrier(bus)
        assert not wait_b.done() and a.holding
        await a.release()  # still a's hold: no LockLost
        await wait_b
        await b.release()


async def test_renewing_a_dead_jobs_lease_is_refused(bus: SecureBus, orch: Orchestrator) -> None:
    dead = _client(bus, "dead", lease_s=1.0)
    g = await dead.acquire(timeout=10)
    assert dead._keeper is not None
    dead._keeper.cancel()  # it dies: no more renewals, no release
    async with _client(bus, "b") as b, _mallory(bus) as (nc, v):
        wait_b = asyncio.create_task(b.acquire(timeout=30))
        renew = encode(Renew(group=G, job="dead", request_id="forged", epoch=g.epoch))
        await _refused(nc, v, subjects.job(G, "dead", "renew"), renew)
        got = await wait_b  # the lease ran out: b is granted within a lease or two
        assert got.epoch == g.epoch + 1
        await b.release()
    assert dead._nc is not None
    await dead._nc.close()


async def test_cancelling_another_jobs_wait_is_refused(bus: SecureBus, orch: Orchestrator) -> None:
    async with _client(bus, "a") as a, _client(bus, "b") as b, _mallory(bus) as (nc, v):
        _, wait_b = await queue_behind(a, b, wait_s=30)
        rid = (await group_record(a)).queue[0].request_id  # what anyone can read in the record
        cancel = msgspec.json.encode(
            {"type": "cancel", "group": G, "job": "b", "request_id": rid, "reason": "cancelled"}
        )
        await _refused(nc, v, subjects.job(G, "b", "cancel"), cancel)
        await _barrier(bus)
        assert await _waiting(a, "b") and not wait_b.done()
        await a.release()
        await wait_b
        await b.release()


async def test_agent_commands_and_results_are_refused(bus: SecureBus, orch: Orchestrator) -> None:
    async with _mallory(bus) as (nc, v):
        snap = Snapshot(group=G, job="a", node="n1", op_id="g:2:snapshot:n1", epoch=10**9, deadline_ms=2**41)
        await _refused(nc, v, subjects.agent_cmd("n1"), encode(snap))
        result = OpResult(group=G, op_id="g:2:snapshot:n1", node="n1", job="a", kind=OpKind.SNAPSHOT, epoch=2, ok=True)
        await _refused(nc, v, subjects.agent_event("n1", G), encode(result))
        # an agent's fact under the job's own subject: stored, and refused by the orchestrator
        before = orch.events_rejected
        mine = OpResult(
            group=G, op_id="g:2:snapshot:n1", node="n1", job="mallory", kind=OpKind.SNAPSHOT, epoch=2, ok=True
        )
        await nc.jetstream().publish(subjects.job(G, "mallory", "phase"), encode(mine))
        await eventually(lambda: orch.events_rejected == before + 1, what="the op_result on a job subject refused")


async def test_an_agent_speaks_only_for_its_node(bus: SecureBus, orch: Orchestrator) -> None:
    nc, v = await _conn(bus, "agent", "n2")
    try:
        result = OpResult(group=G, op_id="g:2:snapshot:n1", node="n1", job="a", kind=OpKind.SNAPSHOT, epoch=2, ok=True)
        await _refused(nc, v, subjects.agent_event("n1", G), encode(result))
        await _refused(nc, v, subjects.agent_cmd("n1"))
        await _refused(nc, v, subjects.workload_rpc("n1", "a"))
        await _refused(nc, v, "$KV.agents.n1")
        before = orch.events_rejected
        await nc.jetstream().publish(subjects.agent_event("n2", G), encode(result))  # its subject, n1's name
        await eventually(lambda: orch.events_rejected == before + 1, what="the node named in the payload refused")
    finally:
        await nc.close()


# --------------------------------------------------------------------------- attacks on workloads and agents


async def test_workload_commands_reach_a_job_only_from_its_nodes_agent(bus: SecureBus) -> None:
    victim, _ = await _conn(bus, "job", "a")
    agent, _ = await _conn(bus, "agent", "n1")
    got: list[bytes] = []

    async def answer(msg: object) -> None:
        got.append(msg.data)  # type: ignore[attr-defined]
        await msg.respond(b"ok")  # type: ignore[attr-defined]

    try:
        await subscribed(victim, subjects.workload_rpc("n1", "a"), answer)
        async with _mallory(bus) as (nc, v):
            discard = encode(WorkloadCommand(op_id="forged", action="suspend", mode=SuspendMode.DISCARD))
            await _refused(nc, v, subjects.workload_rpc("n1", "a"), discard)
            # nor through a consumer of its own that pushes what it stored to the victim's subject
            req = msgspec.json.encode(
                {
                    "stream_name": "TIMESLICE",
                    "config": {
                        "deliver_subject": subjects.workload_rpc("n1", "a"),
                        "deliver_policy": "all",
                        "ack_policy": "none",
                    },
                }
            )
            await _refused(nc, v, "$JS.API.CONSUMER.CREATE.TIMESLICE", req, reply=nc.new_inbox())
        reply = await agent.request(subjects.workload_rpc("n1", "a"), b"legit", timeout=5)  # the node's agent may
        assert reply.data == b"ok" and got == [b"legit"]
    finally:
        await victim.close()
        await agent.close()


async def test_registering_unregistering_and_clearing_for_another_job_is_refused(bus: SecureBus) -> None:
    async with _mallory(bus) as (nc, v):
        for verb in ("register", "unregister"):
            await _refused(nc, v, f"ts.rpc.agent.n1.{verb}.a", reply=nc.new_inbox())
            await _refused(nc, v, f"ts.rpc.agent.n1.{verb}", reply=nc.new_inbox())  # the payload-named form
        await _refused(nc, v, "ts.rpc.agent.n1.clear_fault", reply=nc.new_inbox())
        await _refused(nc, v, subjects.ctl(G, "clear_fault"), encode(ClearFault(group=G, job="a")))
        # its own registration is allowed (the agent checks the rest)
        await nc.publish("ts.rpc.agent.n1.register.mallory", b"{}")
        await nc.flush()
        assert not v.about("ts.rpc.agent.n1.register.mallory")


async def test_job_credentials_limited_to_groups(bus: SecureBus, orch: Orchestrator) -> None:
    path = bus.creds("job", "a", groups=("g1",))
    async with AsyncTimeSliceClient("a", "g1", bus.url, creds=path) as ok:
        await ok.acquire(timeout=10)
        await ok.release()
    v = Violations()
    nc = await connect(bus.url, creds=path, error_cb=v)
    try:
        await _refused(nc, v, subjects.job("g2", "a", "acquire"))
    finally:
        await nc.close()


# --------------------------------------------------------------------------- what each role may do


async def test_admin_clears_faults_and_a_reader_only_reads(bus: SecureBus, orch: Orchestrator) -> None:
    async with _client(bus, "a") as a:
        await a.acquire(timeout=10)
        await a.release()
    admin, _ = await _conn(bus, "admin")
    reader, rv = await _conn(bus, "reader")
    try:
        ack = await admin.jetstream().publish(subjects.ctl(G, "clear_fault"), encode(ClearFault(group=G, job="a")))
        assert ack.seq > 0  # stored: the orchestrator's input
        await _refused(reader, rv, subjects.ctl(G, "clear_fault"), encode(ClearFault(group=G, job="a")))
        await _refused(reader, rv, subjects.job(G, "a", "acquire"))
        js = reader.jetstream()
        kv = await js.key_value("groups")
        assert (await kv.get(G)).value
        info = await js.stream_info("TIMESLICE")
        assert info.state.messages > 0
        seen: list[str] = []

        async def on_msg(msg: object) -> None:
            seen.append(msg.subject)  # type: ignore[attr-defined]

        sub = await js.subscribe("ts.v1.>", stream="TIMESLICE", ordered_consumer=True, cb=on_msg)
        await eventually(lambda: len(seen) >= info.state.messages, what="the reader replays the stream")
        await sub.unsubscribe()
        watcher = await kv.watch(G)
        entry = await watcher.updates(timeout=5)
        assert entry is not None and entry.key == G and entry.value
        await watcher.stop()
        # a reader may not take over or remove a durable consumer
        await _refused(reader, rv, "$JS.API.CONSUMER.DELETE.TIMESLICE.orchestrator", reply=reader.new_inbox())
        await _refused(reader, rv, "$JS.API.CONSUMER.DURABLE.CREATE.TIMESLICE.orchestrator", reply=reader.new_inbox())
        # nor learn the subject the orchestrator's durable delivers on
        await _refused(reader, rv, "$JS.API.CONSUMER.INFO.TIMESLICE.orchestrator", reply=reader.new_inbox())
    finally:
        await admin.close()
        await reader.close()


async def test_the_agent_does_its_nodes_work_with_its_own_credential(bus: SecureBus, orch: Orchestrator) -> None:
    """A real switch: the agent (agent credential, its durable, its KV keys) snapshots a and restores b, whose
    workloads registered with a ``local`` credential (the agent RPC subjects per job come with the agent's side
    of issue 24); a reader asks the agent's status."""
    from timeslice_agent import Agent, AgentConfig

    agent_nc, av = await _conn(bus, "agent", "n1")
    agent = Agent(AgentConfig(node_id="n1", nats_url=bus.url), nc=agent_nc)
    local = bus.creds("local")
    log: list[str] = []
    try:
        async with (
            running(agent),
            AsyncTimeSliceClient("a", G, bus.url, creds=local) as a,
            AsyncTimeSliceClient("b", G, bus.url, creds=local) as b,
        ):
            gb = await recorded_switch(a, b, log, "n1", wait_s=30)
            assert gb.context_restored and log == ["a:suspend"]
            await b.release()
            reader, _ = await _conn(bus, "reader")
            try:
                jobs = msgspec.json.decode(
                    (await reader.request(subjects.agent_rpc("n1", "status"), b"", timeout=5)).data
                )
                assert {j["job"] for j in jobs} == {"a", "b"}
            finally:
                await reader.close()
        assert not any("permissions violation" in s for s in av.seen), av.seen
    finally:
        await agent_nc.close()


def test_permissions_name_no_secret_and_tags_follow_the_contract(bus: SecureBus) -> None:
    from timeslice_orchestrator._auth_issue import decode_jwt

    path = bus.creds("job", "a", groups=("g1", "g2"))
    issued = bus.issued[str(path)]
    claims = decode_jwt(issued.jwt, issuer=bus.auth.account_key)
    assert claims["name"] == "job:a"
    assert claims["nats"]["tags"] == [
        "timeslice-role:job",
        "timeslice-job:a",
        "timeslice-group:g1",
        "timeslice-group:g2",
    ]
    assert "_INBOX_job_a.>" in claims["nats"]["sub"]["allow"]
    assert os.fsdecode(issued.seed) not in issued.jwt
