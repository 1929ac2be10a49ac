"""The GPU check's switch section (section 5 of ``bench/gpu_check.py``): ``bench/offload.py`` on the GPU.

It runs ``bench/offload.py --device cuda`` (the same stack and workloads as the offload bench on the
development machine, with its same-run switch floor) and keeps, per size, what issue 3 asks of a switch:
the overhead beyond the handler calls (goal: ``_gpu_report.SWITCH_GOAL_MS``), and the offload and restore
bandwidth against the same-run copy. The offload bench's own JSON is kept beside the check's (``raw_out``).

Private to ``bench/``; ``gpu_check.py`` puts ``bench/`` on the path before importing it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _gpu_offload import ROOT, _child_env
from _gpu_run import run_bounded

__all__ = ["bench_json", "switch"]

_KEPT = (
    "gib",
    "overhead_ms",
    "overhead_ab_ms",
    "overhead_ba_ms",
    "overhead_max_ms",
    "agent_side_ms",
    "orchestrator_bus_ms",
    "offload_gbps",
    "restore_gbps",
    "offload_vs_copy",
    "restore_vs_copy",
    "restore_vs_fresh",
    "overlapped_switches",
)


def bench_json(script: str, args: list[str], timeout_s: float, raw_out: Path | None = None) -> dict[str, Any]:
    """Run ``bench/<script> <args> --json-out FILE`` (its report streams out) within ``timeout_s``, and return what it
    wrote (raises when it fails). ``raw_out``: keep that file there, else in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="ts-gpu-bench-") as tmp:
        out = raw_out or Path(tmp) / "result.json"
        rc = run_bounded(
            [sys.executable, str(ROOT / "bench" / script), *args, "--json-out", str(out)],
            timeout_s,
            what=f"bench/{script}",
            env=_child_env(),
            cwd=ROOT,
        )
        if rc:
            raise RuntimeError(f"bench/{script} exited with {rc} (its output is above)")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def switch(
    sizes_gib: Sequence[float],
    cycles: int,
    floor_switches: int,
    device: str,
    agent_process: bool,
    raw_out: Path | None = None,
    *,
    timeout_s: float,
) -> dict[str, Any]:
    """Run the offload bench on ``device``; its figures per size, the floor and the command (raises when it fails).
    ``timeout_s``: what is left of the check's budget; past it the bench is stopped with its processes."""
    args = [
        "--device",
        device,
        "--sizes",
        ",".join(f"{g:g}" for g in sizes_gib),
        "--cycles",
        str(cycles),
        "--floor-switches",
        str(floor_switches),
        *(["--agent-process"] if agent_process else []),
    ]
    res = bench_json("offload.py", args, timeout_s, raw_out)
    floor = res.get("switch_floor") or {}
    return {
        "command": " ".join(["python bench/offload.py", *args]),
        "device": res["device"],
        "agent": res["agent"],
        "cycles": res["cycles"],
        "floor_p50_ms": floor.get("p50_ms"),
        "sizes": [{k: r.get(k) for k in _KEPT} for r in res["sizes"]],
    }
