"""``bench/offload.py``'s figures from its records: the workers' handler calls and grant/release times, and
the times the stream stored the agent's ``OpStarted``/``OpResult`` events (all CLOCK_MONOTONIC ns on one machine)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["HANDED_BACK_GIB", "handed_back", "med", "ms", "paired", "size_result", "switches", "union_ns"]

GiB = 1 << 30
HANDED_BACK_GIB = 1 / 16  # a call during which the guest handed at least this much memory back to its host


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ms(x: float) -> str:
    return "none" if math.isnan(x) else f"{x:.2f} ms"


def union_ns(spans: list[tuple[int, int]]) -> int:
    """Total length of the union of [start, end) spans."""
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def switches(a: dict[str, Any], b: dict[str, Any], ops: list[dict[str, Any]], group: str) -> list[dict[str, Any]]:
    """One entry per switch: its direction, total time, handler time within it and the agent's op times (ms)."""
    rows = [("A", *r) for r in a["rows"]] + [("B", *r) for r in b["rows"]]
    grants = {(who, r[1]): r[2] for who, *r in rows if r[0] == "grant"}
    calls = [("A", *c) for c in a["calls"]] + [("B", *c) for c in b["calls"]]
    out = []
    for who, kind, epoch, t_rel, *_ in rows:
        if kind != "release":
            continue
        other = "B" if who == "A" else "A"
        t_grant = grants.get((other, epoch + 1))
        if t_grant is None:
            continue
        inside = [c for c in calls if t_rel <= c[2] and c[3] <= t_grant]
        # The copies' wall time: the union of the handler calls (an overlapped restore runs beside the snapshot).
        handler_ms = union_ns([(c[2], c[3]) for c in inside]) / 1e6
        handler_sum_ms = sum(c[3] - c[2] for c in inside) / 1e6
        big = [c for c in inside if c[0] == "A"]
        mine = [o for o in ops if o.get("group") == group and o.get("epoch") == epoch + 1]
        op_ms = sum(o["elapsed_ms"] for o in mine if o["type"] == "op_result")
        at = {(o["type"], o["kind"]): o["t"] for o in mine}
        overlapped = any(o["type"] == "op_started" and o.get("overlapped") for o in mine)
        # Hops by the stream's times: release -> snapshot starts; snapshot result -> restore starts (a restore
        # that waited for the snapshot; none when it overlapped); the last result -> grant returns.
        results = [t for (typ, _), t in at.items() if typ == "op_result"]
        marks = [
            t_rel,
            at.get(("op_started", "snapshot")),
            at.get(("op_result", "snapshot")),
            None if overlapped else at.get(("op_started", "restore")),
            max(results, default=None),
            t_grant,
        ]
        hops = {}
        for name, i, j in (
            ("release_to_snapshot_start", 0, 1),
            ("snapshot_result_to_restore_start", 2, 3),
            ("last_result_to_grant", 4, 5),
        ):
            if marks[i] is not None and marks[j] is not None:
                hops[name] = (marks[j] - marks[i]) / 1e6
        # The agent's share of the critical path: each operation's time beyond its handler call, of both
        # operations one after the other, or, when they overlapped, of the one whose result came last. Only the
        # part of the call inside the operation counts: a suspend begun at the release (early suspend) started
        # before the agent's operation did. The operation's start: its result's stored time less its elapsed.
        kinds = ["snapshot", "restore"]
        if overlapped:
            kinds = [max(kinds, key=lambda k: at.get(("op_result", k), 0))]
        call_of = {"snapshot": "suspend", "restore": "resume"}
        crit_ops = sum(o["elapsed_ms"] for o in mine if o["type"] == "op_result" and o["kind"] in kinds)
        crit_calls = 0.0
        for o in mine:
            if o["type"] != "op_result" or o["kind"] not in kinds:
                continue
            end, start = o["t"], o["t"] - o["elapsed_ms"] * 1e6
            crit_calls += (
                sum(max(0.0, min(c[3], end) - max(c[2], start)) for c in inside if c[1] == call_of[o["kind"]]) / 1e6
            )
        out.append(
            {
                "dir": f"{who}->{other}",
                "epoch": epoch + 1,
                "switch_ms": (t_grant - t_rel) / 1e6,
                "handler_ms": handler_ms,
                "handler_sum_ms": handler_sum_ms,
                "agent_ops_ms": op_ms,
                "hops_ms": hops,
                "agent_critical_ms": crit_ops - crit_calls,
                "overlapped": overlapped,
                "a_call": [big[0][1], (big[0][3] - big[0][2]) / 1e9, big[0][5], _gib_back(big[0])] if big else None,
            }
        )
    return out


def _gib_back(call: Sequence[Any]) -> float | None:
    """GiB the guest handed back to its host during one handler call (the worker's ``[who, kind, t0, t1, bytes,
    device bytes, reported KiB before, after]``); None where the kernel does not count it."""
    k0, k1 = (call[6], call[7]) if len(call) >= 8 else (None, None)
    return None if k0 is None or k1 is None else (k1 - k0) / (1 << 20)


