"""Who may call the gRPC shims: the real orchestrator shim (and the agent's) over real sockets, with certificates
and tokens made here (tests/grpc_identity_helpers.py). A caller acts only as the job its certificate or token names;
any authenticated caller may read; no, bad, expired, foreign or revoked credentials are UNAUTHENTICATED; plaintext
is served on loopback only (to the local user), or to anyone on an explicit ``insecure``."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from timeslice_client import AsyncTimeSliceClient
from timeslice_client._grpc.runtime import channel_credentials
from timeslice_client._internal.grpc_server.guard import GrpcRefusedToStart
from timeslice_orchestrator.grpc_shim import GrpcConfig, OrchestratorGrpcShim

from .grpc_helpers import call, orchestrator_command, rpc_error
from .grpc_identity_helpers import (
    Pki,
    account_jwt,
    dns,
    make_pki,
    new_account,
    new_key,
    public,
    uri,
    user_jwt,
    write_auth_conf,
)
from .grpc_proto_client import OrchestratorClient
from .helpers import eventually

# module-scoped fixtures: the whole module in one worker, its fixtures made once

DENIED, UNAUTH = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(
        tmp_path_factory.mktemp("pki"),
        {
            "uri-a": ("some-cn", [uri("spiffe://timeslice/job/job-a")]),
            "uri-b": ("other-cn", [uri("spiffe://timeslice/job/job-b"), dns("localhost")]),
            "dns-a": ("x", [dns("job-a.job.timeslice")]),
            "cn-a": ("job:job-a", []),
            "monitor": ("monitor", [uri("spiffe://timeslice/monitor")]),  # names no job: may read only
        },
    )


async def code_of(fn: Any, *args: Any, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    err: Any = await rpc_error(fn, *args, **kwargs)
    return err.code(), err.details() or ""


@pytest.fixture
async def start(nats_url: str, orchestrator: Any) -> AsyncIterator[Any]:
    shims: list[OrchestratorGrpcShim] = []

    async def go(**kw: Any) -> OrchestratorGrpcShim:
        s = OrchestratorGrpcShim(
            GrpcConfig(**{"host": "127.0.0.1", "port": 0, "lease_s": 2.0, "liveness_interval_s": 0.05, **kw}),
            nats_url=nats_url,
        )
        await s.start()
        shims.append(s)
        return s

    yield go
    for s in shims:
        await s.stop()


def tls_client(pki: Pki, port: int, cert: str | None, **kw: Any) -> OrchestratorClient:
    files = pki.client(cert) if cert else (None, None)
    return OrchestratorClient(f"localhost:{port}", credentials=channel_credentials(pki.ca, *files), **kw)


# ---------------------------------------------------------------------------------------------- certificates


@pytest.mark.parametrize(("source", "cert_a"), [("san-uri", "uri-a"), ("san-dns", "dns-a"), ("cn", "cn-a")])
async def test_mutual_tls_binds_the_job_to_the_client_certificate(
    start: Any, pki: Pki, source: str, cert_a: str
) -> None:
    s = await start(
        tls_cert=pki.server_cert,
        tls_key=pki.server_key,
        tls_client_ca=pki.ca,
        identity_from=source,
        local_callers=False,
    )
    group = f"mtls-{source}"
    with tls_client(pki, s.port, cert_a, group_id=group) as a, tls_client(pki, s.port, "uri-b", group_id=group) as b:
        assert (await call(a.acquire, "job-a", timeout=10)).success
        code, why = await code_of(a.acquire, "job-b", timeout=10)
        assert code is DENIED and "acts only as job 'job-a'" in why, why
        # job b's certificate can neither yield job a's hold nor take a's place
        if source == "san-uri":
            code, _ = await code_of(b.release, "job-a")
            assert code is DENIED
            assert (await call(b.get_status)).group.locking_job == "job-a"  # reads are fine, and a still holds
        assert (await call(a.release, "job-a")).success
    # no client certificate: the TLS handshake fails
    with tls_client(pki, s.port, None) as anon:
        code, _ = await code_of(anon.list_groups, timeout=5)
        assert code is grpc.StatusCode.UNAVAILABLE
    assert s.auth.refused["permission_denied"] >= 1


async def test_a_certificate_naming_no_job_may_only_read(start: Any, pki: Pki) -> None:
    s = await start(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca, local_callers=False)
    with tls_client(pki, s.port, "monitor", group_id="mon") as m:
        assert isinstance(await call(m.list_groups), list)
        code, why = await code_of(m.acquire, "job-a", timeout=5)
        assert code is DENIED and "may only read" in why


# ---------------------------------------------------------------------------------------------- bearer tokens


async def test_bearer_tokens_bind_the_job(start: Any, pki: Pki) -> None:
    account, other = new_account(), new_account()
    s = await start(
        tls_cert=pki.server_cert, tls_key=pki.server_key, trust_account=public(account), local_callers=False
    )

    def client(token: str | None, group: str = "tok") -> OrchestratorClient:
        return tls_client(pki, s.port, None, group_id=group, token=token)

    with client(user_jwt(account, "job", job="job-a")) as a:
        assert (await call(a.acquire, "job-a", timeout=10)).success
        code, why = await code_of(a.acquire, "job-b", timeout=10)
        assert code is DENIED and "job-b" in why
        with client(user_jwt(account, "job", job="job-b")) as b:
            code, _ = await code_of(b.release, "job-a")
            assert code is DENIED
        assert (await call(a.release, "job-a")).success

    refused = {
        "forged": user_jwt(account, "job", job="job-a", signer=new_account()),  # claims the account, another key
        "expired": user_jwt(account, "job", job="job-a", ttl_s=-5),
        "foreign": user_jwt(other, "job", job="job-a"),  # a valid token of another account
        "garbage": "not.a-token",
        "no role": user_jwt(account, "", job="job-a"),
    }
    why_has = {
        "forged": "signature",
        "expired": "expired",
        "foreign": "not by the trusted account",
        "garbage": "not a JWT",
        "no role": "timeslice-role",
    }
    for what, token in refused.items():
        with client(token) as c:
            for fn, args in ((c.acquire, ("job-a",)), (c.list_groups, ())):
                code, why = await code_of(fn, *args, timeout=5)
                assert code is UNAUTH and why_has[what] in why, (what, why)
                assert token not in why
    with client(None) as c:  # no token at all (and local callers off)
        code, why = await code_of(c.list_groups, timeout=5)
        assert code is UNAUTH and "Bearer" in why

    with client(user_jwt(account, "reader")) as r:
        assert isinstance(await call(r.list_groups), list)
        code, why = await code_of(r.acquire, "job-a", timeout=5)
        assert code is DENIED and "may only read" in why
    with client(user_jwt(account, "job", job="job-g", groups=["g-1"]), group="g-2") as g:
        code, why = await code_of(g.acquire, "job-g", timeout=5)
        assert code is DENIED and "g-1" in why
        assert (await call(g.acquire, "job-g", "g-1", timeout=10)).success
        await call(g.release, "job-g", "g-1")
    with client(user_jwt(account, "local")) as local:  # `timeslice up`'s local user: any job
        assert (await call(local.acquire, "anyone", timeout=10)).success
        await call(local.release, "anyone")


async def test_a_yield_of_a_hold_taken_over_the_bus_is_refused_to_another_job(
    start: Any, pki: Pki, nats_url: str
) -> None:
    account = new_account()
    s = await start(trust_account=public(account), local_callers=False)  # plaintext on loopback: tokens
    target = f"127.0.0.1:{s.port}"
    async with AsyncTimeSliceClient("job-b", "bus-held", nats_url) as bus:
        await bus.acquire(timeout=10)
        with OrchestratorClient(target, group_id="bus-held", token=user_jwt(account, "job", job="job-a")) as a:
            code, why = await code_of(a.release, "job-b")
            assert code is DENIED and "not as job 'job-b'" in why
            assert (await call(a.get_status)).group.locking_job == "job-b"
        assert bus.holding
        # job b's own token may yield it (the shim takes the bus hold over, then yields)
        with OrchestratorClient(target, group_id="bus-held", token=user_jwt(account, "job", job="job-b")) as b:
            assert (await call(b.release, "job-b")).success
            assert (await call(b.get_status)).group.locking_job == ""


async def test_tokens_from_the_auth_dir_and_its_revocations(start: Any, tmp_path: Path) -> None:
    operator, account = new_key(0x70), new_account()  # 0x70: nkeys.PREFIX_BYTE_OPERATOR ('O')
    system = new_account()
    conf = tmp_path / "nats-auth.conf"
    token = user_jwt(account, "job", job="job-r", iat=1)
    write_auth_conf(
        conf,
        operator,
        system,
        {public(system): account_jwt(system, operator, name="SYS"), public(account): account_jwt(account, operator)},
    )
    s = await start(trust_account=str(tmp_path), local_callers=False)
    with OrchestratorClient(f"127.0.0.1:{s.port}", group_id="rev", token=token) as c:
        assert isinstance(await call(c.list_groups), list)
        user = _sub(token)
        write_auth_conf(
            conf,
            operator,
            system,
            {
                public(system): account_jwt(system, operator, name="SYS"),
                public(account): account_jwt(account, operator, revocations={user: 2}),
            },
        )
        os.utime(conf, ns=(conf.stat().st_mtime_ns + 10**9,) * 2)  # the rewrite may land within one mtime tick

        async def refused() -> bool:
            try:
                await call(c.list_groups, timeout=5)
            except grpc.RpcError as exc:
                return exc.code() is UNAUTH and "revoked" in (exc.details() or "")
            return False

        await eventually(refused, timeout=10, what="the revoked token refused")


def _sub(token: str) -> str:
    import base64
    import json

    body = token.split(".")[1]
    return str(json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))["sub"])


# ---------------------------------------------------------------------------------------------- plaintext, local


async def test_plaintext_is_served_on_loopback_only_unless_insecure(
    start: Any, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    for kw in (
        {"host": "0.0.0.0"},
        {"host": "0.0.0.0", "trust_account": public(new_account())},
        {"host": "0.0.0.0", "tls_cert": pki.server_cert, "tls_key": pki.server_key},
        {"local_callers": False},
    ):
        with pytest.raises(GrpcRefusedToStart) as info:
            await start(**kw)
        assert "--grpc-" in str(info.value), kw
    with caplog.at_level(logging.WARNING, logger="timeslice.orchestrator.grpc"):
        s = await start(insecure=True, local_callers=False)
    assert any("does NOT authenticate" in r.getMessage() for r in caplog.records)
    with OrchestratorClient(f"127.0.0.1:{s.port}", group_id="open") as c:
        assert (await call(c.acquire, "whoever", timeout=10)).success
        await call(c.release, "whoever")


async def test_a_loopback_caller_is_the_local_user_only_under_this_uid(start: Any) -> None:
    s = await start()  # the default: plaintext on 127.0.0.1, callers running as this user act as any job
    with OrchestratorClient(f"127.0.0.1:{s.port}", group_id="loc") as c:
        assert (await call(c.acquire, "j-local", timeout=10)).success
        await call(c.release, "j-local")
    python = "/usr/bin/python3"  # stdlib only; the venv's interpreter may sit where another user cannot read
    if os.geteuid() != 0 or not Path(python).exists():
        pytest.skip("a caller running as another user needs root and /usr/bin/python3")
    # A TCP relay running as `nobody`: the shim sees a loopback connection whose socket another user owns.
    proxy = subprocess.Popen(
        [python, "-c", _RELAY, str(s.port)], user=65534, group=65534, cwd="/", env={}, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proxy.stdout is not None
        relay_port = int(await asyncio.wait_for(asyncio.to_thread(proxy.stdout.readline), 30))
        with OrchestratorClient(f"127.0.0.1:{relay_port}", group_id="loc") as other:
            code, why = await code_of(other.list_groups, timeout=10)
            assert code is UNAUTH and "no credentials" in why
    finally:
        proxy.kill()
        proxy.wait(10)
    assert s.auth.refused["unauthenticated"] == 1


_RELAY = """
import socket, sys, threading
up = int(sys.argv[1])
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
def pipe(a, b):
    try:
        while (data := a.recv(65536)):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
