"""Leader election failover (``timeslice_orchestrator._leadership``): takeover after kill -9, handover on resign.

On a private nats-server:

1. ``--kills`` times: a leader runs as its own process (``python -c``, one ``Leadership``); once it leads, a
   standby starts in this process and sees its record; after a random pause in ``[0, renew_s)`` (the kill
   lands anywhere between two renewals) the leader gets SIGKILL. Takeover = SIGKILL sent -> the standby's
   ``is_leader()`` is true. It is bounded by the TTL: the record expires ``ttl_s`` after the last renewal
   the leader wrote, so takeover lies in about ``[ttl_s - renew_s, ttl_s]`` plus detection and one campaign.
   Also reported: "detect -> lead", the standby's own time from seeing the key gone to holding it.
2. ``--resigns`` times: in-process leader, fresh standby; ``resign()`` called -> the standby leads.
3. the cost of ``is_leader()`` (the hot-path check).

Run: ``python bench/leader_failover.py [--kills 20] [--resigns 50] [--ttl 1] [--renew 0.25]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import nats
from _common import ROOT, pct
from nats.aio.client import Client as NATS
from timeslice_orchestrator._leadership import Leadership
from timeslice_orchestrator.embedded import NatsServer

_LEADER = """
import asyncio, sys, nats
from timeslice_orchestrator._leadership import Leadership
async def main():
    nc = await nats.connect(sys.argv[1])
    lead = Leadership(nc.jetstream(), instance_id=sys.argv[2], ttl_s=int(sys.argv[3]), renew_s=float(sys.argv[4]))
    stop = asyncio.Event()
    async def report():
        print("leading", await lead.wait_leader(60), flush=True)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(lead.run(stop))
        tg.create_task(report())
asyncio.run(main())
"""


async def _quiet(exc: Exception) -> None:
    pass


def _summary(name: str, xs: list[float]) -> str:
    ms = [x * 1000 for x in xs]
    return f"{name}: n={len(ms)} p50={pct(ms, 50):.1f} ms p99={pct(ms, 99):.1f} ms min={min(ms):.1f} max={max(ms):.1f}"


class _Standby:
    def __init__(self, nc: NATS, name: str, a: argparse.Namespace) -> None:
        self.detect: list[float] = []
        self.lead = Leadership(
            nc.jetstream(),
            instance_id=name,
            ttl_s=a.ttl,
            renew_s=a.renew,
            metrics=lambda k, v: self.detect.append(v) if k == "takeover_s" else None,
        )
        self.stop = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self.lead.run(self.stop))

    async def seen_leader(self, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while self.lead.holder is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the standby never saw the leader's record")
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 5)


async def kills(url: str, a: argparse.Namespace) -> tuple[list[float], list[float]]:
    nc = await nats.connect(url, error_cb=_quiet)
    took: list[float] = []
    detect: list[float] = []
    try:
        for i in range(a.kills):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _LEADER,
                url,
                f"proc{i}",
                str(a.ttl),
                str(a.renew),
                stdout=asyncio.subprocess.PIPE,
                cwd=ROOT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
            try:
                assert proc.stdout is not None
                line = await asyncio.wait_for(proc.stdout.readline(), 30)
                assert line.startswith(b"leading"), line
                sb = _Standby(nc, f"standby{i}", a)
                try:
                    await sb.seen_leader()
                    await asyncio.sleep(random.uniform(0, a.renew))  # land the kill anywhere between renewals
                    t0 = time.monotonic()
                    os.kill(proc.pid, signal.SIGKILL)
                    await sb.lead.wait_leader(timeout=a.ttl + 5)
                    took.append(time.monotonic() - t0)
                    detect.extend(sb.detect)
                finally:
                    await sb.close()  # resigns: the next leader process gets the key at once
            finally:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
    finally:
        await nc.close()
    return took, detect


async def resigns(url: str, a: argparse.Namespace) -> list[float]:
    took: list[float] = []
    conns = [await nats.connect(url, error_cb=_quiet) for _ in range(2)]
    try:
        cur = _Standby(conns[0], "r0", a)
        await cur.lead.wait_leader(timeout=a.ttl + 5)
        for i in range(1, a.resigns + 1):
            nxt = _Standby(conns[i % 2], f"r{i}", a)
            await nxt.seen_leader()
            t0 = time.monotonic()
            await cur.lead.resign()
            await nxt.lead.wait_leader(timeout=a.ttl + 5)
            took.append(time.monotonic() - t0)
            await cur.close()
            cur = nxt
        await cur.close()
    finally:
        for c in conns:
            await c.close()
    return took


def is_leader_cost(a: argparse.Namespace) -> float:
    lead = Leadership(object(), ttl_s=a.ttl, renew_s=a.renew)  # type: ignore[arg-type]
    n = 1_000_000
    t0 = time.perf_counter()
    for _ in range(n):
        lead.is_leader()
    return (time.perf_counter() - t0) / n * 1e9


async def main(a: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as d, NatsServer(Path(d) / "nats") as server:
        print(f"ttl_s={a.ttl} renew_s={a.renew} margin_s=0.2 (defaults), nats-server on {server.url}")
        if a.kills:
            took, detect = await kills(server.url, a)
            print(_summary("takeover after kill -9 (SIGKILL -> standby leads)", took))
            if detect:
                print(_summary("  of which the standby's detect -> lead", detect))
        if a.resigns:
            print(_summary("handover on resign (resign() called -> standby leads)", await resigns(server.url, a)))
    print(f"is_leader(): {is_leader_cost(a):.0f} ns/call")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--resigns", type=int, default=50)
    p.add_argument("--ttl", type=int, default=1)
    p.add_argument("--renew", type=float, default=0.25)
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
