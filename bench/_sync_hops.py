"""Where a blocking ``TimeSliceClient`` call spends its time: the hops between the caller's thread and the loop.

A probe, not a figure of record (``bench/handoff.py`` has the sync rows). One job alone re-acquires and releases
a group (each acquire a claim, as P2), through:

* ``async``: ``AsyncTimeSliceClient`` on uvloop, the call's own time (the reference);
* ``sync``: ``TimeSliceClient`` as it is now;
* ``shared loop``: the same calls through ``_shared_loop.SharedLoop`` (what ``TimeSliceClient`` runs on: the calling
  thread runs the loop for the call), each part timed apart: call -> the coroutine starts, the coroutine itself (its
  I/O), its end -> the call returns;

and for the loop-thread facade of before (``Responder``, a call submitted to a loop thread and its caller blocked
on a concurrent future), each hop timed apart: submit -> the coroutine starts on the loop thread, the coroutine
itself (its I/O), its end -> the caller wakes; on asyncio's loop (``fast=False``, what ``TimeSliceClient`` used) and on
uvloop (``fast=True``).

Run: ``python bench/_sync_hops.py [--n 1000] [--gap-ms 2]``; prints medians (µs) per row.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import _common


def _med(xs: list[float]) -> float:
    return _common.pct(xs, 50)


def _async_rows(url: str, n: int, gap: float) -> dict[str, list[float]]:
    from timeslice_client import AsyncTimeSliceClient

    async def main() -> list[tuple[int, int]]:
        async with AsyncTimeSliceClient("hops-async", "hops-async", url) as c:
            return await _common.timed_cycles(c, n, gap, hold=gap)

    return _us_rows(_common.loop_run(main()))


def _us_rows(cycles: list[tuple[int, int]]) -> dict[str, list[float]]:
    """Cycles timed in ns as the table's rows: each call's times in µs."""
    return {"acquire": [a / 1e3 for a, _ in cycles], "release": [r / 1e3 for _, r in cycles]}


def _responder_rows(url: str, n: int, gap: float, fast: bool | None) -> dict[str, list[float]]:
    """Each hop timed: call -> the coroutine starts, the coroutine, its end -> the caller has the outcome. ``fast``:
    the loop-thread facade of before on uvloop (True) or asyncio's loop (False); None: the shared loop."""
    from timeslice_client import AsyncTimeSliceClient
    from timeslice_client._channel_thread import Responder
    from timeslice_client._shared_loop import SharedLoop

    rows: dict[str, list[float]] = {}
    marks: dict[str, int] = {}

    async def timed(coro: Coroutine[Any, Any, Any]) -> Any:
        marks["start"] = time.perf_counter_ns()
        try:
            return await coro
        finally:
            marks["end"] = time.perf_counter_ns()

    if fast is None:
        shared = SharedLoop("hops")
        shared.start()

        def run(coro: Coroutine[Any, Any, Any]) -> Any:
            return shared.run(coro, 30)

        def stop() -> None:
            shared.stop(10)
    else:
        r = Responder("hops", fast=fast)
        r.start()

        def run(coro: Coroutine[Any, Any, Any]) -> Any:
            fut = r.submit(coro)
            concurrent.futures.wait([fut], 30)
            return fut.result()

        def stop() -> None:
            r.stop_blocking(10)

    def call(coro: Coroutine[Any, Any, Any], what: str | None) -> Any:
        t0 = time.perf_counter_ns()
        out = run(timed(coro))
        t3 = time.perf_counter_ns()
        if what is not None:
            for key, v in (
                ("call->start", marks["start"] - t0),
                ("coroutine", marks["end"] - marks["start"]),
                ("end->caller", t3 - marks["end"]),
                ("total", t3 - t0),
            ):
                rows.setdefault(f"{what} {key}", []).append(v / 1e3)
        return out

    name = "shared" if fast is None else str(int(fast))
    c = AsyncTimeSliceClient(f"hops-{name}", f"hops-{name}", url)
    try:
        call(c.connect(), None)
        call(c.acquire(timeout=30), None)
        call(c.release(), None)
        for _ in range(n):
            time.sleep(gap)
            call(c.acquire(timeout=30), "acquire")
            time.sleep(gap)
            call(c.release(), "release")
    finally:
        call(c.close(), None)
        stop()
    return rows


def _sync_rows(url: str, n: int, gap: float) -> dict[str, list[float]]:
    from timeslice_client import TimeSliceClient

    with TimeSliceClient("hops-sync", "hops-sync", url) as c:
        return _us_rows(_common.blocking_timed_cycles(c, n, gap, hold=gap))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--gap-ms", type=float, default=2.0)
    a = p.parse_args()
    from timeslice_orchestrator.embedded import NatsServer

    tmp = Path(tempfile.mkdtemp(prefix="ts-hops-"))
    server = NatsServer(tmp / "nats")
    url = server.start()
    env = dict(os.environ, TIMESLICE_LOG_LEVEL="warning")
    orch = subprocess.Popen(
        [sys.executable, "-m", "timeslice_orchestrator", "orchestrator", "--nats-url", url, "--grpc-port", "0"], env=env
    )
    gap = a.gap_ms / 1000
    try:
        time.sleep(2)  # a probe: the orchestrator's start; the first calls wait for it anyway (acquire timeout)
        print(f"load {os.getloadavg()[0]:.2f}, n={a.n}, gap {a.gap_ms} ms; medians in µs")
        for name, rows in (
            ("async (uvloop)", _async_rows(url, a.n, gap)),
            ("sync TimeSliceClient", _sync_rows(url, a.n, gap)),
            ("shared loop (TimeSliceClient's)", _responder_rows(url, a.n, gap, fast=None)),
            ("loop thread, asyncio loop", _responder_rows(url, a.n, gap, fast=False)),
            ("loop thread, uvloop", _responder_rows(url, a.n, gap, fast=True)),
        ):
            cut = a.n // 10
            print(f"{name}: " + ", ".join(f"{k} {_med(v[cut:]):.0f}" for k, v in rows.items()))
    finally:
        orch.terminate()
        orch.wait(10)
        server.stop()


if __name__ == "__main__":
    main()
