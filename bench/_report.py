"""docs/benchmarks.md from the bench scripts' result files (``bench/results/<name>.json``).

Every figure is printed with the command that produced it, the baseline measured in the same run, the
ratio, and how it compares to the goal of issue 2 (handoff), 3 (offload) or 6 (scale, recovery,
trace replay, demo). A section whose result file is missing says so. The lab diary, ``bench/NOTES.md``
(hand-written analysis of earlier runs that no run regenerates), is linked at the end, not copied in.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _report_format import NA, X, _cmd, _met, _n, _table
from _report_offload import _busy_suspend, _gpu, _offload
from _report_robust import _chaos, _chaos_policies, _failover, _handoff_auth, _stream_leader
from _report_switch import _grant_on_restore, _precopy
from _trace_pool_md import TITLE as POOL_TITLE
from _trace_pool_md import pool_markdown

NOTES = Path(__file__).resolve().parent / "NOTES.md"
BUSY_LOAD = 1.0  # a run that started above this 1-min load average was not on a quiet machine
ORDER = (
    "handoff",
    "handoff_auth",
    "bind_cost",
    "offload",
    "busy_suspend",
    "grant_on_restore",
    "precopy",
    "scale",
    "recovery",
    "failover",
    "stream_leader",
    "chaos",
    "chaos_policies",
    "trace_replay",
)


def load_results(results: Path) -> dict[str, dict[str, Any]]:
    """Every ``<name>.json`` in ``results`` that parses, by name (gpu_check and demo included)."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(results.glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out[p.stem] = data
    return out


# ---------------------------------------------------------------------- sections


def _ms_row(r: dict[str, Any], key: str, label: str, ratio: str = "", goal: str = "", verdict: str = "") -> list[str]:
    """A row of the handoff table: ``label``, then ``key``'s p50 and p99 in ms, then the ratio, goal and verdict."""
    return [label, _n(r.get(f"{key}_p50_ms"), 3, " ms"), _n(r.get(f"{key}_p99_ms"), 3, " ms"), ratio, goal, verdict]


def _handoff(r: dict[str, Any]) -> list[str]:
    p1, p1_99, p2 = r.get("handoff_p50_ms"), r.get("handoff_p99_ms"), r.get("reacquire_p50_ms")
    claim = "reacquire_vs_pub_ack" in r
    rows = [
        _ms_row(
            r,
            "handoff",
            "P1 handoff (bus client)",
            f"{_n(r.get('handoff_vs_baseline'))}{X} NATS request-reply",
            "p50 ≤ 1.5 ms, p99 ≤ 5 ms (issue 2)",
            _met(p1 is not None and p1_99 is not None and p1 <= 1.5 and p1_99 <= 5),
        ),
        _ms_row(
            r,
            "reacquire",
            "P2 same-job re-acquire" + (" (a claim)" if claim else ""),
            f"{_n(r.get('reacquire_vs_baseline'))}{X} NATS request-reply"
            + (f", {_n(r['reacquire_vs_pub_ack'])}{X} JetStream publish+PubAck" if claim else ""),
            "p50 ≤ 1 ms (issue 2)",
            _met(p2 is not None and p2 <= 1.0),
        ),
    ]
    if "reacquire_plain_p50_ms" in r:
        rows.append(
            _ms_row(
                r,
                "reacquire_plain",
                "P2 through the orchestrator (`fast_reacquire=False`)",
                f"{_n(r.get('reacquire_plain_vs_floor'))}{X} the floor below",
                "",
                NA,
            )
        )
    for key, name in (("handoff", "P1"), ("reacquire", "P2")):
        if f"{key}_sync_p50_ms" in r:
            ratio = r.get(f"{key}_sync_vs_async")
            rows.append(
                _ms_row(
                    r,
                    f"{key}_sync",
                    f"{name} through `TimeSliceClient` (the blocking client)",
                    f"{_n(ratio)}{X} {name} (async client)",
                    f"p50 ≤ 1.25{X} the async client's (issue 25)",
                    _met(ratio is not None and ratio <= 1.25),
                )
            )
    if "grpc_handoff_p50_ms" in r:
        g50, gb = r["grpc_handoff_p50_ms"], r.get("grpc_baseline_unary_p50_ms")
        ratio = f"{_n(g50 / gb if gb else None)}{X} plain gRPC call"
        rows.append(_ms_row(r, "grpc_handoff", "P3 handoff through gRPC", ratio, "none in issues 2, 3, 6", NA))
    rows.append(_ms_row(r, "baseline_reqrep", "baseline: NATS request-reply"))
    floor = f"P1 {_n(r.get('handoff_vs_floor'))}{X}, P2 {_n(r.get('reacquire_vs_floor'))}{X} this floor"
    for key, label, ratio in (
        ("floor_js", "floor: JetStream publish → push consumer → core notice, no lock", floor),
        ("floor_pub_ack", "of it: the JetStream publish until its PubAck (a claim's floor)", ""),
        ("grpc_baseline_unary", "baseline: plain gRPC unary call", ""),
    ):
        if f"{key}_p50_ms" in r:
            rows.append(_ms_row(r, key, label, ratio))
    return [
        "Two job processes ping-pong one group through the embedded stack. P1 = job A calls `release()` → "
        "job B's pending `acquire()` returns; P2 = one job alone releases and re-acquires (IDLE_YIELDED): "
        "since nobody waited, the re-acquire is a claim, stored with the stream's sequence check and returned at "
        "its PubAck (`Acquire.claim_epoch`); through the orchestrator it waits for the grant notice instead; "
        f"P3 = the same ping-pong through the gRPC API. {r.get('samples', '?')} handoffs after a "
        f"{r.get('gap_ms', '?')} ms idle gap each; the first tenth dropped as warm-up.",
        "",
        *_cmd(r),
        *_table(["measure", "p50", "p99", "ratio to same-run baseline (p50)", "goal", "verdict"], rows),
    ]