def handed_back(seconds: list[float], back: list[float | None] | None) -> dict[str, Any] | None:
    """Splits calls by whether the guest handed at least ``HANDED_BACK_GIB`` back to its host during them: how many
    did, and the median time (ms) of those that did and of the others. None where that was not counted."""
    if not back or len(back) != len(seconds) or any(b is None for b in back):
        return None
    hit = [t * 1e3 for t, b in zip(seconds, back, strict=True) if b is not None and b >= HANDED_BACK_GIB]
    rest = [t * 1e3 for t, b in zip(seconds, back, strict=True) if b is not None and b < HANDED_BACK_GIB]
    return {
        "calls": len(seconds),
        "during": len(hit),
        "during_ms": med(hit),
        "others_ms": med(rest),
        "gib": [round(b, 3) for b in back if b is not None],
    }


def size_result(
    nbytes: int,
    a: dict[str, Any],
    b: dict[str, Any],
    ops: list[dict[str, Any]],
    group: str,
    base: dict[str, list[float]],
) -> dict[str, Any]:
    sw = switches(a, b, ops, group)
    gb = nbytes / 1e9
    off = [s["a_call"][1] for s in sw if s["a_call"] and s["a_call"][0] == "suspend"]
    res = [s["a_call"][1] for s in sw if s["a_call"] and s["a_call"][0] == "resume"]
    bad_free = [s for s in sw if s["a_call"] and s["a_call"][0] == "suspend" and s["a_call"][2] != 0]
    over = [s["switch_ms"] - s["handler_ms"] for s in sw]
    n = sum(1 for r in a["rows"] if r[0] == "release")  # cycles (A releases once per cycle)
    r: dict[str, Any] = {
        "gib": nbytes / GiB,
        "bytes": nbytes,
        "cycles": len(off),
        "offload_s": off,
        "restore_s": res,
        "offload_gbps": gb / med(off),
        "restore_gbps": gb / med(res),
        "base_copy_gbps": gb / med(base["copy"]),
        "base_fresh_gbps": gb / med(base["fresh"]),
        "base_clone_gbps": gb / med(base["clone"]),
        "base_free_ms": med(base["free"]) * 1e3,
        "base_samples": base,
        "switch_ab_ms": med([s["switch_ms"] for s in sw if s["dir"] == "A->B"]),
        "switch_ba_ms": med([s["switch_ms"] for s in sw if s["dir"] == "B->A"]),
        "overhead_ab_ms": med([s["switch_ms"] - s["handler_ms"] for s in sw if s["dir"] == "A->B"]),
        "overhead_ba_ms": med([s["switch_ms"] - s["handler_ms"] for s in sw if s["dir"] == "B->A"]),
        "overhead_ms": med(over),
        "overhead_max_ms": max(over) if over else float("nan"),
        "agent_side_ms": med([s["agent_critical_ms"] for s in sw]),
        "overlapped_switches": sum(1 for s in sw if s["overlapped"]),
        "orchestrator_bus_ms": med([s["switch_ms"] - s["handler_ms"] - s["agent_critical_ms"] for s in sw]),
        "hops_ms": {
            k: med([s["hops_ms"][k] for s in sw if k in s["hops_ms"]])
            for k in ("release_to_snapshot_start", "snapshot_result_to_restore_start", "last_result_to_grant")
        },
        "switches": sw,
        "errors": a["errors"]
        + b["errors"]
        + [f"A held device bytes after {len(bad_free)} suspends"] * bool(bad_free)
        + [f"handler calls: A {len(a['calls'])}, B {len(b['calls'])}; expected {2 * n} and {2 * n - 1}"]
        * (len(a["calls"]) != 2 * n or len(b["calls"]) != 2 * n - 1),
        "host_prepared_bytes": a["prepared"],
    }
    for k, kind in (("offload", "suspend"), ("restore", "resume")):
        mine = [s["a_call"] for s in sw if s["a_call"] and s["a_call"][0] == kind]
        # The first call of each kind is left out: the first restore of a size is cold in every run, whether or not
        # the count moves during it (bench/NOTES.md).
        r[f"{k}_handed_back"] = handed_back([c[1] for c in mine[1:]], [c[3] if len(c) > 3 else None for c in mine[1:]])
    for k in ("offload", "restore"):
        r[f"{k}_vs_copy"] = r[f"{k}_gbps"] / r["base_copy_gbps"]
        r[f"{k}_vs_fresh"] = r[f"{k}_gbps"] / r["base_fresh_gbps"]
    r["offload_first_gbps"] = gb / off[0] if off else float("nan")
    r["restore_first_gbps"] = gb / res[0] if res else float("nan")
    r["offload_best_gbps"] = gb / min(off) if off else float("nan")
    r["restore_best_gbps"] = gb / min(res) if res else float("nan")
    r["base_fresh_first_gbps"] = gb / base["fresh"][0]
    r.update(paired(gb, off, a.get("paired_copies", [])))
    return r


def paired(gb: float, offloads: list[float], spans: list[list[int]]) -> dict[str, Any]:
    """The offloads against job A's copy of the same tensors at the start of the hold before each (one per cycle,
    in order): the median of the per-cycle ratios, and the copies' median GB/s. None where not recorded."""
    copies = [(t1 - t0) / 1e9 for t0, t1 in spans]
    if not copies or len(copies) != len(offloads):
        return {"pair_copy_s": copies, "pair_copy_gbps": None, "offload_vs_pair": None}
    return {
        "pair_copy_s": copies,
        "pair_copy_gbps": gb / med(copies),
        "offload_vs_pair": med([c / o for c, o in zip(copies, offloads, strict=True)]),
    }
