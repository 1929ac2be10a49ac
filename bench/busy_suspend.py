"""Suspend and resume of the torch handler while another thread of the job runs Python (GIL contention).

A job often scores rewards or prepares data in Python right after it yields the group, which is when its
suspend runs. CPython hands the GIL back to a thread that released it (every torch call does) only every
switch interval, 5 ms by default, while another thread runs Python. So a handler that makes a few torch
calls per tensor waits about that long per call.

Each condition below uses the same ``TorchOffloadHandler`` over ``--tensors`` tensors of ``--tensor-kib`` KiB
each (``--device cpu``, the default, or ``cuda``), called from a thread of its own as the workload channel calls
it. The conditions are:

* idle: the job's other thread sleeps. This is the baseline, measured in the same run;
* busy, per storage: a thread spins in Python, and the handler copies one storage at a time (its CUDA path,
  and its CPU path before batching). The interval is left at the default;
* busy, per storage, prompt: the same, inside ``prompt_threads(DEFAULT_SWITCH_INTERVAL)``, as the workload
  channel runs every command (0.1 ms): the CUDA path as it ships;
* busy, batched: every copy in one ``torch._foreach_copy_`` call, the handler's CPU path (on CUDA: that path
  tried on device tensors, synchronous copies). The interval is left at the default;
* busy, batched, prompt: the same with the channel's interval: the CPU path as it ships.

Each condition prints the suspend and resume medians of ``--reps`` cycles, and the ratio to idle.

Then the channel itself: a job process registers a do-nothing handler with a node agent (a private
nats-server, the agent in this process), and this process sends it ``--requests`` suspend/resume commands
as the agent does, 20 ms apart, timing each round trip. Conditions: idle; busy with the interval left alone
(``switch_interval_s=None``); busy with the interval lowered only while a command runs; busy with the channel
armed as the client arms it at every release (``WorkloadChannel.arm()``, so the interval is already low
when the command is read). Baseline: idle, same run.

Run: ``python bench/busy_suspend.py [--device cpu|cuda] [--tensors 300] [--tensor-kib 256] [--reps 3]
[--requests 30] [--quick] [--json-out F]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import _common as c

CONDITIONS = ("idle", "busy, per storage", "busy, per storage, prompt", "busy, batched", "busy, batched, prompt")


def _in_thread(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes in a thread of its own (as the workload channel runs a handler)."""
    out: dict[str, float] = {}

    def run() -> None:
        t0 = time.perf_counter()
        fn()
        out["s"] = time.perf_counter() - t0

    w = threading.Thread(target=run)
    w.start()
    w.join()
    return out["s"]


def measure(tensors: int, tensor_kib: int, reps: int, device: str = "cpu") -> dict[str, Any]:
    import torch
    from timeslice_client import SuspendMode
    from timeslice_client._switch_interval import DEFAULT_SWITCH_INTERVAL, prompt_threads
    from timeslice_client.torch_offload import TorchOffloadHandler

    per = tensor_kib * 1024 // 4
    state = [torch.full((per,), float(i), device=device) for i in range(tensors)]
    handler = TorchOffloadHandler(tensors={"state": state}, device=device)
    handler.prepare()
    all_tags: frozenset[str] = frozenset()
    out: dict[str, Any] = {}
    for name in CONDITIONS:
        # Idle: the path that ships for the device (batched on CPU only); the others as named.
        handler._batched = device == "cpu" if name == "idle" else "batched" in name
        prompt = prompt_threads(DEFAULT_SWITCH_INTERVAL if name.endswith("prompt") else None)
        sus: list[float] = []
        res: list[float] = []
        with c.python_spinning(name != "idle") as spin, prompt:
            for _ in range(reps):
                sus.append(_in_thread(lambda: handler.suspend(SuspendMode.OFFLOAD, all_tags)))
                res.append(_in_thread(lambda: handler.resume(SuspendMode.OFFLOAD, all_tags)))
        out[name] = {
            "suspend_ms": statistics.median(sus) * 1e3,
            "resume_ms": statistics.median(res) * 1e3,
            "suspend_all_ms": [x * 1e3 for x in sus],
            "resume_all_ms": [x * 1e3 for x in res],
            "spinner_cpu_share": spin.cpu_share,
        }
    for i, t in enumerate(state):
        if float(t[0]) != float(i) or float(t[-1]) != float(i):
            raise SystemExit(f"tensor {i} came back wrong")
    idle = out["idle"]
    for r in out.values():
        r["suspend_x_idle"] = r["suspend_ms"] / idle["suspend_ms"]
        r["resume_x_idle"] = r["resume_ms"] / idle["resume_ms"]
    return {
        "device": device,
        "tensors": tensors,
        "tensor_kib": tensor_kib,
        "reps": reps,
        "mb": tensors * tensor_kib * 1024 / 1e6,
        "torch": torch.__version__,
        "switch_interval_default_s": sys.getswitchinterval(),
        "prompt_interval_s": DEFAULT_SWITCH_INTERVAL,
        "conditions": out,
    }


CHANNEL_CONDITIONS = ("idle", "busy, left alone", "busy, lowered per command", "busy, armed")


