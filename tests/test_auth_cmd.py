"""``timeslice auth …`` and the credentials every command takes (``--creds``, ``$TIMESLICE_CREDS``), and
``timeslice up`` secure by default: auth on, keys private in its data dir, the local user's credentials beside the URL
file so that the README's quick start needs nothing more."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import nats
import pytest
from timeslice_cli import build_parser
from timeslice_client import AsyncTimeSliceClient
from timeslice_orchestrator._auth_issue import AuthDir, decode_jwt
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .agent_harness import up_command, up_fields
from .auth_stack import SecureBus
from .helpers import running

# `timeslice up` takes NATS port 4222 when it is free: tests that need it free to themselves wait (tests/conftest.py)
pytestmark = pytest.mark.port_4222("shared")


def _timeslice(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "timeslice_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or dict(os.environ, TIMESLICE_LOG_LEVEL="warning"),
        check=False,
    )


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_auth_init_is_idempotent_and_private(tmp_path: Path) -> None:
    d = tmp_path / "auth"
    r = _timeslice("auth", "init", "--dir", str(d))
    assert r.returncode == 0, r.stderr
    assert "created" in r.stdout
    seeds = {p.name: p.read_bytes() for p in d.glob("*.nk")}
    assert set(seeds) == {"operator.nk", "sys.nk", "account.nk"}
    assert _mode(d) == 0o700 and all(_mode(p) == 0o600 for p in d.iterdir())
    r = _timeslice("auth", "init", "--dir", str(d))
    assert r.returncode == 0 and "reused" in r.stdout
    assert {p.name: p.read_bytes() for p in d.glob("*.nk")} == seeds  # never overwritten
    conf = (d / "nats-auth.conf").read_text()
    assert "resolver: MEMORY" in conf and "operator:" in conf and "system_account:" in conf
    assert all(s.decode().strip() not in conf for s in seeds.values())  # no seed in the server config


def test_auth_issues_each_role_with_the_contracts_claims(tmp_path: Path) -> None:
    d = tmp_path / "auth"
    assert _timeslice("auth", "init", "--dir", str(d)).returncode == 0
    account = (d / "account.pub").read_text().strip()
    cases = {
        "job": (
            ["--job", "trainer-1", "--group", "g1", "--group", "g2", "--ttl", "30d"],
            "job:trainer-1",
            ["timeslice-role:job", "timeslice-job:trainer-1", "timeslice-group:g1", "timeslice-group:g2"],
        ),
        "agent": (["--node", "gpu-7"], "agent:gpu-7", ["timeslice-role:agent", "timeslice-node:gpu-7"]),
        "orchestrator": ([], "orchestrator", ["timeslice-role:orchestrator"]),
        "admin": ([], "admin", ["timeslice-role:admin"]),
        "reader": ([], "reader", ["timeslice-role:reader"]),
    }
    for role, (extra, name, tags) in cases.items():
        out = tmp_path / f"{role}.creds"
        r = _timeslice("auth", role, "--dir", str(d), "--out", str(out), *extra)
        assert r.returncode == 0, r.stderr
        assert _mode(out) == 0o600
        text = out.read_text()
        jwt = text.split("-----BEGIN NATS USER JWT-----")[1].split("------END")[0].strip()
        claims = decode_jwt(jwt, issuer=account)  # signed by the TIMESLICE account
        assert claims["name"] == name and claims["nats"]["tags"] == tags
        assert claims["sub"] in r.stdout  # the user key is printed, for a later revocation
        seed = text.split("-----BEGIN USER NKEY SEED-----")[1].split("------END")[0].strip()
        assert seed not in r.stdout and seed not in r.stderr
        if role == "job":
            assert claims["exp"] - claims["iat"] == 30 * 86400
        else:
            assert "exp" not in claims
    issued = [json.loads(x) for x in (d / "issued.jsonl").read_text().splitlines()]
    assert [i["name"] for i in issued] == [c[1] for c in cases.values()]
    assert _timeslice("auth", "job", "--dir", str(d), "--out", str(tmp_path / "x"), "--job", "bad.id").returncode != 0
    assert (
        _timeslice(
            "auth", "job", "--dir", str(tmp_path / "none"), "--out", str(tmp_path / "x"), "--job", "j"
        ).returncode
        != 0
    )


def test_revoke_rewrites_the_server_config(tmp_path: Path) -> None:
    d = tmp_path / "auth"
    assert _timeslice("auth", "init", "--dir", str(d)).returncode == 0
    out = tmp_path / "j.creds"
    assert _timeslice("auth", "job", "--dir", str(d), "--job", "j", "--out", str(out)).returncode == 0
    r = _timeslice("auth", "revoke", "--dir", str(d), "--creds-file", str(out))
    assert r.returncode == 0, r.stderr
    auth = AuthDir.load(d)
    user = decode_jwt(out.read_text().split("-----BEGIN NATS USER JWT-----")[1].split("------END")[0].strip())["sub"]
    assert user in auth.revocations()
    account_jwt = (d / "account.jwt").read_text().strip()
    assert user in decode_jwt(account_jwt)["nats"]["revocations"]
    assert account_jwt in (d / "nats-auth.conf").read_text()
    assert _timeslice("auth", "revoke", "--dir", str(d), "--user-key", "Unot-a-key").returncode != 0


async def test_commands_take_creds_by_flag_and_environment(bus: SecureBus) -> None:
    cfg = OrchestratorConfig(nats_url=bus.url, creds=bus.creds("orchestrator"))
    async with running(Orchestrator(cfg)):
        async with AsyncTimeSliceClient("a", "g", bus.url, creds=bus.creds("job", "a")) as a:
            await a.acquire(timeout=10)
            await a.release()
        reader, admin = bus.creds("reader"), bus.creds("admin")
        base = dict(os.environ, TIMESLICE_LOG_LEVEL="warning", TIMESLICE_URL_FILE=str(bus.dir / "none.url"))
        base.pop("TIMESLICE_CREDS", None)
        r = await asyncio.to_thread(_timeslice, "status", "--json", "--nats-url", bus.url, env=base)
        assert r.returncode != 0 and "Authorization Violation" in r.stderr and "--creds" in r.stderr
        r = await asyncio.to_thread(
            _timeslice, "status", "--json", "--nats-url", bus.url, "--creds", str(reader), env=base
        )
        assert r.returncode == 0, r.stderr
        assert '"g"' in r.stdout  # the group record
        by_env = dict(base, TIMESLICE_CREDS=str(reader))
        r = await asyncio.to_thread(_timeslice, "events", "--nats-url", bus.url, env=by_env)
        assert r.returncode == 0, r.stderr
        assert "acquire" in r.stdout
        for cmd in ("replay", "check"):
            r = await asyncio.to_thread(_timeslice, cmd, "--nats-url", bus.url, "--creds", str(reader), env=base)
            assert r.returncode in (0, 1), (cmd, r.stderr)  # read the stream (check: 1 when it finds a fault)
            assert "Violation" not in r.stderr and "Unavailable" not in r.stderr, (cmd, r.stderr)
        clear_fault = ("clear-fault", "--group", "g", "--job", "a", "--nats-url", bus.url)
        r = await asyncio.to_thread(_timeslice, *clear_fault, "--creds", str(admin), env=base)
        assert r.returncode == 0, r.stderr
        r = await asyncio.to_thread(_timeslice, *clear_fault, "--creds", str(reader), env=base, timeout=90)
        assert r.returncode != 0  # a reader may not: the stream never stores it
    text = " ".join(p.read_text() for p in bus.dir.glob("nats/*.log"))
    assert reader.read_text().split("SEED-----")[1].split("------END")[0].strip() not in text


def test_every_command_that_connects_takes_the_identity_flags() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    choices = sub.choices  # type: ignore[attr-defined]
    for name in (
        "orchestrator",
        "status",
        "events",
        "replay",
        "check",
        "clear-fault",
        "agent",
        "agent-status",
        "agent-clear-fault",
    ):
        flags = {o for a in choices[name]._actions for o in a.option_strings}
        assert {"--creds", "--tls-ca", "--tls-cert", "--tls-key"} <= flags, name
    up = {o for a in choices["up"]._actions for o in a.option_strings}
    assert "--no-auth" in up and "--auth-dir" in up
    assert parser.parse_args(["orchestrator"]).metrics_host == "127.0.0.1"  # nothing on 0.0.0.0 unless asked


async def _quiet(exc: Exception) -> None:
    pass


def _start_up(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    args, env = up_command(tmp_path, *extra)
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("timeslice up: nats="), (line, proc.poll())
    return proc, up_fields(line)


def _stop(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out, err


async def test_timeslice_up_runs_with_auth_and_local_clients_need_no_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIMESLICE_URL_FILE", str(tmp_path / "nats.url"))
    monkeypatch.delenv("TIMESLICE_CREDS", raising=False)
    monkeypatch.delenv("TIMESLICE_NATS_URL", raising=False)
    proc, fields = await asyncio.to_thread(_start_up, tmp_path, "--agent-process")
    try:
        creds = Path(fields["creds"])
        assert creds == tmp_path / "nats.creds" and _mode(creds) == 0o600
        auth = tmp_path / "data" / "auth"
        assert _mode(auth) == 0o700 and all(_mode(p) == 0o600 for p in auth.iterdir())
        assert decode_jwt(creds.read_text().split("JWT-----")[1].split("------END")[0].strip())["name"] == "local"
        # the README's quick start: no URL, no credentials given
        async with AsyncTimeSliceClient("job-a", "gpus-0", lease_s=30) as client:
            g = await client.acquire(timeout=20)
            await client.release()
            assert (await client.status()).epoch == g.epoch
        with pytest.raises(Exception, match=r"(?i)authorization violation"):  # anyone else: refused
            await nats.connect(fields["nats"], allow_reconnect=False, connect_timeout=2, error_cb=_quiet)
        # `up` and its agent process (its session: it was started in a new one)
        ps = subprocess.run(
            ["ps", "-o", "args=", "-s", str(proc.pid)], capture_output=True, text=True, check=True
        ).stdout
        assert "timeslice_agent" in ps
        seed = creds.read_text().split("SEED-----")[1].split("------END")[0].strip()
        assert seed not in ps and ".creds" not in ps  # the agent gets its file's path by environment
    finally:
        if proc.poll() is None:
            await asyncio.to_thread(_stop, proc)


def test_timeslice_up_no_auth_says_so(tmp_path: Path) -> None:
    proc, fields = _start_up(tmp_path, "--no-auth")
    try:
        assert fields["creds"] == "-"
    finally:
        _, err = _stop(proc)
    assert b"WARNING --no-auth" in err
