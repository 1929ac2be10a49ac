"""``timeslice health``: one line per check and exit 1 when the stack cannot grant, against real servers."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from timeslice_agent import Agent, AgentConfig
from timeslice_client import AsyncTimeSliceClient

from .helpers import run_text, running

ROOT = Path(__file__).resolve().parents[1]


def health(url: str, *args: str, timeout: float = 60) -> tuple[int, dict[str, object], float]:
    t0 = time.monotonic()
    out = run_text(
        [sys.executable, "-m", "timeslice_cli", "health", "--nats-url", url, "--json", *args], timeout=timeout
    )
    elapsed = time.monotonic() - t0
    assert out.stdout, out.stderr
    return out.returncode, json.loads(out.stdout), elapsed


async def health_async(url: str, *args: str) -> tuple[int, dict[str, object], float]:
    """``health`` off the event loop: the test's orchestrator and agent run on it (a blocked loop lets the
    orchestrator's 1 s lease lapse, which the check then reports, rightly)."""
    return await asyncio.to_thread(health, url, *args)


def plain_health(url: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``timeslice health`` without ``--json`` (a 2 s timeout), in ``env`` (None: this process's)."""
    return run_text(
        [sys.executable, "-m", "timeslice_cli", "health", "--nats-url", url, "--timeout", "2"], timeout=60, env=env
    )


def statuses(doc: dict[str, object]) -> dict[str, str]:
    checks = doc["checks"]
    assert isinstance(checks, list)
    return {c["name"]: c["status"] for c in checks}


def test_no_server_fails_the_bus_check_within_the_timeout() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, doc, elapsed = health(f"nats://127.0.0.1:{port}", "--timeout", "2")
    assert rc == 1 and doc["ok"] is False and statuses(doc) == {"bus": "fail"}, doc
    assert elapsed < 20, elapsed  # refused at once; the interpreter's start is most of it


def test_a_bus_without_an_orchestrator_is_not_healthy(nats_url: str) -> None:
    rc, doc, _ = health(nats_url, "--timeout", "2")
    assert rc == 1, doc
    assert statuses(doc)["bus"] == "ok" and statuses(doc)["stream"] == "fail", doc
    assert statuses(doc)["orchestrator"] == "fail", doc


async def test_a_running_stack_is_healthy_and_a_required_node_without_an_agent_is_not(
    orchestrator: object, nats_url: str
) -> None:
    async with (
        running(Agent(AgentConfig(node_id="node-h", nats_url=nats_url))),
        AsyncTimeSliceClient("j", "g-health", nats_url) as job,
    ):
        await job.acquire(timeout=30)  # one group, held
        rc, doc, _ = await health_async(nats_url, "--node-id", "node-h")
        assert rc == 0 and doc["ok"] is True, doc
        assert set(statuses(doc).values()) == {"ok"}, doc
        rc, doc, _ = await health_async(nats_url, "--node-id", "node-h", "--node-id", "nosuch")
        assert rc == 1 and statuses(doc)["agents"] == "fail", doc
        detail = next(c["detail"] for c in doc["checks"] if c["name"] == "agents")  # type: ignore[union-attr]
        assert "nosuch" in detail and "node-h" in detail, detail
        await job.release()


async def test_without_agents_it_warns_and_strict_makes_the_warning_fail(orchestrator: object, nats_url: str) -> None:
    async with AsyncTimeSliceClient("j", "g-health", nats_url) as job:  # a grant: the orchestrator leads by now
        await job.acquire(timeout=30)
        await job.release()
    rc, doc, _ = await health_async(nats_url)
    assert rc == 0 and statuses(doc)["agents"] == "warn", doc
    rc, doc, _ = await health_async(nats_url, "--strict")
    assert rc == 1 and doc["ok"] is False, doc


def test_the_plain_output_is_one_line_per_check_and_a_verdict(nats_url: str) -> None:
    out = plain_health(nats_url)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 1, out
    assert [ln.split()[1] for ln in lines[:-1]] == ["bus", "stream", "orchestrator", "agents", "groups"], lines
    assert lines[0].startswith("OK") and lines[-1] == "NOT healthy", lines


def test_colour_only_on_a_terminal_or_when_forced_and_never_with_no_color(nats_url: str) -> None:
    def run(**env: str) -> str:
        base = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
        return plain_health(nats_url, {**base, **env}).stdout

    plain = run()
    assert "\x1b" not in plain and plain.splitlines()[-1] == "NOT healthy", plain  # a pipe: the text as it is
    forced = run(FORCE_COLOR="1")
    assert "\x1b[" in forced and "NOT healthy" in forced, forced
    assert re.search(r"\x1b\[[0-9;]*3[0-9]m", forced), forced  # a colour
    assert not re.search(r"\x1b\[[0-9;]*3[0-9]m", run(FORCE_COLOR="1", NO_COLOR="1"))  # bold may stay


async def test_a_hostile_agent_record_is_shown_bounded_and_a_garbage_one_is_not_live(
    orchestrator: object, nats_url: str
) -> None:
    """KV ``agents`` is anyone's to write on an open bus: a record with 40 backends of 10,000 characters is shown
    cut, a value that is no record is not a live agent, and neither ends the command."""
    import msgspec
    from timeslice_client.bus import connect
    from timeslice_client.protocol import AGENTS_BUCKET, AgentInfo

    nc = await connect(nats_url)
    try:
        async with AsyncTimeSliceClient("j", "g-health", nats_url) as job:  # the orchestrator leads by now
            await job.acquire(timeout=30)
            await job.release()
        kv = await nc.jetstream().key_value(AGENTS_BUCKET)
        await kv.put(
            "huge",
            msgspec.json.encode(
                AgentInfo(node="huge", pid=1, started_at_ms=0, backends=tuple("b" * 10_000 for _ in range(40)))
            ),
        )
        await kv.put("garbage", b"\x00 not json")
        rc, doc, _ = await health_async(nats_url)
    finally:
        await nc.close()
    detail = next(c["detail"] for c in doc["checks"] if c["name"] == "agents")  # type: ignore[union-attr]
    assert rc == 0 and statuses(doc)["agents"] == "ok", doc
    assert "huge" in detail and "garbage" not in detail and len(detail) < 600, detail[:300]
