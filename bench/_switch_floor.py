"""The switch floor: the bus hops of an ``app_channel`` switch with no timeslice code in them.

A switch from job A to job B (restore beside the snapshot) passes these hops in sequence; no lock built on
this bus and this agent design can be faster than the same hops with nothing done at each one:

1. A publishes its release to a stream and waits for the stream's answer (as the client does);
2. an orchestrator stand-in, a push consumer of that subject, stores one command for the node's agent;
3. an agent stand-in, a push consumer of the commands, asks both workloads at once (core requests to A's and
   B's processes, answered at once: no handler, no thread);
4. with both answers, it publishes the result to the stream and waits for its answer;
5. the orchestrator stand-in, consuming the results, publishes the grant to a stored subject;
6. B receives it. Latency = A's release call → B's grant callback (CLOCK_MONOTONIC, one host).

Four processes (orchestrator and agent stand-ins, A and B) and the server, as in ``bench/offload.py
--agent-process``. ``colocated`` (the bench's default, as ``timeslice up`` runs the agent): the agent stand-in
runs in the orchestrator stand-in's process, which stores the command and goes on to step 3 itself, and
consumes its own result (three processes). Each switch is preceded by the same idle gap as the bench's hold.
Used by ``bench/offload.py``; private to ``bench/``. Run alone:
``python bench/_switch_floor.py --url nats://... [--n 60] [--gap-ms 200] [--colocated]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

STREAM = "BENCH_SWITCH_FLOOR"
RELEASE, CMD, RESULT, GRANT = (f"bench.swfloor.{s}" for s in ("release", "cmd", "result", "grant"))
GOT = "bench.swfloor_got"  # B tells A it has the grant (outside the stream and the timed window)


def _workload(who: str) -> str:
    return f"bench.swfloor_wl.{who}"


async def _ask_workloads(nc: Any) -> None:
    await asyncio.gather(
        nc.request(_workload("A"), b"suspend", timeout=10), nc.request(_workload("B"), b"resume", timeout=10)
    )


async def _orchestrator(url: str, ready: str, colocated: bool) -> None:
    from nats.js.api import StreamConfig
    from nats.js.errors import NotFoundError
    from timeslice_client.bus import connect

    nc = await connect(url)
    js = nc.jetstream()
    with contextlib.suppress(NotFoundError):
        await js.delete_stream(STREAM)  # from an earlier measurement on this server, with its consumers
    await js.add_stream(StreamConfig(name=STREAM, subjects=[RELEASE, CMD, RESULT, GRANT]))  # file storage

    async def on_release(msg: Any) -> None:
        await nc.publish(CMD, msg.data)
        await msg.ack()
        if colocated:
            await _ask_workloads(nc)
            await js.publish(RESULT, msg.data)

    async def on_result(msg: Any) -> None:
        await nc.publish(GRANT, msg.data)
        await msg.ack()

    await _common.push_consumer(nc, js, STREAM, "orchestrator", RELEASE, on_release)
    await _common.push_consumer(nc, js, STREAM, "results", RESULT, on_result)
    Path(ready).write_text("ok")
    await asyncio.Event().wait()


async def _agent(url: str, ready: str) -> None:
    from timeslice_client.bus import connect

    nc = await connect(url)
    js = nc.jetstream()

    async def on_cmd(msg: Any) -> None:
        await msg.ack()
        await _ask_workloads(nc)
        await js.publish(RESULT, msg.data)

    await _common.push_consumer(nc, js, STREAM, "agent", CMD, on_cmd)
    Path(ready).write_text("ok")
    await asyncio.Event().wait()


async def _job(url: str, ready: str, who: str, n: int, gap: float, out: str) -> None:
    from timeslice_client.bus import connect

    nc = await connect(url)
    js = nc.jetstream()

    async def answer(msg: Any) -> None:
        await msg.respond(b"ok")

    await nc.subscribe(_workload(who), cb=answer)
    rows: list[int] = []
    got: asyncio.Queue[None] = asyncio.Queue(maxsize=1)
    all_granted = asyncio.Event()
    if who == "B":

        async def on_grant(msg: Any) -> None:
            rows.append(time.monotonic_ns())
            await nc.publish(GOT, b"")
            if len(rows) >= n:
                all_granted.set()

        await nc.subscribe(GRANT, cb=on_grant)
    else:

        async def on_got(msg: Any) -> None:
            got.put_nowait(None)

        await nc.subscribe(GOT, cb=on_got)
    await asyncio.sleep(0)  # else flush() after subscribe() is no barrier (docs/nats.md)
    await nc.flush()
    Path(ready).write_text("ok")
    if who == "A":
        for _ in range(n):
            await asyncio.sleep(gap)  # the idle gap before each switch, as the bench's hold
            rows.append(time.monotonic_ns())
            await js.publish(RELEASE, b"release")
            async with asyncio.timeout(30):
                await got.get()
        Path(out).write_text(json.dumps(rows))
        return
    async with asyncio.timeout(60 + n * (gap + 30)):  # B: until A's last switch arrived
        await all_granted.wait()
    Path(out).write_text(json.dumps(rows))


def measure(url: str, n: int, gap_ms: float, colocated: bool = True) -> dict[str, Any]:
    """Run ``n`` floor switches against the server at ``url``; their latency percentiles in ms."""
    tmp = Path(tempfile.mkdtemp(prefix="ts-bench-swfloor-"))
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(*args: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, __file__, "--url", url, *args], cwd=_common.ROOT)
        procs.append(p)
        return p

    try:
        for role in ("orchestrator",) if colocated else ("orchestrator", "agent"):
            ready = tmp / f"{role}.ready"
            flags = ["--colocated"] if colocated else []
            _common.wait_file(ready, spawn("--role", role, "--ready", str(ready), *flags), 60, f"switch floor {role}")
        outs = {}
        jobs = []
        for who in ("B", "A"):
            ready, outs[who] = tmp / f"{who}.ready", tmp / f"{who}.json"
            p = spawn(
                "--role",
                "job",
                "--who",
                who,
                "--n",
                str(n),
                "--gap-ms",
                str(gap_ms),
                "--out",
                str(outs[who]),
                "--ready",
                str(ready),
            )
            _common.wait_file(ready, p, 60, f"switch floor job {who}")
            jobs.append(p)
        for p in jobs:
            p.wait(timeout=60 + n * (gap_ms / 1000 + 1))
            if p.returncode:
                raise RuntimeError(f"switch floor job exited with {p.returncode}")
        a, b = (json.loads(outs[w].read_text()) for w in ("A", "B"))
    finally:
        _common.stop_procs(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    lat = [(t1 - t0) / 1e6 for t0, t1 in zip(a, b, strict=True)][max(1, n // 10) :]  # the first switches warm up
    return {
        "n": len(lat),
        "gap_ms": gap_ms,
        "colocated": colocated,
        "p50_ms": _common.pct(lat, 50),
        "p90_ms": _common.pct(lat, 90),
        "p99_ms": _common.pct(lat, 99),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--n", type=int, default=60)
    p.add_argument("--gap-ms", type=float, default=200.0)
    p.add_argument("--colocated", action="store_true", help="the agent stand-in in the orchestrator stand-in's process")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--who", help=argparse.SUPPRESS)
    p.add_argument("--ready", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "orchestrator":
        _common.loop_run(_orchestrator(a.url, a.ready, a.colocated))
    elif a.role == "agent":
        _common.loop_run(_agent(a.url, a.ready))
    elif a.role == "job":
        _common.loop_run(_job(a.url, a.ready, a.who, a.n, a.gap_ms / 1000, a.out))
    else:
        print(json.dumps(measure(a.url, a.n, a.gap_ms, a.colocated)))


if __name__ == "__main__":
    main()
