"""The GPU check's cuda section (section 4 of ``bench/gpu_check.py``): the ``cuda`` backend (the driver's checkpoint
API through cuda-python) against a separate process holding the state on the GPU: lock + checkpoint, NVML memory
before and after, restore + unlock, the process's data checked afterwards. If the driver refuses, what it answered is
kept exactly.

Private to ``bench/``; ``gpu_check.py`` puts ``bench/`` and the project's packages on the path before importing it,
and runs the holder process (``python bench/gpu_check.py --role holder``).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _gpu_offload import N_TENSORS, NODE, _checksums, _child_env, _random_state
from _gpu_run import CLEANUP_S, Budget, LineReader

__all__ = ["cuda_backend", "holder"]

SCRIPT = Path(__file__).with_name("gpu_check.py")  # the holder's entry point


def holder(nbytes: int) -> None:
    """A process holding ``nbytes`` on the GPU: prints ``ready``, then on each stdin line ``check`` prints
    whether its data is intact."""
    import torch

    tensors = _random_state(nbytes, N_TENSORS)
    sums = _checksums(tensors)
    torch.cuda.synchronize()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            print("intact" if _checksums(tensors) == sums else "CORRUPT", flush=True)


def cuda_backend(nbytes: int, budget: Budget) -> dict[str, Any]:
    from timeslice_agent._backend_api import BackendError, BackendUnavailable, OpContext
    from timeslice_agent._cuda import CudaBackend, CudaPythonDriver, DriverError
    from timeslice_agent._nvml import GpuAccounting, gpu_source
    from timeslice_client.protocol import JobContext, JobState

    out: dict[str, Any] = {"bytes": nbytes}
    try:
        driver = CudaPythonDriver()
    except BackendUnavailable as exc:
        out["refused"], out["unavailable"] = f"CudaPythonDriver(): {exc}", True
        return out
    be = CudaBackend(
        driver,
        GpuAccounting(gpu_source()),
        lock_timeout_ms=int(budget.bound(10) * 1000),
        lock_attempts=3,
        drain_s=CLEANUP_S / 4,
    )
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--role", "holder", "--bytes", str(nbytes)],
        env=_child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        lines = LineReader(proc.stdout)
        if (first := lines.readline(budget.bound(120), "the holder process")) != "ready":
            raise RuntimeError(f"the holder process did not start (it said {first!r}; its traceback is above)")
        ctx = JobContext(
            node=NODE, job="holder", group="cuda", state=JobState.RUNNING, backends=("cuda",), pids=(proc.pid,)
        )
        acct = be.accounting
        out["driver_state"] = driver.state(proc.pid).name
        out["nvml_before"] = acct.used_by((proc.pid,)) if acct.source else None
        if not out["nvml_before"]:
            out["nvml_note"] = "NVML does not list the holder process: the driver finds it, no bytes measured"

        async def go() -> None:
            op = OpContext("gpu-check-snap", 1, time.monotonic() + budget.bound(120))
            t0 = time.perf_counter()
            snap = await be.snapshot(ctx, op)
            out["snapshot_s"] = time.perf_counter() - t0
            out["device_bytes_freed"], out["bytes_moved"] = snap.device_bytes_freed, snap.bytes_moved
            out["driver_state_saved"] = driver.state(proc.pid).name
            out["nvml_checkpointed"] = acct.used_by((proc.pid,)) if acct.source else None
            t0 = time.perf_counter()
            await be.restore(ctx, OpContext("gpu-check-restore", 1, time.monotonic() + budget.bound(120)))
            out["restore_s"] = time.perf_counter() - t0
            out["nvml_restored"] = acct.used_by((proc.pid,)) if acct.source else None

        async def bounded() -> None:
            limit = budget.bound(240)  # the backend's own deadlines bound only the lock
            try:
                async with asyncio.timeout(limit):
                    await go()
            except TimeoutError:
                raise TimeoutError(
                    f"the cuda backend's snapshot and restore did not finish within {limit:.0f} s "
                    "(the budget's share): run --only cuda, or with a smaller --cuda-gb"
                ) from None

        try:
            asyncio.run(bounded())
        except (BackendError, DriverError) as exc:
            out["refused"] = f"{exc.__class__.__name__}: {exc}"
            return out
        proc.stdin.write("check\n")
        proc.stdin.flush()
        out["intact"] = lines.readline(budget.bound(60), "the holder process's check") == "intact"
        out["driver_state_after"] = driver.state(proc.pid).name
        if out["driver_state_saved"] != "CHECKPOINTED":
            out["refused"] = f"the snapshot left the process {out['driver_state_saved']}, not CHECKPOINTED"
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(CLEANUP_S / 4)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(CLEANUP_S / 4)
        be.close()
    return out
