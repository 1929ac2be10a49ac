"""docs/benchmarks.md's section on the multi-pool trace profiles, from trace_replay.py's result (its ``pool_profiles``).

``python bench/_trace_pool_md.py RESULT.json`` prints the section; :func:`pool_markdown` gives its lines, for
``bench/_report.py`` to add where it writes the trace replay section.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from _report_format import NA, X, _cmd, _n, _table
from _trace_pool_report import beyond_restore_ms, real_notes

TITLE = "Trace replay: the published veRL runs, modelled (bench/trace_replay.py)"


def _pct(x: float | None) -> str:
    return _n(None if x is None else x * 100, 1, "%")


def _rows(p: dict[str, Any], by_pol: dict[str, Any]) -> list[list[str]]:
    pools = p["pools"]
    fifo = by_pol.get("fifo") or next(iter(by_pol.values()))
    rows = []
    for i, a in enumerate(fifo["alone"]):
        rows.append(
            [
                f"job {i} alone (baseline)",
                _n(a["makespan_s"] / 60, 1, " min"),
                NA,
                *(_pct(a["pools"][pool]["duty_cycle"]) for pool in pools),
                *([_pct(a["mean_duty"])] if len(pools) > 1 else []),
                str(a["switches"]),
                NA,
                NA,
            ]
        )
    for pol, block in by_pol.items():
        f = block["shared"]
        med = f["critical_path_median_s"]
        rows.append(
            [
                f"2 sharing, {pol}",
                _n(f["makespan_s"] / 60, 1, " min"),
                f"{_n(f.get('makespan_vs_fifo', 1.0))}{X}",
                *(_pct(f["pools"][pool]["duty_cycle"]) for pool in pools),
                *([_pct(f["mean_duty"])] if len(pools) > 1 else []),
                str(f["switches"]),
                _n(f["critical_path_s"]["total"], 1, " s"),
                f"{_n(med['total'], 3)} = {_n(med['snapshot'], 3)} + {_n(med['restore'], 3)} + "
                f"{_n(med['lock_bus'], 3)}",
            ]
        )
    return rows


def _head(p: dict[str, Any]) -> list[str]:
    pools = p["pools"]
    return [
        "run",
        "makespan",
        "vs FIFO",
        *(f"{pool} duty" for pool in pools),
        *(["mean duty"] if len(pools) > 1 else []),
        "switches",
        "switch time on the critical path",
        "median switch (s) = snapshot + restore + lock/bus",
    ]


def _published(vp: dict[str, Any]) -> str:
    solo, shared = vp["solo_s"], vp["shared_s"]
    return (
        f"Published ({vp['duty_pool']} duty) against this sim's FIFO run: alone {_pct(vp['duty_solo']['published'])} "
        f"(sim {_pct(vp['duty_solo']['sim'])}), shared {_pct(vp['duty_shared']['published'])} (sim "
        f"{_pct(vp['duty_shared']['sim'])}; {_pct(vp['duty_shared_all_running'])} while both jobs run), "
        f"{vp['swaps']['published']} swaps (sim {vp['swaps']['sim']})"
        + (
            f", alone {_n(solo['published'] / 60, 0, ' min')} (sim {_n(solo['sim'] / 60, 1, ' min')})"
            if solo["published"]
            else ""
        )
        + (
            f", shared {_n(shared['published'] / 60, 0, ' min')} (sim {_n(shared['sim'] / 60, 1, ' min')})"
            if shared["published"]
            else ""
        )
        + "."
    )


# A profile's runs, in the order the section shows them (a table per cost model), and the line above each table
# (filled in from the run's figures and the cost model ``cm``).
_CAPTIONS = {
    "sim": "Sim, cost model *{cm}*, {jobs} jobs {X} {steps} steps, bus pass {hop_ms:.2f} ms, quantum "
    "{quantum_s:.0f} s:",
    "real": "Real, cost model *{cm}*, {jobs} jobs {X} {steps} steps, time ÷ {compression:.0f}:",
    "sim_same_steps": "Sim at the real run's {steps} steps, cost model *{cm}* (to set beside the real run):",
}


def pool_markdown(r: dict[str, Any]) -> list[str]:
    """The section's lines (without its title) from a trace_replay result; [] when it ran no multi-pool profile."""
    pp = r.get("pool_profiles") or {}
    if not pp:
        return []
    out = [
        "Profiles modelled on the reference project's published veRL runs (issue 27), **modelled on the published "
        "figures, not recorded**: each says how its phases were derived from the published solo figures. A job "
        "holds a trainer pool and a sampler pool in turn (one core record per pool, `bench/_trace_pools.py`), "
        "taking one while it still holds the other in the client's order (`docs/multi-pool.md`). Cost models: "
        "*published* (the published checkpoint and restore medians) and *pcie* (the state's bytes over 55 GB/s each "
        "way; sizes in each profile's cost model). Policies: *fifo* (today's default: snapshot, then restore, then "
        "grant), *room* (grant on restore: the node fits both contexts), *precopy* (a job that gives a pool back "
        "with nobody waiting, its context left loaded, copies it out while idle once it has been switched out "
        "before; the next switch only frees it), *room_precopy* (both), *predict* (FIFO with the predictive "
        "restore, `timeslice set-policy --predict`: at a release nobody waits for, the job expected to ask next has "
        "its context brought back while the pool is idle; `docs/scheduling.md`), *room_predict* (grant on restore, "
        "pre-copy and the predictive restore), *predict_phase* and *room_predict_phase* (the same, each job also "
        "publishing its phase starts, which the core learns from: simulated only), *priority* (job 0 at class 1), "
        "*quantum* (a holder past the quantum "
        "while the other waits gives a pool back at its next phase boundary). Times are modelled. Duty = time a job "
        "holds the pool ÷ makespan; a switch = another job's release (or the incoming acquire, if later) → the "
        "grant, split into snapshot (the outgoing copy while no restore ran), restore, and lock/bus (the rest). "
        "*real*: the real stack (an agent per pool, one client per pool per job, `CallbackHandler`s taking the "
        "modelled time; the predictive restore set on each pool's group as `timeslice set-policy` sets it), "
        "compressed: its own overhead (a few ms a "
        "switch) weighs the compression factor more in modelled time, so its lock/bus column is that overhead times "
        'the factor. What the figures say, and what the profiles cannot reproduce: `docs/scheduling.md` ("Judged on '
        'the published runs"). The solo figures, the mutual exclusion per pool and the cost models are checked by '
        "`pytest tests/test_trace_profiles.py`.",
        "",
        *_cmd(r),
    ]
    for name, p in pp.items():
        out += [f"### {name}", "", p.get("description", ""), ""]
        for cm, c in p.get("costs", {}).items():
            out += [f"- cost model *{cm}*: {c['description']}"]
        out += [""]
        for mode, caption in _CAPTIONS.items():
            if mode not in p:
                continue
            for cm, by_pol in p[mode]["runs"].items():
                out += [caption.format_map({**p[mode], "cm": cm, "X": X}), "", *_table(_head(p), _rows(p, by_pol))]
                fifo = by_pol.get("fifo") or next(iter(by_pol.values()))
                if mode == "sim" and fifo.get("vs_published"):
                    out += [_published(fifo["vs_published"]), ""]
                if mode == "real":
                    out += [" ".join(real_notes(by_pol, p[mode]["compression"])), ""]
                if mode == "real" and "room" in by_pol:
                    ms = beyond_restore_ms(by_pol["room"], p[mode]["compression"])
                    out += [
                        f"Grant on restore (*room*) through the stack: the median switch takes {ms:.1f} ms (real time) "
                        "beyond the incoming restore (issue 27's goal: at most 10 ms).",
                        "",
                    ]
    return out


def main() -> None:
    r = json.loads(Path(sys.argv[1]).read_text())
    print("\n".join([f"## {TITLE}", "", *pool_markdown(r)]).rstrip())


if __name__ == "__main__":
    main()