async def _job(url: str, busy: bool, condition: str) -> None:
    """A job process: a do-nothing handler behind the workload channel, a thread spinning in Python if ``busy``."""
    from timeslice_client import HandlerResult
    from timeslice_client._switch_interval import DEFAULT_SWITCH_INTERVAL
    from timeslice_client.workload import register_workload

    class Nothing:
        def suspend(self, mode: Any, tags: frozenset[str]) -> HandlerResult:
            return HandlerResult()

        def resume(self, mode: Any, tags: frozenset[str]) -> HandlerResult:
            return HandlerResult()

    interval = None if condition == "busy, left alone" else DEFAULT_SWITCH_INTERVAL
    channel = await register_workload(
        "busy-job", "busy-group", Nothing(), node_id="busy-node", nats_url=url, switch_interval_s=interval
    )
    with c.python_spinning(busy):
        print("ready", flush=True)
        while True:  # until killed
            if condition == "busy, armed":
                channel.arm()  # as AsyncTimeSliceClient.release() does; the answer to the next command disarms
            await asyncio.sleep(0.005)


async def _channel(requests: int) -> dict[str, Any]:
    from timeslice_agent import Agent, AgentConfig
    from timeslice_client.bus import connect
    from timeslice_client.protocol import WorkloadCommand, encode, subjects
    from timeslice_orchestrator.embedded import NatsServer

    tmp = c.scratch_dir("ts-bench-busy-")
    server = NatsServer(tmp / "nats")
    url = server.start()
    agent = Agent(AgentConfig(node_id="busy-node", nats_url=url))
    out: dict[str, Any] = {}
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(agent.run())
            async with asyncio.timeout(30):
                await agent.ready.wait()
            nc = await connect(url)
            try:
                for condition in CHANNEL_CONDITIONS:
                    busy = condition != "idle"
                    proc = subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            "--role",
                            "job",
                            "--url",
                            url,
                            "--condition",
                            condition,
                            *(["--busy"] if busy else []),
                        ],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    try:
                        async with asyncio.timeout(60):
                            line = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
                        if line.strip() != "ready":
                            raise RuntimeError(f"the job process did not start ({proc.poll()})")
                        rts = []
                        for i in range(requests):
                            cmd = WorkloadCommand(
                                op_id=f"{condition}-{i}", action="resume" if i % 2 else "suspend", epoch=1
                            )
                            t0 = time.perf_counter()
                            await nc.request(subjects.workload_rpc("busy-node", "busy-job"), encode(cmd), timeout=10)
                            rts.append((time.perf_counter() - t0) * 1e3)
                            await asyncio.sleep(0.02)
                    finally:
                        proc.kill()
                        proc.wait(10)
                    out[condition] = {"p50_ms": statistics.median(rts), "p90_ms": c.pct(rts, 90), "max_ms": max(rts)}
            finally:
                await nc.close()
                agent.shutdown()
    finally:
        server.stop()
        c.remove_dir(tmp)
    for r in out.values():
        r["x_idle"] = r["p50_ms"] / out["idle"]["p50_ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=300, help="tensors in the job's state")
    p.add_argument("--tensor-kib", type=int, default=256, help="KiB per tensor")
    p.add_argument("--reps", type=int, default=3, help="suspend+resume cycles per condition")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the job's tensors live")
    p.add_argument("--requests", type=int, default=30, help="commands per condition through the channel")
    p.add_argument("--quick", action="store_true", help="100 tensors, 2 reps, 10 requests")
    p.add_argument("--json-out", help="also write the figures as JSON here")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--condition", help=argparse.SUPPRESS)
    p.add_argument("--busy", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "job":
        asyncio.run(_job(a.url, a.busy, a.condition))
        return
    if a.quick:
        a.tensors, a.reps, a.requests = 100, 2, 10
    t0 = time.monotonic()
    r = measure(a.tensors, a.tensor_kib, a.reps, a.device)
    r["channel"] = asyncio.run(_channel(a.requests))
    print(
        f"torch handler beside a thread running Python: {r['tensors']} {r['device']} tensors x {r['tensor_kib']} KiB "
        f"({r['mb']:.0f} MB), {r['reps']} cycles per condition, medians; torch {r['torch']}"
    )
    print(f"  command: {c.command_line()}")
    print(
        f"  GIL switch interval {r['switch_interval_default_s'] * 1e3:g} ms, the channel's "
        f"{r['prompt_interval_s'] * 1e3:g} ms"
    )
    for name, x in r["conditions"].items():
        print(
            f"  {name:26s} suspend {x['suspend_ms']:8.1f} ms ({x['suspend_x_idle']:6.1f}x idle)   "
            f"resume {x['resume_ms']:8.1f} ms ({x['resume_x_idle']:6.1f}x idle)"
            + (f"   busy thread ran {x['spinner_cpu_share']:.0%} of the time" if name != "idle" else "")
        )
    print(
        f"  the workload channel, {a.requests} commands per condition (a do-nothing handler in a job process), "
        "round trip from this process:"
    )
    for name, x in r["channel"].items():
        print(
            f"  {name:26s} p50 {x['p50_ms']:6.2f} ms ({x['x_idle']:5.1f}x idle), p90 {x['p90_ms']:6.2f} ms, "
            f"max {x['max_ms']:6.2f} ms"
        )
    r["wall_s"] = time.monotonic() - t0
    print(f"wall time {r['wall_s']:.0f} s")
    if a.json_out:
        c.write_json(
            a.json_out, {"bench": "busy_suspend", "command": c.command_line(), "machine": c.machine_facts(), **r}
        )


if __name__ == "__main__":
    main()
