"""The job processes of ``bench/offload.py`` (``python bench/offload.py --role job ...``): job A holds the big state
behind the torch handler, job B a little; both register with the node agent, hand the group back and forth, and time
every handler call from inside the process. Each writes its timeline (CLOCK_MONOTONIC, ns) as JSON to ``--out``."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from _offload_baselines import N_TENSORS, PairedCopy

NODE = "bench"


# The KiB of free memory this guest has handed back to its host so far (virtio-balloon free page reporting), where
# the kernel exposes that count (some VM kernels do; upstream Linux does not). Memory handed back costs far more
# to touch again, and the reporting itself competes with a copy (bench/NOTES.md).
REPORTED_KIB = "/sys/module/page_reporting/parameters/reported_kib"


class _ReportedCounter:
    """Reads ``REPORTED_KIB`` in about 2 µs (one ``pread`` of a descriptor kept open); ``None`` without it."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open(REPORTED_KIB, os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> int | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 32, 0))
        except (OSError, ValueError):
            return None


class _Timed:
    """The handler the agent drives: the torch handler, each call timed inside this worker, with the guest's
    reported-memory count just before and after it (``None`` where the kernel has no such count)."""

    def __init__(self, inner: Any, calls: list[list[Any]]) -> None:
        self.inner = inner
        self.calls = calls
        self._lock = threading.Lock()
        self._reported = _ReportedCounter()

    def _call(self, kind: str, mode: Any, tags: frozenset[str]) -> Any:
        fn = self.inner.suspend if kind == "suspend" else self.inner.resume
        k0 = self._reported.read()
        t0 = time.monotonic_ns()
        r = fn(mode, tags)
        t1 = time.monotonic_ns()
        k1 = self._reported.read()
        with self._lock:
            self.calls.append([kind, t0, t1, r.bytes_moved, self.inner.device_bytes(), k0, k1])
        return r

    def suspend(self, mode: Any, tags: frozenset[str]) -> Any:
        return self._call("suspend", mode, tags)

    def resume(self, mode: Any, tags: frozenset[str]) -> Any:
        return self._call("resume", mode, tags)


def _state(nbytes: int, pieces: int, device: str) -> tuple[Any, list[Any]]:
    import torch

    per = nbytes // pieces // 4
    module = torch.nn.Module()
    module.params = torch.nn.ParameterList(
        torch.nn.Parameter(torch.full((per,), float(i + 1), device=device), requires_grad=False) for i in range(pieces)
    )
    return module, list(module.params)


def _check(tensors: list[Any], full: bool) -> str | None:
    """None when every tensor holds its value again (all elements when ``full``, else both ends)."""
    for i, t in enumerate(tensors):
        v = float(i + 1)
        if t.untyped_storage().nbytes() != t.numel() * 4:
            return f"tensor {i}: storage holds {t.untyped_storage().nbytes()} bytes"
        if full:
            if not all(bool((c == v).all()) for c in t.split(1 << 26)):
                return f"tensor {i}: wrong values after restore"
        elif float(t[0]) != v or float(t[-1]) != v:
            return f"tensor {i}: wrong values at its ends after restore"
    return None


async def _wait_waiter(c: Any) -> None:
    """Until another job waits in the queue (so a release starts a switch, not IDLE_YIELDED)."""
    deadline = time.monotonic() + 120
    while True:
        rec = await c.status()
        if any(w.job != c.job_id for w in rec.waiters):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("nobody queued behind this job")
        await asyncio.sleep(0.005)


async def run_job(
    url: str,
    group: str,
    job: str,
    nbytes: int,
    cycles: int,
    hold: float,
    out: str,
    ready: str,
    done: str,
    leader: bool,
    device: str,
    early: bool = True,
) -> None:
    """A (leader: the big state, holds first) or B (the small state); writes its timeline to ``out``.

    A writes ``done`` once it holds the group after the last switch; B closes (unregisters) only then:
    a workload that closes while the agent's suspend request is in flight never answers it."""
    from timeslice_client import AsyncTimeSliceClient
    from timeslice_client.torch_offload import TorchOffloadHandler

    module, tensors = _state(nbytes, N_TENSORS if leader else 1, device)
    inner = TorchOffloadHandler(module, device=device)
    prepared = inner.prepare()  # allocate and touch the host buffer now, not during the first offload
    paired = PairedCopy(tensors, device) if leader else None
    calls: list[list[Any]] = []
    rows: list[list[Any]] = []
    errors: list[str] = []

    async def grant(c: Any) -> Any:
        g = await c.acquire(timeout=300)
        rows.append(["grant", g.epoch, time.monotonic_ns(), g.context_restored])
        return g

    async def release(c: Any) -> None:
        if paired is not None:  # at the start of the hold: the idle gap before the release stays as it was
            await asyncio.to_thread(paired.run)
        await asyncio.sleep(hold)
        await _wait_waiter(c)
        rows.append(["release", c.epoch, time.monotonic_ns()])
        await c.release()

    async with AsyncTimeSliceClient(job, group, url, lease_s=60, acquire_timeout_s=300) as c:
        # Once, without retries: the agent is up (the driver saw it answer).
        await c.register_workload(_Timed(inner, calls), node_id=NODE, op_timeout_s=300, early_suspend=early)
        if leader:
            await grant(c)
        Path(ready).write_text("ok")
        for _ in range(cycles):
            if not leader:
                await grant(c)
            await release(c)
            if leader:
                if not (await grant(c)).context_restored:
                    errors.append("A was granted again without context_restored")
                if (bad := _check(tensors, full=False)) is not None:
                    errors.append(bad)
        if leader:
            Path(done).write_text("ok")
            if (bad := await asyncio.to_thread(_check, tensors, True)) is not None:
                errors.append(bad)
            await c.release()
        else:
            deadline = time.monotonic() + 300
            while not Path(done).exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
    Path(out).write_text(
        json.dumps(
            {
                "rows": rows,
                "calls": calls,
                "prepared": prepared,
                "errors": errors,
                "paired_copies": paired.spans if paired is not None else [],
                "device_bytes": inner.device_bytes(),
            }
        )
    )
