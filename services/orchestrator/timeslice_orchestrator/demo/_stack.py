"""The demo's private stack: a nats-server in the demo's work directory, the orchestrator in this
process and the node's snapshot agent as its own process (as ``timeslice up`` runs them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from ..embedded import NatsServer
from ..service import Orchestrator, OrchestratorConfig

__all__ = ["Stack", "embedded_stack"]

READY_TIMEOUT_S = 60.0  # a fresh interpreter on a loaded 2-core machine may take this long
STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True, slots=True)
class Stack:
    nats_url: str
    node_id: str
    orchestrator: Orchestrator


async def _agent_announced(url: str, node: str, proc: asyncio.subprocess.Process, log: Path) -> None:
    from timeslice_client.bus import connect
    from timeslice_client.protocol import AGENTS_BUCKET

    nc = await connect(url)
    try:
        kv = await nc.jetstream().key_value(AGENTS_BUCKET)
        async with asyncio.timeout(READY_TIMEOUT_S):
            while True:
                if proc.returncode is not None:
                    raise RuntimeError(f"the snapshot agent exited with {proc.returncode} (log: {log})")
                with contextlib.suppress(Exception):
                    if (await kv.get(node)).value:
                        return
                await asyncio.sleep(0.05)  # polling the agent's first heartbeat, bounded by the timeout above
    finally:
        await nc.close()


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@contextlib.asynccontextmanager
async def embedded_stack(workdir: Path, node_id: str) -> AsyncIterator[Stack]:
    """Start everything, yield, stop everything (also when the body fails)."""
    server = NatsServer(workdir / "nats")
    url = await server.astart()
    failed: Exception | None = None
    try:
        orch = Orchestrator(OrchestratorConfig(nats_url=url))
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(orch.run(), name="demo-orchestrator")
            try:
                ready = tg.create_task(orch.ready.wait())
                try:
                    async with asyncio.timeout(READY_TIMEOUT_S):
                        await asyncio.wait({run, ready}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    ready.cancel()
                if run.done():
                    raise RuntimeError("the orchestrator stopped before it was ready")
                log = workdir / "agent.log"
                env = dict(os.environ, TIMESLICE_LOG_LEVEL="warning")
                f = await asyncio.to_thread(open, log, "ab")
                try:
                    agent = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "timeslice_agent", "--node-id", node_id, "--nats-url", url,
                        stdin=asyncio.subprocess.DEVNULL, stdout=f, stderr=asyncio.subprocess.STDOUT, env=env)
                finally:
                    f.close()
                try:
                    await _agent_announced(url, node_id, agent, log)
                    yield Stack(url, node_id, orch)
                except Exception as exc:  # the body's own error: raised as it is, not in the group's wrapper
                    failed = exc
                finally:
                    await _stop(agent)
            finally:
                orch.shutdown()
    finally:
        await server.astop()
    if failed is not None:
        raise failed
