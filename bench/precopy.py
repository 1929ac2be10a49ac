"""Pre-copy while idle (issue 27, item 2): what a switch costs the incoming job when the outgoing job's state was
copied to host memory while it sat idle, against the same switch without that copy, in one run.

A private nats-server, the orchestrator, and a node agent per order as a process of its own: ``in-order`` (the agent
with ``--no-overlap-restores``: a node without room for both contexts, so the switch runs snapshot, restore, grant)
and ``room`` (the agent's default where both contexts fit: the incoming restore runs beside the snapshot and the
grant comes on it, so the snapshot is off B's critical path but still shares the machine with it). Two jobs in this
driver process, each a client with a ``TorchOffloadHandler`` registered through the workload
channel: job A holds ``--gib`` GiB of tensors, job B 8 MiB. Per cycle: A acquires (its state comes back when it was
switched out), holds ``--hold-ms``, releases with nobody waiting (its state stays on the device: the orchestrator
defers the snapshot), stays idle ``--idle-ms`` (and, pre-copying, until its copy is done), then B acquires: the
switch moves A's state out and B's in, and B's ``acquire()`` returns. Timed: B's acquire (the switch on B's
critical path) and A's snapshot as the handler ran it. Per order, two variants of the same cycles: ``precopy``
(A's channel with ``precopy="always"``: the snapshot only frees memory) and ``copy`` (``"never"``: the baseline,
today's path). On CPU (no GPU here) the "device" is host memory and both copies are memcpy; the figures that matter
come from ``--device cuda``.

Run: ``python bench/precopy.py [--gib 1] [--cycles 7] [--idle-ms 1500] [--device cpu|cuda] [--json-out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import _common as c

NODE = "precopy-node"
GROUP = "precopy"
VARIANTS = ("copy", "precopy")  # the baseline first
ORDERS = ("in-order", "room")


def _tensors(torch: Any, nbytes: int, device: str) -> list[Any]:
    n = max(1, nbytes // (64 << 20))  # 64 MiB tensors, as a model's larger parameters
    per = nbytes // n // 4
    return [torch.randn(per, device=device) for _ in range(n)]


async def _cycles(url: str, node: str, variant: str, a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from timeslice_client import AsyncTimeSliceClient
    from timeslice_client.torch_offload import TorchOffloadHandler

    state = _tensors(torch, int(a.gib * (1 << 30)), a.device)
    ha = TorchOffloadHandler(tensors={"state": state}, device=a.device)
    hb = TorchOffloadHandler(tensors={"state": _tensors(torch, 8 << 20, a.device)}, device=a.device)
    ha.prepare()
    hb.prepare()
    group = f"{GROUP}-{node}-{variant}"
    switch_ms: list[float] = []
    precopy_ms: list[float] = []
    async with (
        AsyncTimeSliceClient(f"a-{variant}", group, url) as ja,
        AsyncTimeSliceClient(f"b-{variant}", group, url) as jb,
    ):
        cha = await ja.register_workload(ha, node_id=node, precopy="always" if variant == "precopy" else "never")
        await jb.register_workload(hb, node_id=node, precopy="never")
        for cycle in range(a.cycles + 1):  # the first cycle warms up (first allocations, first switch)
            await ja.acquire(timeout=120)
            await asyncio.sleep(a.hold_ms / 1000)
            before = cha.precopies
            released = time.perf_counter()
            await ja.release()
            idle_until = released + a.idle_ms / 1000
            while variant == "precopy" and cha.precopies == before:
                if time.perf_counter() > released + 120:
                    raise SystemExit("the precopy did not end within 120 s")
                await asyncio.sleep(0.005)
            copied = time.perf_counter() - released
            await c.sleep_until(idle_until)
            t0 = time.perf_counter()
            await jb.acquire(timeout=120)
            took = time.perf_counter() - t0
            await jb.release()
            if cycle:
                switch_ms.append(took * 1000)
                if variant == "precopy":
                    precopy_ms.append(copied * 1000)
        if variant == "precopy" and ha.precopied_suspends < a.cycles:
            raise SystemExit(f"only {ha.precopied_suspends} of {a.cycles} switches used the precopy")
    return {
        "switch_ms": switch_ms,
        "switch_p50_ms": statistics.median(switch_ms),
        "precopy_p50_ms": statistics.median(precopy_ms) if precopy_ms else None,
        "precopied_suspends": ha.precopied_suspends,
    }


async def _run(url: str, a: argparse.Namespace) -> dict[str, Any]:
    orders: dict[str, dict[str, Any]] = {}
    for order in ORDERS:
        out = {variant: await _cycles(url, f"{NODE}-{order}", variant, a) for variant in VARIANTS}
        base = out["copy"]["switch_p50_ms"]
        orders[order] = {"variants": out, "precopy_vs_copy": out["precopy"]["switch_p50_ms"] / base if base else None}
    return {
        "device": a.device,
        "gib": a.gib,
        "cycles": a.cycles,
        "idle_ms": a.idle_ms,
        "hold_ms": a.hold_ms,
        "orders": orders,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="GiB of state in job A")
    p.add_argument("--cycles", type=int, default=7, help="timed cycles per variant (after one warm-up cycle)")
    p.add_argument("--hold-ms", type=float, default=100.0, help="how long A holds before its release")
    p.add_argument("--idle-ms", type=float, default=1500.0, help="A's idle time between its release and B's acquire")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 3 cycles, 400 ms idle")
    p.add_argument("--json-out", help="write the figures as JSON here")
    a = p.parse_args()
    if a.quick:
        a.gib, a.cycles, a.idle_ms = min(a.gib, 0.25), min(a.cycles, 3), min(a.idle_ms, 400.0)
    if a.gib <= 0 or a.cycles < 1 or a.idle_ms < 0 or a.hold_ms < 0:
        p.error("--gib and --cycles must be positive, --idle-ms and --hold-ms at least 0")
    import torch

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    machine = c.machine_facts()
    from timeslice_orchestrator.embedded import NatsServer

    tmp = c.scratch_dir("ts-bench-precopy-")
    server = NatsServer(Path(tmp) / "nats")
    procs: list[subprocess.Popen[bytes]] = []
    orchestrator: c.Orchestrator | None = None
    try:
        url = server.start(timeout=15)
        orchestrator = c.Orchestrator(url, Path(tmp) / "orchestrator.log")
        orchestrator.start()
        for order in ORDERS:
            flags = ["--no-overlap-restores"] if order == "in-order" else []
            procs.append(c.start_agent(url, f"{NODE}-{order}", Path(tmp) / f"agent-{order}.log", *flags))
        for order in ORDERS:
            asyncio.run(c.wait_agent(url, f"{NODE}-{order}", 60))
        r = asyncio.run(_run(url, a))
    finally:
        c.stop_procs(procs)
        if orchestrator is not None:
            orchestrator.stop()
        server.stop(timeout=10)
        c.remove_dir(tmp)
    print(
        f"precopy: {a.gib:g} GiB in job A on {a.device}, {a.cycles} cycles per variant, idle {a.idle_ms:g} ms between "
        f"A's release and B's acquire (load {machine['loadavg_1m']:.2f})"
    )
    print(f"  command: {c.command_line()}")
    for order, o in r["orders"].items():
        v = o["variants"]
        print(f"  {order}: B's acquire (the switch out of A and into B), median:")
        print(f"    copy at the switch (baseline)   {v['copy']['switch_p50_ms']:8.1f} ms")
        print(
            f"    precopied while A was idle      {v['precopy']['switch_p50_ms']:8.1f} ms  "
            f"({o['precopy_vs_copy']:.2f}x the baseline; A's precopy took {v['precopy']['precopy_p50_ms']:.1f} ms, "
            f"used by {v['precopy']['precopied_suspends']} snapshots)"
        )
    c.write_result(a.json_out, "precopy", machine, r)


if __name__ == "__main__":
    main()