while True:
    c, _ = srv.accept()
    u = socket.create_connection(("127.0.0.1", up))
    threading.Thread(target=pipe, args=(c, u), daemon=True).start()
    threading.Thread(target=pipe, args=(u, c), daemon=True).start()
"""


async def test_health_alone_on_a_plaintext_port_beside_mutual_tls(start: Any, pki: Pki) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    s = await start(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca, health_port=0)
    assert s.health_port

    def probe() -> tuple[int, grpc.StatusCode]:
        with grpc.insecure_channel(f"127.0.0.1:{s.health_port}") as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            m = ch.unary_unary("/timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService/ListGroups")
            try:
                m(b"", timeout=5)
            except grpc.RpcError as exc:
                return int(status), exc.code()
            return int(status), grpc.StatusCode.OK

    status, api = await call(probe)
    assert status == health_pb2.HealthCheckResponse.SERVING and api is grpc.StatusCode.UNIMPLEMENTED


def test_the_cli_refuses_plaintext_grpc_off_loopback(nats_url: str) -> None:
    done = subprocess.run(
        orchestrator_command(nats_url, "--grpc-port", "0", "--grpc-host", "0.0.0.0"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=dict(os.environ, TIMESLICE_LOG_LEVEL="warning"),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--grpc-insecure" in done.stderr and "without TLS" in done.stderr


# ---------------------------------------------------------------------------------------------- the agent's shim


@pytest.fixture
def agent_token_account() -> Iterator[Any]:
    yield new_account()


async def test_agent_shim_acts_only_for_the_callers_job(nats_url: str, agent_token_account: Any) -> None:
    from timeslice_agent import Agent, AgentConfig
    from timeslice_agent.grpc_shim import AgentGrpcConfig, AgentGrpcShim
    from timeslice_client._grpc import snapshot_agent_pb2 as pb
    from timeslice_client._grpc import snapshot_agent_pb2_grpc as pb_grpc

    from .helpers import running

    account = agent_token_account
    async with running(Agent(AgentConfig(node_id="node-id", nats_url=nats_url))) as agent:
        shim = AgentGrpcShim(
            agent, AgentGrpcConfig(host="127.0.0.1", port=0, trust_account=public(account), local_callers=False)
        )
        port = await shim.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.SnapshotAgentServiceStub(ch)

                def md(token: str) -> tuple[tuple[str, str]]:
                    return (("authorization", f"Bearer {token}"),)

                a = md(user_jwt(account, "job", job="job-a"))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Snapshot(pb.SnapshotRequest(job_id="job-b"), metadata=a, timeout=5)
                assert err.value.code() is DENIED
                with pytest.raises(grpc.aio.AioRpcError) as err:  # its own job: past the door (not registered)
                    await stub.Snapshot(pb.SnapshotRequest(job_id="job-a"), metadata=a, timeout=5)
                assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Status(pb.StatusRequest(), timeout=5)
                assert err.value.code() is UNAUTH
                await stub.Status(pb.StatusRequest(), metadata=md(user_jwt(account, "reader")), timeout=5)
        finally:
            await shim.stop()


async def test_the_documented_client_snippet_sends_the_token_of_a_creds_file(
    start: Any, pki: Pki, tmp_path: Path
) -> None:
    """docs/security.md's gRPC Python example, run as written against a TLS shim that takes tokens."""
    import re

    from .grpc_proto_client import ORCHESTRATOR_PROTO, Stub, compile_proto

    account = new_account()
    s = await start(
        tls_cert=pki.server_cert, tls_key=pki.server_key, trust_account=public(account), local_callers=False
    )
    jwt = user_jwt(account, "job", job="job-a")
    (tmp_path / "job-a.creds").write_text(  # the NATS .creds layout
        f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n\n"
        "-----BEGIN USER NKEY SEED-----\nSUAIBDPBAUTWCWBKIO6XHQNINK5FWJW4OHLXC3HQ2KFE4PEJUA44CNHTC4\n"
        "------END USER NKEY SEED------\n"
    )
    (tmp_path / "ca.crt").write_bytes(pki.ca.read_bytes())
    doc = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    doc = doc.split("## Identities on the gRPC APIs", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", doc, flags=re.DOTALL)
    assert snippet
    code = snippet.group(1).replace('"orchestrator:50051"', f'"localhost:{s.port}"')
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        scope: dict[str, Any] = {}
        exec(code, scope)
    finally:
        os.chdir(cwd)
    channel = scope["channel"]
    try:
        pb = compile_proto(ORCHESTRATOR_PROTO)
        stub = Stub(channel, pb, "TimeSliceOrchestratorService")
        r = await call(stub.Acquire, pb.AcquireRequest(job_id="job-a", group_id="doc"), timeout=10)
        assert r.success
        with pytest.raises(grpc.RpcError) as err:
            await call(stub.Acquire, pb.AcquireRequest(job_id="job-b", group_id="doc"), timeout=10)
        assert err.value.code() is DENIED  # type: ignore[attr-defined]
        await call(stub.Yield, pb.YieldRequest(job_id="job-a", group_id="doc"), timeout=10)
    finally:
        channel.close()


@pytest.mark.parametrize("quote", ["", '"'])
def test_the_trusted_account_is_read_from_a_key_a_jwt_or_a_server_config(tmp_path: Path, quote: str) -> None:
    from timeslice_client._internal.grpc_server.identity import Trust, TrustError

    operator, system, account = new_key(0x70), new_account(), new_account()
    acc_jwt = account_jwt(account, operator)
    preload = (
        f"  {quote}{public(system)}{quote}: {quote}{account_jwt(system, operator, name='SYS')}{quote}\n"
        f"  {quote}{public(account)}{quote}: {quote}{acc_jwt}{quote}\n"
    )
    (tmp_path / "nats-auth.conf").write_text(f"resolver: MEMORY\nresolver_preload: {{\n{preload}}}\n")
    (tmp_path / "account.jwt").write_text(acc_jwt + "\n")
    (tmp_path / "account.pub").write_text(public(account) + "\n")
    for source in (
        public(account),
        tmp_path,
        tmp_path / "nats-auth.conf",
        tmp_path / "account.jwt",
        tmp_path / "account.pub",
    ):
        assert Trust(source).account().public_key == public(account), source
    (tmp_path / "other.conf").write_text(
        f"resolver_preload: {{\n  {public(system)}: {account_jwt(system, operator, name='SYS')}\n}}\n"
    )
    for bad in (tmp_path / "other.conf", tmp_path / "missing", "AXXX", "A" + "B" * 55):
        with pytest.raises(TrustError):
            Trust(bad)
