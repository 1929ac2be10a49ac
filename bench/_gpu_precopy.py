"""The GPU check's pre-copy section (section 7 of ``bench/gpu_check.py``): ``bench/precopy.py`` on the GPU.

It runs ``bench/precopy.py --device cuda`` (job A's state on the GPU behind ``TorchOffloadHandler``, job B's small;
A releases with nobody waiting and stays idle, then B acquires) and keeps, per agent order (in order: no room for
both contexts; room: grant on restore), B's acquire with the copy at the switch against the copy made while A was
idle, and how long that idle copy took. What it shows on a GPU: the device-to-host copy over PCIe leaving the switch.

Private to ``bench/``; ``gpu_check.py`` puts ``bench/`` on the path before importing it.
"""

from __future__ import annotations

from typing import Any

from _gpu_switch import bench_json

__all__ = ["precopy"]


def precopy(gib: float, cycles: int, device: str, *, timeout_s: float) -> dict[str, Any]:
    """Run the pre-copy bench on ``device``; its figures per agent order and the command (raises when it fails).
    ``timeout_s``: what is left of the check's budget; past it the bench is stopped with its processes."""
    args = ["--device", device, "--gib", f"{gib:g}", "--cycles", str(cycles), "--idle-ms", "1000"]
    res = bench_json("precopy.py", args, timeout_s)
    return {
        "command": " ".join(["python bench/precopy.py", *args]),
        "device": res["device"],
        "gib": res["gib"],
        "cycles": res["cycles"],
        "orders": {
            order: {
                "copy_ms": o["variants"]["copy"]["switch_p50_ms"],
                "precopied_ms": o["variants"]["precopy"]["switch_p50_ms"],
                "idle_copy_ms": o["variants"]["precopy"]["precopy_p50_ms"],
                "ratio": o["precopy_vs_copy"],
            }
            for order, o in res["orders"].items()
        },
    }