def _load(x: dict[str, Any]) -> str:
    """A scale or recovery row's load: saturated, or paced with its hold."""
    return "saturated" if not x.get("hold_ms") else f"paced (hold {x['hold_ms']:.0f} ms)"


def _scale(r: dict[str, Any]) -> list[str]:
    rows = []
    for x in r.get("rows", []):
        load = _load(x)
        rows.append(
            [
                str(x["groups"]),
                load,
                _n(x["handoffs_per_s"], 0),
                _n(x["handoff_p50_ms"], 2, " ms"),
                _n(x["handoff_p99_ms"], 2, " ms"),
                _n(x["orch_cpu_us_per_handoff"], 0, " µs"),
                _n(x["orch_cpu_util"] * 100, 0, "%"),
                f"{_n(x['nats_cpu_us_per_handoff'], 0)} / {_n(x['loadgen_cpu_us_per_handoff'], 0)} µs",
                _n(x["bus_msgs_per_handoff"]),
                _n(x["baseline"]["publishes_per_s"], 0),
                _n(x["baseline_handoffs_per_s"], 0),
                _n(x["ratio_to_bus"]),
            ]
        )
    v = r.get("verdict", {})
    g = r.get("goals", {})
    d = r["rows"][0]["duration_s"] if r.get("rows") else "?"
    return [
        f"G groups {X} 4 jobs against one orchestrator process, {d} s measured per load after a warm-up. The load "
        "generator (`bench/_loadgen.py`, its own process) speaks the wire protocol directly: raw publishes of "
        "`Acquire`/`Release` with their `Nats-Msg-Id`, PubAcks counted but not awaited, one subscription per "
        "group for the notices. *Saturated*: a granted job releases at once and queues again; *paced*: each "
        "holder holds G / 2,100 s first (an offered load of ~2,100 handoffs/s at any G). Handoff = release "
        "published → the next job's grant seen by it. CPU from `/proc/<pid>/stat`. Baseline, same server, "
        "same run, before the orchestrator starts: G chains of JetStream publish + ack into a scratch stream; "
        "*bus limit* = those publishes/s ÷ the messages the bus stored per handoff (stream + `groups` bucket); "
        "ratio = handoffs/s ÷ bus limit.",
        "",
        *_cmd(r),
        *_table(
            [
                "groups",
                "load",
                "handoffs/s",
                "p50",
                "p99",
                "orch CPU/handoff",
                "orch CPU",
                "nats-server / load generator CPU/handoff",
                "msgs/handoff",
                "baseline publish+ack/s",
                "bus limit handoffs/s",
                "ratio",
            ],
            rows,
        ),
        f"Against issue 6 (at {v.get('largest_groups', '?')} groups): ≥ {_n(g.get('handoffs_per_s'), 0)} "
        f"handoffs/s — saturated {_n(v.get('max_handoffs_per_s'), 0)}/s, {_met(v.get('rate_goal_met'))}; "
        f"p99 ≤ {_n(g.get('p99_ms'), 0)} ms at that rate — paced p99 {_n(v.get('paced_p99_ms'), 2, ' ms')} at "
        f"{_n(v.get('paced_handoffs_per_s'), 0)}/s, {_met(v.get('p99_goal_met'))}; flat per-event cost — "
        f"orchestrator CPU per handoff at the largest G is {_n(v.get('cpu_per_handoff_growth'))}{X} that at the "
        f"smallest (goal ≤ {_n(g.get('flat_factor'), 1)}{X}), {_met(v.get('flat_goal_met'))}. "
        f"{v.get('note', '')}",
        "",
    ]


