"""What binding a job's process to its node's agent adds to its first acquire (``bind_process``, on by default).

One nats-server, the orchestrator and an agent in this process (its socket in a scratch dir; default backend
``noop``, so every bind registers the job, the path a ``cuda`` node takes without touching a GPU). Each trial is a
fresh client in a fresh group: connect, first acquire, release, close; trials alternate bind on and off, so both
see the same machine. Prints the first acquire's p50/p95 each way and the ratio (baseline: bind off, same run)::

    python bench/bind_cost.py [--trials 40] [--quick] [--json-out FILE]
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as c


async def run(trials: int) -> dict[str, Any]:
    from timeslice_agent import Agent, AgentConfig
    from timeslice_client import AsyncTimeSliceClient
    from timeslice_orchestrator.embedded import NatsServer
    from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

    tmp = Path(tempfile.mkdtemp(prefix="ts-bind-", dir="/tmp"))
    os.environ["TIMESLICE_AGENT_SOCKET"] = str(tmp / "agent-{node}.sock")
    server = NatsServer(tmp / "nats")
    url = await server.astart()
    orch = Orchestrator(OrchestratorConfig(nats_url=url))
    agent = Agent(AgentConfig(node_id="n-bench", nats_url=url, default_backend="noop"))
    first: dict[bool, list[float]] = {True: [], False: []}
    bound = 0
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(orch.run())
            tg.create_task(agent.run())
            await asyncio.wait_for(orch.ready.wait(), 30)
            await asyncio.wait_for(agent.ready.wait(), 30)
            for i in range(trials * 2):
                bind = i % 2 == 0
                async with AsyncTimeSliceClient(f"j{i}", f"g{i}", url, bind_process=bind, node_id="n-bench") as cl:
                    t0 = time.perf_counter()
                    await cl.acquire(timeout=30)
                    first[bind].append((time.perf_counter() - t0) * 1000)
                    bound += bool(cl._binding and cl._binding.backends)
                    await cl.release()
            orch.shutdown()
            agent.shutdown()
    finally:
        server.stop()
        c.remove_dir(tmp)
    on, off = sorted(first[True]), sorted(first[False])
    return {
        "command": c.command_line(),
        "machine": c.machine_facts(),
        "trials": trials,
        "bound": bound,
        "first_acquire_ms": {
            "bind": {"p50": c.pct(on, 50), "p95": c.pct(on, 95)},
            "no_bind": {"p50": c.pct(off, 50), "p95": c.pct(off, 95)},
        },
        "ratio_p50": c.pct(on, 50) / c.pct(off, 50),
    }


def main() -> None:
    trials, json_out = c.trials_args(__doc__, trials=40, quick=5)
    r = asyncio.run(run(trials))
    f = r["first_acquire_ms"]
    print(
        f"first acquire, {r['trials']} trials each (bound: {r['bound']}): "
        f"bind p50 {f['bind']['p50']:.2f} ms p95 {f['bind']['p95']:.2f} ms; "
        f"no bind p50 {f['no_bind']['p50']:.2f} ms p95 {f['no_bind']['p95']:.2f} ms; "
        f"ratio p50 {r['ratio_p50']:.2f}x (baseline: bind off, same run)"
    )
    c.write_json(json_out, r)


if __name__ == "__main__":
    main()
