"""The sections of docs/benchmarks.md on moving a job's state (``_report`` renders them): offload and restore
through the torch handler (``bench/offload.py``, on CPU and on the GPU machine), the switch floor beside it, suspend
beside a busy thread (``bench/busy_suspend.py``), and the GPU check (``bench/gpu_check.py``)."""

from __future__ import annotations

import json
from typing import Any

from _report_format import X, _cmd, _met, _n, _table

__all__ = ["_busy_suspend", "_gpu", "_offload"]


def _offload(r: dict[str, Any]) -> list[str]:
    rows = []
    for s in r.get("sizes", []):
        rows.append(
            [
                f"{s.get('gib', '?'):g} GiB",
                _n(s.get("offload_gbps")),
                _n(s.get("offload_vs_copy")),
                _n(s.get("restore_gbps")),
                _n(s.get("restore_vs_fresh")),
                _n(s.get("restore_vs_copy")),
                _n(s.get("base_copy_gbps")),
                _n(s.get("base_fresh_gbps")),
                _n(s.get("overhead_ms"), 2, " ms"),
            ]
        )
    sizes = r.get("sizes", [])
    off = min((s["offload_vs_copy"] for s in sizes), default=None)
    rst = min((s["restore_vs_fresh"] for s in sizes), default=None)
    rst1 = min((s["restore_vs_copy"] for s in sizes), default=None)
    over = max((s["overhead_ms"] for s in sizes), default=None)
    return [
        "Offload and restore through the `app_channel` torch handler, end to end through the orchestrator and "
        f"the node agent ({r.get('agent', 'in its own process')}; device: {r.get('device', '?')}); GB/s = bytes "
        "over the handler's own time, medians of "
        f"{r.get('cycles', '?')} cycles. Baselines in the same run for the same bytes: copy(1) = `dst.copy_(src)` "
        "into a preallocated buffer; fresh(2) = allocate + copy (memory re-obtained from the OS, as a CPU restore "
        "must). Switch overhead = release → the other job's `acquire()` returns, minus the handler calls.",
        "",
        *_cmd(r),
        *_table(
            [
                "size",
                "offload GB/s",
                f"{X}copy(1)",
                "restore GB/s",
                f"{X}fresh(2)",
                f"{X}copy(1)",
                "copy(1) GB/s",
                "fresh(2) GB/s",
                "switch overhead",
            ],
            rows,
        ),
        f"Against issue 3: offload ≥ 80% of the same-run copy: worst {_n(off)}{X} — "
        f"{_met(off is not None and off >= 0.8)}; "
        f"restore ≥ 80%: worst {_n(rst)}{X} fresh(2) — {_met(rst is not None and rst >= 0.8)}, worst {_n(rst1)}{X} "
        f"copy(1) — {_met(rst1 is not None and rst1 >= 0.8)}; switch adds ≤ 5 ms beyond the copies: worst "
        f"{_n(over, 2, ' ms')} — {_met(over is not None and over <= 5)}.",
        "",
        *_paired(sizes),
        *_handed_back(sizes),
        *_switch_floor(r),
    ]


def _paired(sizes: list[dict[str, Any]]) -> list[str]:
    """Where recorded: each offload against job A's own copy of the same tensors at the start of the hold before it."""
    parts = [
        f"{s.get('gib', '?'):g} GiB {_n(s['offload_vs_pair'])}{X} (the copy {_n(s.get('pair_copy_gbps'))} GB/s)"
        for s in sizes
        if s.get("offload_vs_pair") is not None
    ]
    if not parts:
        return []
    return [
        "Offload against the copy paired with it (job A's plain copy of the same tensors into a touched buffer "
        "of its own, timed at the start of the hold before each offload; median of the per-cycle ratios), "
        "which the host's memory-bandwidth drift between the baselines before and after a size does not move: "
        + "; ".join(parts)
        + ".",
        "",
    ]


def _handed_back(sizes: list[dict[str, Any]]) -> list[str]:
    """Where the kernel counts it: the calls during which the guest handed free memory back to its host."""
    parts = []
    for s in sizes:
        rst, off = s.get("restore_handed_back"), s.get("offload_handed_back")
        if rst is None or off is None:
            return []
        part = f"{s.get('gib', '?'):g} GiB: {rst['during']} of {rst['calls']} restores"  # the first cycle left out
        if rst["during"]:
            part += f" ({_n(rst['during_ms'], 0, ' ms')} median, the others {_n(rst['others_ms'], 0, ' ms')})"
        part += f", {off['during']} of {off['calls']} offloads"
        if off["during"]:
            part += f" ({_n(off['during_ms'], 0, ' ms')} median, the others {_n(off['others_ms'], 0, ' ms')})"
        parts.append(part)
    return (
        [
            "Calls during which this VM's guest handed free memory back to its host (virtio-balloon free page "
            "reporting, counted by its kernel; the first cycle of each size left out): " + "; ".join(parts) + ".",
            "",
        ]
        if parts
        else []
    )