def _recovery(r: dict[str, Any]) -> list[str]:
    b = r.get("baseline", {})
    rows = []
    for x in r.get("rows", []):
        load = _load(x)
        rows.append(
            [
                _n(x["kv_keys_before_kill"], 0),
                f"{x['busy_groups']}, {load}",
                _n(x["first_grant_after_spawn_s"], 3, " s"),
                _n(x["first_grant_after_kill_s"], 3, " s"),
                _n(x["half_rate_after_spawn_s"], 3, " s"),
                _n(x["ready_after_spawn_s"], 3, " s"),
                _n(x["pre_kill_grants_per_s"], 0),
                _n(x.get("replay_backlog", {}).get("unacked_inputs"), 0),
                f"{_n(x.get('ratio_to_cold'))}{X}",
            ]
        )
    return [
        "`kill -9` of the orchestrator process while the busy groups hand off continuously (4 jobs each, raw "
        "wire protocol; *saturated*: a granted job releases at once, *paced*: each holder holds the time "
        "shown first), then an immediate restart. Groups in KV were created **by real use** (each idle group "
        "acquired and released once through the orchestrator, and their records stored before the load starts; the "
        "busy ones by their load); the bucket's key "
        "count is read just before the kill. Times are from the new process's spawn (Python start included; "
        "grants seen within 0.1 s of the spawn were published by the killed process and are not counted). "
        "Baseline, same run: the orchestrator's cold start on an empty bus (stream and buckets exist, one acquire "
        f"waiting): spawn → grant {_n(b.get('grant_s'), 3, ' s')} (spawn → ready {_n(b.get('ready_s'), 3, ' s')}; "
        f"of it, a bare interpreter importing the orchestrator takes {_n(b.get('import_s'), 3, ' s')}), "
        f"median of {b.get('reps', '?')}; ratio = first grant after the restart ÷ that. *Inputs to replay*: "
        "events delivered to the killed process but not yet acknowledged (acknowledged only once the record "
        "reflecting them is stored); the new process re-applies them, re-issuing their grants (duplicates to "
        "the jobs), before anything new can be granted.",
        "",
        *_cmd(r),
        *_table(
            [
                "groups in KV",
                "busy groups, load",
                "first grant",
                "first grant (from kill)",
                "half the pre-kill rate",
                "orchestrator ready",
                "pre-kill grants/s",
                "inputs to replay",
                "ratio to cold start",
            ],
            rows,
        ),
        f"Against issue 6: grants flow again within 1 s at 1,000 groups — {_recovery_at_1000(r)}.",
        "",
    ]


