"""One job of trace_replay.py's real mode for a multi-pool profile: follows its schedule over the pools through the real
stack, time-compressed.

One ``AsyncTimeSliceClient`` per pool (the job's id, the pool's group, one NATS connection), each registered with the
agent of its pool's node (``register_workload``) with a handler whose suspend/resume (and pre-copy, ``--precopy``)
take the cost model's snapshot/restore time for that pool divided by the compression factor; ``bind_process`` off
(nothing here touches a process). At each phase boundary the job does what the simulation does
(``bench/_trace_pools.py``): releases the pools the next phase does not need (and any it holds above the first one it
lacks: the order rule of ``docs/multi-pool.md``, kept here by the job since its pools are separate clients), keeps the
rest held, and takes what it lacks one at a time in sorted order. A paced phase waits for the producer's next input
(made beside the job, one per drawn duration, at most the profile's staleness ahead). Phases are ``asyncio.sleep`` of
their compressed length. The job starts when the driver's go message arrives and writes, as JSON, its log per pool,
the handler's operations (modelled seconds from the go) and, per pool, how many of its releases named the job expected
next (``Released.ahead``: the group's predictive restore planned to bring that job's context back).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import go_future, loop_run, ready_then_go
from _trace_jobs import trace_job_parser
from _trace_model import load_profile, pool_schedule
from timeslice_client import AsyncTimeSliceClient
from timeslice_client.bus import connect
from timeslice_client.handlers import HandlerResult
from timeslice_client.protocol import SuspendMode


class _Modelled:
    """A pool's state as the cost model says it moves: a suspend takes the snapshot's time, a resume the restore's,
    compressed; ``precopy`` (while the job is idle) takes the snapshot's time too, in slices it can be cancelled
    between, and a suspend after a precopy nobody cancelled only frees. Each move is logged in ``ops`` (a precopy as
    ``precopy``: where a switch waits for one, that part counts as the snapshot on its critical path)."""

    def __init__(
        self,
        pool: str,
        snapshot_s: float,
        restore_s: float,
        comp: float,
        now: Callable[[], float],
        ops: list[tuple[str, str, float, float]],
        handler_s: dict[str, float],
        report_bytes: int,
    ) -> None:
        self.pool, self.snapshot_s, self.restore_s, self.comp = pool, snapshot_s, restore_s, comp
        self.now, self.ops, self.handler_s, self.report_bytes = now, ops, handler_s, report_bytes
        self.copied: threading.Event | None = None  # the cancel event of a precopy that ran to its end

    def _move(self, kind: str, seconds: float, stop: threading.Event | None = None) -> bool:
        """Sleep the compressed ``seconds`` (in slices of at most 2 ms when ``stop`` may cut it); whether it ended."""
        t, s = time.perf_counter(), self.now()
        end = t + seconds / self.comp
        while (left := end - time.perf_counter()) > 0:
            if stop is not None and stop.is_set():
                break
            time.sleep(min(left, 0.002) if stop is not None else left)
        self.ops.append((self.pool, kind, s, self.now()))
        self.handler_s["suspend" if kind in ("snapshot", "precopy") else "resume"] += time.perf_counter() - t
        return time.perf_counter() >= end

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        copied, self.copied = self.copied, None
        if copied is None or copied.is_set():
            self._move("snapshot", self.snapshot_s)
        return HandlerResult(bytes_moved=self.report_bytes, device_bytes_freed=self.report_bytes)

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        self._move("restore", self.restore_s)
        return HandlerResult(bytes_moved=self.report_bytes)

    def precopy(self, tags: frozenset[str], cancelled: threading.Event) -> HandlerResult:
        self.copied = None
        if self._move("precopy", self.snapshot_s, cancelled) and not cancelled.is_set():
            self.copied = cancelled
        return HandlerResult(bytes_moved=self.report_bytes)


async def run(a: argparse.Namespace) -> dict[str, Any]:
    prof = load_profile(a.profile)
    sched = pool_schedule(prof, a.steps, a.seed)
    costs = prof.costs[a.cost].pools
    comp = float(a.compression)
    t0 = 0.0

    def now() -> float:
        return (time.monotonic() - t0) * comp

    ops: list[tuple[str, str, float, float]] = []  # (pool, snapshot/restore, start, end), modelled seconds
    handler_s = {"suspend": 0.0, "resume": 0.0}

    def handler(pool: str) -> _Modelled:
        return _Modelled(pool, costs[pool].snapshot, costs[pool].restore, comp, now, ops, handler_s, a.report_bytes)

    logs: dict[str, list[tuple[str, float]]] = {p: [] for p in prof.pools}
    nc = await connect(a.url, name=f"trace-{a.job}")
    go = await go_future(nc)
    async with contextlib.AsyncExitStack() as stack:
        clients: dict[str, AsyncTimeSliceClient] = {}
        for pool in prof.pools:
            c = AsyncTimeSliceClient(a.job, f"{a.group_prefix}-{pool}", a.url, lease_s=30, nc=nc, bind_process=False)
            clients[pool] = await stack.enter_async_context(c)
            await c.register_workload(handler(pool), node_id=f"{a.node_prefix}-{pool}", precopy=a.precopy)
        t0 = await ready_then_go(nc, go, a.ready, a.go_timeout)

        held: set[str] = set()
        ahead = dict.fromkeys(prof.pools, 0)  # releases answered with the job expected next (the predictive restore)

        async def release(pool: str) -> None:
            logs[pool].append(("release", now()))
            held.discard(pool)
            if (await clients[pool].release()).ahead is not None:
                ahead[pool] += 1

        ready: list[float] = []
        taken: list[float] = []
        for step in sched:
            for _, pools, seconds, paced in step:
                need = set(pools)
                for p in sorted(held, reverse=True):
                    if p not in need:
                        await release(p)
                missing = sorted(need - held)
                if missing:  # the order rule: hold only pools below the first one to wait for
                    for p in sorted(held, reverse=True):
                        if p > missing[0]:
                            await release(p)
                    missing = sorted(need - held)
                for p in missing:
                    logs[p].append(("acquire", now()))
                    await clients[p].acquire(timeout=600)
                    logs[p].append(("grant", now()))
                    held.add(p)
                wait = seconds
                if paced:  # the producer's next input: after the previous one, and the one `staleness` before taken
                    k = len(ready)
                    after = taken[k - 1 - prof.staleness] if k > prof.staleness else 0.0
                    ready.append(max(ready[-1] if ready else 0.0, after) + seconds)
                    wait = max(0.0, ready[-1] - now())
                    taken.append(now() + wait)
                await asyncio.sleep(wait / comp)  # the phase (on its pools, or off them), compressed
        for p in sorted(held, reverse=True):
            await release(p)
        end = now()
        for log in logs.values():
            log.append(("end", end))
    await nc.drain()
    return {"job": a.job, "logs": logs, "ops": ops, "handler_s": handler_s, "ahead": ahead}


def main() -> None:
    p = trace_job_parser(__doc__, "--group-prefix", "--node-prefix", "--cost")
    p.add_argument("--report-bytes", type=int, default=1 << 20, help="the bytes the handler says it moved")
    p.add_argument("--precopy", choices=("auto", "always", "never"), default="never", help="the channels' pre-copy")
    a = p.parse_args()
    Path(a.out).write_text(json.dumps(loop_run(run(a))))


if __name__ == "__main__":
    main()
