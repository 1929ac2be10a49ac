"""The GPU check's offload section (section 2 of ``bench/gpu_check.py``: torch offload through the full stack,
nats-server, orchestrator, agent and two job processes) and the helpers its sections share.

Private to ``bench/``; ``gpu_check.py`` puts ``bench/`` and the project's packages on the path before importing
it, and runs this module's ``_job`` in the job processes (``gpu_check.py --role job``).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _common
from _gpu_report import GB
from _gpu_run import CLEANUP_S, DEFAULT_BUDGET_S, Budget, die_with_parent

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"  # the job processes run ``gpu_check.py --role job``
_PATHS = [str(ROOT / "libs"), str(ROOT / "services" / "orchestrator"), str(ROOT / "services" / "agent")]

NODE = "gpu-check"
N_TENSORS = 4
B_BYTES = 64 << 20
CHUNK = 1 << 28  # checksum chunk (bytes)


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _child_env() -> dict[str, str]:
    env = dict(os.environ, TIMESLICE_LOG_LEVEL="warning")
    env["PYTHONPATH"] = os.pathsep.join([*_PATHS, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


# --------------------------------------------------------------------------- in-GPU helpers


def _checksums(tensors: Sequence[Any]) -> list[int]:
    """Per-chunk int64 sums of every tensor's bytes viewed as int32 (position-sensitive at chunk level)."""
    import torch

    out: list[int] = []
    for t in tensors:
        flat = t.view(torch.int32).reshape(-1)
        out.extend(int(c.sum(dtype=torch.int64)) for c in flat.split(CHUNK // 4))
    return out


def _random_state(nbytes: int, pieces: int, device: str = "cuda") -> list[Any]:
    import torch

    per = nbytes // pieces // 4
    return [
        torch.empty(per, dtype=torch.int32, device=device).random_(-(1 << 31), (1 << 31) - 1) for _ in range(pieces)
    ]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _nvml_used(pid: int) -> int | None:
    """Device bytes NVML lists for ``pid`` (0 when not listed), None without NVML."""
    try:
        from timeslice_agent._nvml import gpu_source
    except ImportError:
        return None
    src = gpu_source()
    if src is None:
        return None
    return sum(p.used_bytes for p in src.processes() if p.pid == pid)


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- 2. offload through the stack


class _TimedHandler:
    """The torch handler, each call timed, with device memory (torch and NVML) after it."""

    def __init__(self, inner: Any, device: str) -> None:
        self.inner = inner
        self.device = device
        self.calls: list[dict[str, Any]] = []

    def allocated(self) -> int:
        """torch's allocated device bytes (CPU stand-in: the bytes the handler's tensors hold)."""
        import torch

        return int(torch.cuda.memory_allocated()) if self.device == "cuda" else self.inner.device_bytes()

    def _call(self, kind: str, mode: Any, tags: frozenset[str]) -> Any:
        fn = self.inner.suspend if kind == "suspend" else self.inner.resume
        t0 = time.perf_counter()
        r = fn(mode, tags)
        dt = time.perf_counter() - t0
        self.calls.append(
            {
                "kind": kind,
                "s": dt,
                "bytes": r.bytes_moved,
                "torch_allocated": self.allocated(),
                "nvml": _nvml_used(os.getpid()),
            }
        )
        return r

    def suspend(self, mode: Any, tags: frozenset[str]) -> Any:
        return self._call("suspend", mode, tags)

    def resume(self, mode: Any, tags: frozenset[str]) -> Any:
        return self._call("resume", mode, tags)


async def _wait_waiter(c: Any, budget: Budget) -> None:
    async with asyncio.timeout(budget.bound(120)):
        while not any(w.job != c.job_id for w in (await c.status()).waiters):
            await asyncio.sleep(0.005)


async def _job(
    url: str,
    group: str,
    job: str,
    nbytes: int,
    cycles: int,
    leader: bool,
    out: Path,
    ready: Path,
    done: Path,
    device: str,
    budget: Budget,
) -> None:
    """Job A (``leader``: the big state) or job B. A writes ``done`` when it holds the group for the last time.
    Every wait is cut to ``budget`` (what the check had left when it started the job)."""
    from timeslice_client import AsyncTimeSliceClient
    from timeslice_client.torch_offload import TorchOffloadHandler

    tensors = _random_state(nbytes, N_TENSORS if leader else 1, device)
    sums = _checksums(tensors) if leader else []
    ids = [id(t) for t in tensors]
    handler = _TimedHandler(TorchOffloadHandler(tensors={"state": tensors}, device=device), device)
    handler.inner.prepare()
    _sync(device)
    result: dict[str, Any] = {"torch_before": handler.allocated(), "nvml_before": _nvml_used(os.getpid())}
    switches: list[dict[str, Any]] = []
    b = budget.bound
    async with AsyncTimeSliceClient(job, group, url, lease_s=120, acquire_timeout_s=b(300)) as c:
        await c.register_workload(handler, node_id=NODE, op_timeout_s=b(300))
        if leader:
            await c.acquire(timeout=b(120))
        ready.write_text("ok")
        for _ in range(cycles):
            if not leader:
                await c.acquire(timeout=b(300))
            await _wait_waiter(c, budget)
            t0 = time.perf_counter()
            await c.release()
            if leader:
                g = await c.acquire(timeout=b(300))
                switches.append({"ba_s": time.perf_counter() - t0, "restored": g.context_restored})
        if leader:
            done.write_text("ok")
            _sync(device)
            result["bit_exact"] = _checksums(tensors) == sums
            result["same_tensors"] = [id(t) for t in tensors] == ids
            await c.release()
        else:
            async with asyncio.timeout(b(300)):
                while not done.exists():
                    await asyncio.sleep(0.01)
    result.update(calls=handler.calls, switches=switches)
    out.write_text(json.dumps(result))


class Stack:
    """nats-server (embedded) and the orchestrator with the node agent in its process, as ``timeslice up`` runs
    them; ``agent_process``: the agent as a process of its own (as on a node without the orchestrator). Its waits
    are cut to ``budget``; nats-server (a session of its own) ends with the check, also when the check is killed."""

    def __init__(self, tmp: Path, budget: Budget | None = None, *, agent_process: bool = False) -> None:
        from timeslice_orchestrator.embedded import NatsServer

        self.server = NatsServer(tmp / "nats", preexec=die_with_parent())
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tmp = tmp
        self.budget = budget or Budget(DEFAULT_BUDGET_S)
        self.agent_process = agent_process

    @property
    def services(self) -> tuple[str, ...]:
        """What the first processes of ``procs`` are, in order."""
        return ("orchestrator", "agent") if self.agent_process else ("orchestrator (with the agent)",)

    def start(self) -> str:
        url = self.server.start(timeout=self.budget.bound(15))
        env = _child_env()
        orchestrator = [sys.executable, "-m", "timeslice_orchestrator", "orchestrator", "--nats-url", url]
        if not self.agent_process:
            orchestrator += ["--with-agent", NODE]
        self.procs.append(subprocess.Popen(orchestrator, env=env, cwd=ROOT))
        if self.agent_process:
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "timeslice_agent", "--node-id", NODE, "--nats-url", url], env=env, cwd=ROOT
                )
            )
        self.url = url
        asyncio.run(_common.wait_agent(url, NODE, self.budget.bound(60), self.check))
        return url

    def check(self) -> None:
        """Raise when a service process has exited (a job would otherwise wait out its timeout)."""
        for name, p in zip(self.services, self.procs, strict=False):
            if p.poll() is not None:
                raise RuntimeError(f"the {name} process exited with {p.returncode} (its traceback is above)")

    def spawn(self, *args: str) -> subprocess.Popen[bytes]:
        """A job process (``gpu_check.py --role job``), its waits cut to what is left of the budget."""
        p = subprocess.Popen(
            [sys.executable, str(SCRIPT), *args, "--budget-s", f"{self.budget.bound(540):.1f}"],
            env=_child_env(),
            cwd=ROOT,
        )
        self.procs.append(p)
        return p

    def stop(self) -> None:
        """Terminate every process, kill those still running after ``CLEANUP_S / 2`` in all, then nats-server (at
        most ``CLEANUP_S / 2`` more)."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + CLEANUP_S / 2
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        self.server.stop(timeout=CLEANUP_S / 4)


def _wait_file(path: Path, proc: subprocess.Popen[bytes], timeout: float, stack: Stack) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        stack.check()
        if proc.poll() is not None:
            raise RuntimeError(f"worker {proc.args!r} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout:.0f} s")
        time.sleep(0.02)


def _wait_jobs(procs: Sequence[subprocess.Popen[bytes]], timeout: float, stack: Stack) -> None:
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        stack.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job processes did not finish within {timeout:.0f} s")
        time.sleep(0.05)
    for p in procs:
        if p.returncode:
            raise RuntimeError(f"job process exited with {p.returncode}")


def offload(stack: Stack, nbytes: int, cycles: int, index: int, device: str = "cuda") -> dict[str, Any]:
    tmp = stack.tmp
    group = f"gpu-check-{index}"
    files = {k: tmp / f"{index}-{k}" for k in ("a.json", "b.json", "a.ready", "b.ready", "a.done")}
    common = [
        "--url",
        stack.url,
        "--group",
        group,
        "--cycles",
        str(cycles),
        "--done",
        str(files["a.done"]),
        "--device",
        device,
    ]
    a = stack.spawn(
        "--role",
        "job",
        "--job",
        f"a{index}",
        "--bytes",
        str(nbytes),
        "--leader",
        "--out",
        str(files["a.json"]),
        "--ready",
        str(files["a.ready"]),
        *common,
    )
    _wait_file(files["a.ready"], a, stack.budget.bound(300), stack)
    b = stack.spawn(
        "--role",
        "job",
        "--job",
        f"b{index}",
        "--bytes",
        str(min(B_BYTES, nbytes)),
        "--out",
        str(files["b.json"]),
        "--ready",
        str(files["b.ready"]),
        *common,
    )
    _wait_jobs((a, b), stack.budget.bound(540), stack)
    ra = json.loads(files["a.json"].read_text())
    sus = [c for c in ra["calls"] if c["kind"] == "suspend"]
    res = [c for c in ra["calls"] if c["kind"] == "resume"]
    r: dict[str, Any] = {
        "bytes": nbytes,
        "cycles": cycles,
        "offload_gbps": nbytes / GB / _med([c["s"] for c in sus]) if sus else None,
        "restore_gbps": nbytes / GB / _med([c["s"] for c in res]) if res else None,
        "offload_s": [c["s"] for c in sus],
        "restore_s": [c["s"] for c in res],
        "torch_before": ra["torch_before"],
        "nvml_before": ra["nvml_before"],
        "torch_suspended": sus[-1]["torch_allocated"] if sus else None,
        "nvml_suspended": sus[-1]["nvml"] if sus else None,
        "torch_resumed": res[-1]["torch_allocated"] if res else None,
        "nvml_resumed": res[-1]["nvml"] if res else None,
        "bit_exact": ra.get("bit_exact"),
        "same_tensors": ra.get("same_tensors"),
        "round_trip_ms": _med([s["ba_s"] for s in ra["switches"]]) * 1e3,
    }
    errors = []
    if not r["bit_exact"]:
        errors.append(f"offload {nbytes / GB:g} GB: restored bytes differ")
    if not r["same_tensors"]:
        errors.append(f"offload {nbytes / GB:g} GB: tensor objects changed")
    if r["torch_suspended"] is not None and r["torch_suspended"] > ra["torch_before"] - nbytes * 0.99:
        errors.append(f"offload {nbytes / GB:g} GB: torch still holds {r['torch_suspended']} bytes after suspend")
    if not r["nvml_before"]:
        r["nvml_note"] = "NVML does not list job A's process (no NVML, or another PID namespace)"
    elif r["nvml_suspended"] is not None and r["nvml_before"] - r["nvml_suspended"] < nbytes * 0.9:
        errors.append(f"offload {nbytes / GB:g} GB: NVML saw only {r['nvml_before'] - r['nvml_suspended']} bytes freed")
    r["errors"] = errors
    return r