def _recovery_at_1000(r: dict[str, Any]) -> str:
    """The 1,000-group rows under each load, each against the 1 s goal (both loads are stated, not one picked)."""
    parts = []
    for x in r.get("rows", []):
        if x.get("kv_groups") is None or not 1000 <= x["kv_groups"] < 2000:
            continue
        s = x.get("first_grant_after_spawn_s")
        load = _load(x)
        backlog = x.get("replay_backlog", {}).get("unacked_inputs")
        extra = f", {_n(backlog, 0)} inputs to replay" if backlog is not None else ""
        parts.append(f"{load}: {_n(s, 3, ' s')}{extra}, {_met(s is not None and s <= 1.0)}")
    return "; ".join(parts) if parts else "not measured at 1,000 groups"


def _trace_rows(block: dict[str, Any]) -> list[list[str]]:
    def row(label: str, x: dict[str, Any], ratio: str) -> list[str]:
        return [
            label,
            _n(x["wall_s"], 0, " s"),
            _n(x["throughput_steps_per_h"], 1),
            _n(x["duty_cycle"] * 100, 1, "%"),
            _n(x["switching_share"] * 100, 1, "%"),
            ratio,
        ]

    rows = [row(f"job {i} alone (baseline)", a, NA) for i, a in enumerate(block.get("alone", []))]
    for k, f in block.get("shared", {}).items():
        speedup = f"{_n(f['speedup_vs_back_to_back'])}{X} ({_n(f['throughput_vs_one_alone'])}{X} one job's steps/h)"
        rows.append(row(f"{k} jobs sharing", f, speedup))
    return rows


# A trace profile's runs, in the order the section shows them (a table each), and the line above each table (filled
# in from the run's figures, and the profile's ``agreement``).
_TRACE_CAPTIONS = {
    "real": "Real, {steps} steps per job, time ÷ {compression:.0f}:",
    "sim": "Sim, {steps} steps per job, bus pass {hop_ms:.2f} ms; {events:,} events applied in {cpu_s:.2f} s of CPU:",
    "sim_calibrated": "Sim at the real run's steps with the bus pass calibrated from the real run ({hop_ms:.1f} ms "
    "modelled per pass): worst relative difference to real {agreement[worst_relative_diff]:.1%} (throughput, duty "
    "cycle, speedup at 2 and 3 jobs).",
}


def _trace(r: dict[str, Any]) -> list[str]:
    sw = r.get("switch", {})
    out = [
        f"Jobs follow RL phase profiles (`bench/profiles/`); switch-cost profile `{sw.get('name', '?')}`: snapshot "
        f"{_n(sw.get('snapshot_s'), 3, ' s')}, restore {_n(sw.get('restore_s'), 3, ' s')} per switch. *real*: "
        "the real stack (orchestrator, agent, one process per job registered through `register_workload` with "
        "a `CallbackHandler` whose suspend/resume take the modelled time), all durations compressed; the "
        "stack's own overhead is not compressed, so it weighs that factor more in modelled time. *sim*: the "
        "same schedules folded through the pure core with a simulated agent in simulated time. Baseline: each "
        "job alone; ratio: the shared run's speedup over the same jobs run back to back. Times are modelled "
        "seconds. Duty cycle = time some job holds the group ÷ wall time; switching = another job's release → "
        "the next grant. Issue 6 names no numeric goal for these figures.",
        "",
        *_cmd(r),
    ]
    for name, p in r.get("profiles", {}).items():
        out += [f"### {name}", "", p.get("description", ""), ""]
        head = ["run", "wall", "steps/h", "duty cycle", "lost to switching", "speedup vs back to back"]
        for mode, caption in _TRACE_CAPTIONS.items():
            if mode in p:
                text = caption.format_map({**p[mode], "agreement": p.get("agreement")})
                out += [text, "", *_table(head, _trace_rows(p[mode]))]
    if pool := pool_markdown(r):  # the multi-pool profiles of the same run: a section of their own
        out += [f"## {POOL_TITLE}", "", *pool]
    return out