def _busy_suspend(r: dict[str, Any]) -> list[str]:
    rows = [
        [
            name,
            _n(x.get("suspend_ms"), 1, " ms"),
            _n(x.get("suspend_x_idle"), 1, X),
            _n(x.get("resume_ms"), 1, " ms"),
            _n(x.get("resume_x_idle"), 1, X),
        ]
        for name, x in r.get("conditions", {}).items()
    ]
    return [
        f"The torch handler over {r.get('tensors', '?')} {r.get('device', 'cpu')} tensors of "
        f"{r.get('tensor_kib', '?')} KiB "
        f"({_n(r.get('mb'), 0, ' MB')}), called from a thread of its own as the workload channel calls it, while "
        "another thread of the job runs Python (a job scoring rewards after it yielded). Medians of "
        f'{r.get("reps", "?")} cycles; baseline (idle: that thread sleeps) in the same run. "per storage": one '
        'copy call per storage (the CUDA path); "batched": every copy in one call (the CPU path); "prompt": '
        f"the GIL switch interval at {_n((r.get('prompt_interval_s') or 0) * 1e3, 1, ' ms')} while the command "
        "runs, as the workload channel sets it.",
        "",
        *_cmd(r),
        *_table(["condition", "suspend", f"{X}idle", "resume", f"{X}idle"], rows),
        *_busy_channel(r.get("channel") or {}),
    ]


def _busy_channel(channel: dict[str, Any]) -> list[str]:
    if not channel:
        return []
    rows = [
        [name, _n(x.get("p50_ms"), 2, " ms"), _n(x.get("x_idle"), 1, X), _n(x.get("p90_ms"), 2, " ms")]
        for name, x in channel.items()
    ]
    return [
        "Through the workload channel: a job process with a do-nothing handler (and, when busy, a thread spinning "
        'in Python), commands sent as the agent sends them, round trip timed by the sender. "lowered per '
        'command": the interval goes down once the command is read; "armed": it is down already, as after '
        "the job's release.",
        "",
        *_table(["condition", "round trip p50", f"{X}idle", "p90"], rows),
    ]


def _switch_floor(r: dict[str, Any]) -> list[str]:
    f = r.get("switch_floor")
    if not f:
        return []
    ratios = ", ".join(f"{_n(s.get('overhead_vs_floor'))}{X} at {s.get('gib', '?'):g} GiB" for s in r.get("sizes", []))
    layout = (
        "the agent stand-in in the orchestrator stand-in's process, which stores the command and asks the "
        "workloads itself, three processes"
        if f.get("colocated")
        else "the agent stand-in apart, reached through a push consumer, four processes"
    )
    return [
        "Switch floor, same run and server (`bench/_switch_floor.py`): the switch's bus hops with no timeslice "
        "code in them (release through the stream → a stored command → core requests to both workloads, "
        f"answered at once → the result through the stream → a stored grant), {layout}, "
        f"{f.get('n', '?')} switches after a {_n(f.get('gap_ms'), 0)} ms idle gap each: p50 "
        f"{_n(f.get('p50_ms'), 2, ' ms')}, p90 {_n(f.get('p90_ms'), 2, ' ms')}, p99 {_n(f.get('p99_ms'), 2, ' ms')}. "
        f"Switch overhead median, as a multiple of this floor's p50: {ratios}.",
        "",
    ]


def _gpu(results: dict[str, dict[str, Any]]) -> list[str]:
    """Every ``gpu_check*.json`` as ``bench/gpu_check.py`` prints it, then every ``offload_gpu*.json`` (``bench/
    offload.py`` run on the GPU machine) as the offload section shows it."""
    checks = {n: r for n, r in results.items() if n.startswith("gpu_check")}
    offloads = {n: r for n, r in results.items() if n.startswith("offload_gpu")}
    if not checks and not offloads:
        return [
            "No GPU run was made: `bench/results/gpu_check.json` is absent (`bench/gpu_check.py` writes it "
            "on a CUDA machine).",
            "",
        ]
    out: list[str] = []
    for name, r in checks.items():
        out += [
            f"`bench/results/{name}.json` (written by `bench/gpu_check.py`{_gpu_command(r)}):",
            "",
            "```",
            *_gpu_lines(r),
            "```",
            "",
        ]
    for name, r in offloads.items():
        out += [
            f"`bench/offload.py` on the GPU machine (`bench/results/{name}.json`, device "
            f"{r.get('device', '?')}, {r.get('cpus', '?')} CPUs):",
            "",
            *_offload(r),
        ]
    return out


def _gpu_command(r: dict[str, Any]) -> str:
    return f": `{r['command']}`" if r.get("command") else ""


def _gpu_lines(r: dict[str, Any]) -> list[str]:
    """The check's own report lines; its JSON's scalars when the file is not a report it wrote."""
    from dataclasses import fields

    from _gpu_report import Report, format_report

    known = {f.name for f in fields(Report)}
    try:
        return format_report(Report(**{k: v for k, v in r.items() if k in known}))
    except (KeyError, TypeError, ValueError, AttributeError):
        scalars = {k: v for k, v in r.items() if isinstance(v, str | int | float | bool)}
        return json.dumps(scalars, indent=2)[:4000].splitlines()
