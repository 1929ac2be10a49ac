"""One RL job of trace_replay.py's ``real`` mode: follows its schedule through the real stack, time-compressed.

The job uses the client library as a training loop would: ``AsyncTimeSliceClient.acquire()`` /
``release()`` around each accelerator phase, and it registers with the node's agent
(``register_workload``) with a :class:`CallbackHandler` whose ``suspend``/``resume`` take the switch
profile's snapshot/restore time divided by the compression factor. So the orchestrator really drives
the agent, the agent really asks this process to move its state, and the modelled state move takes
its modelled (compressed) time inside the job's handler thread; nothing else is faked. Phases are
``asyncio.sleep`` of their compressed length. The job starts when the driver's go message arrives and
writes its log (modelled seconds from the go) as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from _common import go_future, loop_run, ready_then_go
from _trace_jobs import trace_job_parser
from _trace_model import load_profile, load_switch, schedule
from timeslice_client import AsyncTimeSliceClient
from timeslice_client.bus import connect
from timeslice_client.handlers import CallbackHandler, HandlerResult
from timeslice_client.protocol import SuspendMode


async def run(a: argparse.Namespace) -> dict[str, Any]:
    sched = schedule(load_profile(a.profile), a.steps, a.seed)
    sw = load_switch(a.switch)
    comp = float(a.compression)
    handler_s = {"suspend": 0.0, "resume": 0.0}

    def suspend(mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        t = time.perf_counter()
        time.sleep(sw.snapshot_s / comp)  # the modelled state move, compressed
        handler_s["suspend"] += time.perf_counter() - t
        return HandlerResult(bytes_moved=sw.bytes_per_job, device_bytes_freed=sw.bytes_per_job)

    def resume(mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        t = time.perf_counter()
        time.sleep(sw.restore_s / comp)
        handler_s["resume"] += time.perf_counter() - t
        return HandlerResult(bytes_moved=sw.bytes_per_job)

    log: list[tuple[str, float]] = []
    nc = await connect(a.url, name=f"trace-{a.job}")
    go = await go_future(nc)
    async with AsyncTimeSliceClient(a.job, a.group, a.url, lease_s=30, nc=nc) as client:
        await client.register_workload(CallbackHandler(suspend, resume), node_id=a.node)
        t0 = await ready_then_go(nc, go, a.ready, a.go_timeout)

        def now() -> float:
            return (time.monotonic() - t0) * comp

        for step in sched:
            for _, accel, seconds in step:
                if not accel:
                    await asyncio.sleep(seconds / comp)  # a CPU phase, compressed
                    continue
                log.append(("acquire", now()))
                await client.acquire(timeout=600)
                log.append(("grant", now()))
                await asyncio.sleep(seconds / comp)  # an accelerator phase, compressed
                log.append(("release", now()))
                await client.release()
        log.append(("end", now()))
    await nc.drain()
    return {"job": a.job, "log": log, "handler_s": handler_s}


def main() -> None:
    a = trace_job_parser(__doc__, "--group", "--node", "--switch").parse_args()
    Path(a.out).write_text(json.dumps(loop_run(run(a))))


if __name__ == "__main__":
    main()