def _demo(r: dict[str, Any] | None) -> list[str]:
    if r is None:
        return [
            "`timeslice demo` not run: no `bench/results/demo.json` (write it with "
            "`timeslice demo -o bench/results/demo.json`).",
            "",
        ]
    ratio = r.get("ratio")
    return [
        f"`timeslice demo`: {r.get('jobs', '?')} jobs {X} {r.get('steps', '?')} steps, {r.get('backend', '?')} model. "
        f"Shared wall time {_n(r.get('shared_s'), 2, ' s')} vs back to back {_n(r.get('back_to_back_s'), 2, ' s')} "
        f"(the same-run baseline): ratio {_n(ratio)} — goal < 0.8 (issue 6) "
        f"{_met(ratio is not None and ratio < 0.8)}; final weights bit-identical to the solo runs: "
        f"{_n(r.get('all_identical'))}.",
        "",
        "```",
        f"timeslice demo --jobs {r.get('jobs', '?')} --steps {r.get('steps', '?')} -o bench/results/demo.json",
        "```",
        "",
        *_demo_lock(r.get("shared_lock")),
    ]


def _demo_lock(lock: dict[str, Any] | None) -> list[str]:
    """The shared run's lock figures (from `timeslice replay` over the run's window, as the demo reports them)."""
    if not lock:
        return []
    figures = [
        f"duty cycle {_n(100 * lock['duty_cycle'], 0)}%",
        f"{_n(lock.get('grants'), 0)} grants",
        f"{_n(lock.get('handoffs'), 0)} handoffs (p50 {_n(lock.get('handoff_p50_ms'), 1, ' ms')} release → next "
        "grant, the offload and restore included)",
        f"waits p50 {_n(lock.get('wait_p50_ms'), 1, ' ms')}",
        f"snapshot p50 {_n(lock.get('snapshot_p50_ms'), 1, ' ms')} at {_n(lock.get('snapshot_gbps'), 2, ' GB/s')}",
        f"restore p50 {_n(lock.get('restore_p50_ms'), 1, ' ms')} at {_n(lock.get('restore_gbps'), 2, ' GB/s')}",
        f"faults {_n(lock.get('faults'), 0)}",
        f"invariant violations {_n(lock.get('violations'), 0)}",
    ]
    return [f"Shared run, from the stream: {', '.join(figures)}.", ""]


def _bind_cost(r: dict[str, Any]) -> list[str]:
    f = r.get("first_acquire_ms", {})
    on, off = f.get("bind", {}), f.get("no_bind", {})
    return [
        "What binding a job's process to its node's agent (`bind_process`, on by default: a job without a handler "
        "gets the node's default backend) adds to its first acquire. Fresh clients in fresh groups, bind on and off "
        "alternating; the agent's default backend is `noop`, so every bind registers the job (the path a `cuda` node "
        "takes, without a GPU). Later acquires do not bind again.",
        "",
        *_cmd(r),
        *_table(
            ["first acquire", "p50", "p95", "p50 vs no bind"],
            [
                ["bind off (baseline)", _n(off.get("p50"), 2, " ms"), _n(off.get("p95"), 2, " ms"), "1.00x"],
                ["bind on", _n(on.get("p50"), 2, " ms"), _n(on.get("p95"), 2, " ms"), _n(r.get("ratio_p50"), 2, "x")],
            ],
        ),
        f"Bound: {_n(r.get('bound'), 0)} of {_n(r.get('trials'), 0)} trials with bind on. The difference is the "
        "socket proof and the registration (the agent stores the job and announces it through the stream), once per "
        "job process.",
        "",
    ]


