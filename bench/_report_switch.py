"""The sections of docs/benchmarks.md on hiding the switch (``_report`` renders them): grant on restore against the
orders before it, from ``bench/grant_on_restore.py``'s result files (one per layout), and pre-copy while idle against
the copy at the switch (``bench/precopy.py``)."""

from __future__ import annotations

from typing import Any

from _report_format import NA, X, _cmd, _met, _n, _table

__all__ = ["_grant_on_restore", "_precopy"]

_PRECOPY_ORDERS = {"in-order": "in order (no room)", "room": "grant on restore (room)"}
_ORDERS = {
    "in-order": "in order: snapshot, restore, grant (the room rule's no)",
    "beside": "beside: restore beside the snapshot, grant after both (the order before)",
    "grant-on-restore": "grant on restore: the snapshot trails the grant",
}


def _grant_on_restore(r: dict[str, Any]) -> list[str]:
    runs = r.get("runs", [r])
    lines = [
        "Two jobs hand a group back and forth through the real stack (nats-server, the orchestrator, the node "
        "agent), each with a workload handler that models its state's move: the suspend takes the modelled "
        "snapshot time, the resume the modelled restore time. Release → the next grant, timed in one process. "
        "Baseline, same run: the in-order switch (the agent with `--no-overlap-restores`), one handoff of each "
        "order in turn. Goal (issue 27): where the room rule allows both contexts, the median handoff ≤ the "
        "restore's own time + 10 ms.",
        "",
    ]
    for run in runs:
        orders = run["orders"]
        g = orders["grant-on-restore"]
        rows = [
            [
                label,
                _n(o["handoff_p50_ms"], 1, " ms"),
                _n(o["handoff_p95_ms"], 1, " ms"),
                _n(o["restore_p50_ms"], 1, " ms"),
                _n(o["beyond_operations_p50_ms"], 1, " ms"),
                _n(o["ratio_to_in_order"], 2, X),
            ]
            for name, label in _ORDERS.items()
            if (o := orders.get(name)) is not None
        ]
        lines += [
            f"Layout `{run['layout']}`: modelled snapshot {_n(run['snapshot_ms'], 0, ' ms')}, restore "
            f"{_n(run['restore_ms'], 0, ' ms')}, holds {_n(run['hold_ms'], 0, ' ms')}, {g['n']} handoffs per order.",
            "",
            *_cmd(run),
            *_table(
                ["order", "handoff p50", "p95", "restore p50", "beyond the operations waited for", "vs in order"], rows
            ),
            f"Against issue 27: grant on restore's median handoff {_n(g['handoff_p50_ms'], 1, ' ms')} ≤ restore "
            f"{_n(g['restore_p50_ms'], 1, ' ms')} + 10 ms — {_met(g['handoff_p50_ms'] <= g['restore_p50_ms'] + 10)}.",
            "",
        ]
    return lines


def _precopy(r: dict[str, Any]) -> list[str]:
    rows = []
    for order, o in r["orders"].items():
        v = o["variants"]
        for name, label in (("copy", "copy at the switch (baseline)"), ("precopy", "precopied while idle")):
            rows.append(
                [
                    _PRECOPY_ORDERS.get(order, order),
                    label,
                    _n(v[name]["switch_p50_ms"], 1, " ms"),
                    _n(v[name]["switch_p50_ms"] / v["copy"]["switch_p50_ms"], 2, X),
                    _n(v[name]["precopy_p50_ms"], 1, " ms") if v[name]["precopy_p50_ms"] is not None else NA,
                ]
            )
    return [
        "Job A (its state behind `TorchOffloadHandler`) releases with nobody waiting and stays idle; then job B "
        "acquires, and the switch moves A's state out and B's in. Timed: B's `acquire()`. Baseline, same run: the same "
        'cycles with A\'s channel at `precopy="never"` (the copy at the switch); then `"always"`: A\'s state was '
        'copied to host memory while A was idle, and the snapshot only frees it (docs/backends.md, "Pre-copy"). '
        "Each in two orders of the agent: in order (no room for both contexts) and grant on restore (room).",
        "",
        f"{_n(r['gib'], 2, ' GiB')} in A on `{r['device']}`, {r['cycles']} cycles per variant, A idle "
        f"{_n(r['idle_ms'], 0, ' ms')} between its release and B's acquire.",
        "",
        *_cmd(r),
        *_table(["agent", "variant", "B's acquire p50", "vs baseline", "A's idle copy p50"], rows),
    ]
