"""``bench/_offload_analysis.py``: how the offload bench turns its records into a switch's overhead, with and
without a restore that ran beside the snapshot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# module-scoped fixtures: the whole module in one worker, its fixtures made once

MS = 1_000_000  # ns


@pytest.fixture(scope="module")
def an() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench" / "_offload_analysis.py"
    spec = importlib.util.spec_from_file_location("_offload_analysis", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_offload_analysis"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_union_of_spans(an: ModuleType) -> None:
    assert an.union_ns([]) == 0
    assert an.union_ns([(0, 10), (20, 25)]) == 15
    assert an.union_ns([(0, 10), (5, 12), (11, 13), (30, 31)]) == 14
    assert an.union_ns([(5, 12), (0, 100)]) == 100  # one inside another


def _records(overlapped: bool) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """A releases at 0 (epoch 1); A's suspend runs 2-22 ms; B's resume 4-6 ms (beside it) or 24-26 ms (after
    it); B is granted at 30 ms (epoch 2). The agent's operations took 1 ms more than their handler calls."""
    b_call = (4, 6) if overlapped else (24, 26)
    a = {"rows": [["release", 1, 0]], "calls": [["suspend", 2 * MS, 22 * MS, 100, 0]], "errors": [], "prepared": 0}
    b = {
        "rows": [["grant", 2, 30 * MS, True]],
        "calls": [["resume", b_call[0] * MS, b_call[1] * MS, 10, 10]],
        "errors": [],
        "prepared": 0,
    }
    snap_end, rest_end = 23, (7 if overlapped else 27)
    ops = [
        {"type": "op_started", "kind": "snapshot", "group": "g", "epoch": 2, "t": 1 * MS},
        {
            "type": "op_started",
            "kind": "restore",
            "group": "g",
            "epoch": 2,
            "t": (3 if overlapped else 23) * MS,
            "overlapped": overlapped,
        },
        {"type": "op_result", "kind": "snapshot", "group": "g", "epoch": 2, "t": snap_end * MS, "elapsed_ms": 21.0},
        {"type": "op_result", "kind": "restore", "group": "g", "epoch": 2, "t": rest_end * MS, "elapsed_ms": 3.0},
    ]
    return a, b, ops


def test_sequential_switch(an: ModuleType) -> None:
    (sw,) = an.switches(*_records(overlapped=False), "g")
    assert sw["switch_ms"] == 30 and sw["handler_ms"] == 22 and not sw["overlapped"]
    assert sw["agent_critical_ms"] == pytest.approx(2.0)  # both operations: (21 - 20) + (3 - 2)
    assert sw["hops_ms"] == {
        "release_to_snapshot_start": 1,
        "snapshot_result_to_restore_start": 0,
        "last_result_to_grant": 3,
    }


def test_overlapped_switch_counts_the_copies_once_and_the_last_operation_only(an: ModuleType) -> None:
    (sw,) = an.switches(*_records(overlapped=True), "g")
    assert sw["overlapped"] and sw["handler_ms"] == 20 and sw["handler_sum_ms"] == 22
    assert sw["switch_ms"] - sw["handler_ms"] == 10  # the overhead: B's resume is inside A's suspend
    assert sw["agent_critical_ms"] == pytest.approx(1.0)  # the snapshot, whose result came last
    assert "snapshot_result_to_restore_start" not in sw["hops_ms"]
    assert sw["hops_ms"]["last_result_to_grant"] == 7


def test_a_suspend_begun_at_the_release_counts_only_inside_the_agents_operation(an: ModuleType) -> None:
    """Early suspend: A's suspend runs 0.5-20.5 ms, the agent's snapshot 4-22 ms (elapsed 18 ms, stored at
    22): the agent's share is what the operation took beyond the call, 1.5 ms, not 18 - 20 ms."""
    a, b, ops = _records(overlapped=True)
    a["calls"] = [["suspend", MS // 2, 20 * MS + MS // 2, 100, 0]]
    ops[0]["t"], ops[2]["t"], ops[2]["elapsed_ms"] = 3 * MS, 22 * MS, 18.0
    (sw,) = an.switches(a, b, ops, "g")
    assert sw["handler_ms"] == 20
    assert sw["agent_critical_ms"] == pytest.approx(1.5)


def test_calls_during_which_the_guest_handed_memory_back(an: ModuleType) -> None:
    """The worker records the guest's reported-KiB count before and after each call; the analysis tells which
    calls ran while the guest handed memory back to its host, and where the kernel has no count, says nothing."""
    a, b, ops = _records(overlapped=True)
    a["calls"] = [["suspend", 2 * MS, 22 * MS, 100, 0, 1_000, 1_000 + 512 * 1024]]  # 0.5 GiB handed back
    (sw,) = an.switches(a, b, ops, "g")
    assert sw["a_call"][3] == pytest.approx(0.5)
    a["calls"] = [["suspend", 2 * MS, 22 * MS, 100, 0, None, None]]
    assert an.switches(a, b, ops, "g")[0]["a_call"][3] is None
    a["calls"] = [["suspend", 2 * MS, 22 * MS, 100, 0]]  # a worker that did not record it
    assert an.switches(a, b, ops, "g")[0]["a_call"][3] is None

    split = an.handed_back([0.4, 2.1, 0.5, 1.6], [0.0, 0.9, 0.01, 0.12])
    assert split["calls"] == 4 and split["during"] == 2
    assert split["during_ms"] == pytest.approx(1850) and split["others_ms"] == pytest.approx(450)
    assert an.handed_back([0.4, 2.1], [0.0, None]) is None
    assert an.handed_back([], []) is None
    assert an.handed_back([0.4], [0.0])["during_ms"] != an.handed_back([0.4], [0.0])["during_ms"]  # NaN: none did


def test_offloads_against_the_copy_paired_with_each(an: ModuleType) -> None:
    """Job A times a plain copy of its tensors at the start of each hold; each offload is set against the copy
    before it (the median of the per-cycle ratios), so a host whose bandwidth drifts between cycles moves both."""
    spans = [[0, 100 * MS], [1_000 * MS, 1_200 * MS], [5_000 * MS, 5_110 * MS]]  # copies of 0.10, 0.20, 0.11 s
    p = an.paired(1.0, [0.125, 0.25, 0.11], spans)
    assert p["pair_copy_s"] == pytest.approx([0.1, 0.2, 0.11])
    assert p["offload_vs_pair"] == pytest.approx(0.8)  # ratios 0.8, 0.8, 1.0
    assert p["pair_copy_gbps"] == pytest.approx(1 / 0.11)
    # not recorded (a worker without it), or not one per offload: no ratio claimed
    assert an.paired(1.0, [0.1], [])["offload_vs_pair"] is None
    assert an.paired(1.0, [0.1, 0.2], spans[:1])["offload_vs_pair"] is None