SECTIONS: dict[str, tuple[str, Callable[[dict[str, Any]], list[str]]]] = {
    "handoff": ("Handoff (bench/handoff.py)", _handoff),
    "handoff_auth": ("Handoff with auth and TLS (bench/handoff_auth.py)", _handoff_auth),
    "bind_cost": ("Binding a process to its agent (bench/bind_cost.py)", _bind_cost),
    "offload": ("Offload (bench/offload.py)", _offload),
    "busy_suspend": ("Suspend beside a busy thread (bench/busy_suspend.py)", _busy_suspend),
    "grant_on_restore": ("Grant on restore (bench/grant_on_restore.py)", _grant_on_restore),
    "precopy": ("Pre-copy while idle (bench/precopy.py)", _precopy),
    "scale": ("Scale (bench/scale.py)", _scale),
    "recovery": ("Recovery (bench/recovery.py)", _recovery),
    "failover": ("Failover (bench/failover.py)", _failover),
    "stream_leader": ("NATS stream leader loss (bench/stream_leader.py)", _stream_leader),
    "chaos": ("Chaos (bench/chaos.py)", _chaos),
    "chaos_policies": ("Chaos with the scheduling policies on (bench/chaos.py)", _chaos_policies),
    "trace_replay": ("Trace replay (bench/trace_replay.py)", _trace),
}


def render(
    results: dict[str, dict[str, Any]], *, generator: str, quick: bool, failures: dict[str, str] | None = None
) -> str:
    """The whole of docs/benchmarks.md."""
    failures = failures or {}
    results_here = {n: r for n, r in results.items() if not n.startswith(("gpu_check", "offload_gpu"))}
    machines = [r["machine"] for r in results_here.values() if isinstance(r.get("machine"), dict)]
    m = machines[0] if machines else {}
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{generator}` from `bench/results/*.json`; do not edit by hand (the lab diary, written by "
        "hand, is `bench/NOTES.md`, linked at the end). Every figure comes with the command that produced it and a "
        "baseline measured **in the same run** on the same machine; ratios to that baseline are the comparable "
        "figures across machines and runs.",
        "",
    ]
    loads = [
        r["machine"]["loadavg_1m"]
        for r in results_here.values()
        if isinstance(r.get("machine"), dict) and isinstance(r["machine"].get("loadavg_1m"), int | float)
    ]
    if loads and max(loads) > BUSY_LOAD:
        lines += [
            f"**Some runs below were made while other work loaded this {m.get('cores', '?')}-core machine "
            f"(1-min load average up to {max(loads):.1f} at their start): latencies and rates are pessimistic; "
            "take the figures again on a quiet machine before quoting them.**",
            "",
        ]
    if quick:
        lines += [
            "**This is a quick pass (`--quick`): short runs, for checking the pipeline, not figures to quote.**",
            "",
        ]
    lines += [
        f"Machine: {m.get('cores', '?')} cores ({m.get('cpu_model', '?')}), {m.get('memory_gb', '?')} GB, "
        f"Python {m.get('python', '?')}, {m.get('nats_server', 'nats-server ?')}, nats-py {m.get('nats_py', '?')}, "
        f"{m.get('platform', '?')}; no GPU unless the GPU section says otherwise. Load averages are given per run "
        "(other work on the machine moves latencies).",
        "",
    ]
    for name in ORDER:
        title, fn = SECTIONS[name]
        lines += [f"## {title}", ""]
        if name in results:
            try:
                lines += fn(results[name])
            except (KeyError, TypeError, ValueError) as exc:
                lines += [f"The result file `bench/results/{name}.json` could not be read ({exc!r}).", ""]
        elif name in failures:
            lines += [f"Not measured in this pass: the run failed ({failures[name]}).", ""]
        else:
            lines += ["Not measured in this pass (no `bench/results/" + name + ".json`).", ""]
    lines += ["## GPU (bench/gpu_check.py)", "", *_gpu(results)]
    lines += ["## Demo (`timeslice demo`)", "", *_demo(results.get("demo"))]
    if NOTES.exists():
        lines += [
            "## The lab diary",
            "",
            "How these figures came about is in the hand-written lab diary, "
            "[`bench/NOTES.md`](../bench/NOTES.md): earlier runs and their spread, where a handoff's and a "
            "switch's time goes, the changes that did and did not help, this VM's memory effects on CPU "
            "restores, and how the GPU runs were made (and what went wrong in the first of them, fixed since). "
            "No run regenerates it, and its figures come from the runs it names, not from the tables above.",
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"
