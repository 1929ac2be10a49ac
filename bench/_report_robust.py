"""The sections of docs/benchmarks.md on what the lock holds against (``_report`` renders them): failover, the
loss of a NATS cluster's stream leader, auth and TLS on the handoff, the chaos run."""

from __future__ import annotations

from typing import Any

from _report_format import NA, _cmd, _met, _n, _table

__all__ = ["_chaos", "_chaos_policies", "_failover", "_handoff_auth", "_stream_leader"]


def _failover(r: dict[str, Any]) -> list[str]:
    def row(name: str, xs: list[float]) -> list[str]:
        if not xs:
            return [name, NA, NA, NA, "0"]
        ordered = sorted(xs)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        return [
            name,
            _n(ordered[len(ordered) // 2] * 1000, 0, " ms"),
            _n(p99 * 1000, 0, " ms"),
            _n(ordered[-1] * 1000, 0, " ms"),
            str(len(xs)),
        ]

    kills, terms, cold = r.get("standby_kill_s", []), r.get("standby_term_s", []), r.get("cold_restart_s", [])
    st = r.get("stream", {})
    kill_ok = (
        bool(kills)
        and row("", kills)[2] != NA
        and sorted(kills)[min(len(kills) - 1, round(0.99 * (len(kills) - 1)))] <= 1.5
    )
    return [
        "Two jobs hand one group back and forth without pause (`fast_reacquire=False`: every grant is the "
        "orchestrator's). Resume = fault → the first grant of an acquire sent after the fault. Baseline, same run: "
        "one orchestrator, `kill -9`, restarted at once (as a supervisor would; it too waits for the dead leader's "
        "lease, 1 s, which overlaps its ~0.7 s start). Standby: two orchestrator processes; the leader gets `kill -9` "
        "(the standby takes over once its lease expires) or SIGTERM (it stores what it decided and resigns), and is "
        "started again as the next standby. At the end the stream is folded through the core "
        f"(`StreamChecker`): {_n(st.get('grants'), 0)} grants published, {_n(st.get('fold_grants'), 0)} decided by "
        f"the fold, {_n(st.get('unpublished'), 0)} unpublished, violations {_n(r.get('violations'), 0)}.",
        "",
        *_cmd(r),
        *_table(
            ["fault", "p50", "p99", "max", "n"],
            [
                row("baseline: one orchestrator, kill -9, restarted at once", cold),
                row("standby, kill -9 of the leader", kills),
                row("standby, SIGTERM of the leader", terms),
            ],
        ),
        f"Against issue 23: grants resume within 1.5 s p99 over 20 kills — {_met(kill_ok)}; SIGTERM handover ≤ "
        f"0.3 s — {_met(bool(terms) and max(terms) <= 0.3)}; no violation — {_met(r.get('violations') == 0)}. "
        f"{_n(r.get('handoffs'), 0)} handoffs in the run.",
        "",
    ]


def _stream_leader(r: dict[str, Any]) -> list[str]:
    trials = r.get("trials", [])
    rows = [
        [
            t["killed"],
            ", ".join(t["streams_moved"]),
            _n(t["election_s"], 2, " s"),
            _n(t.get("lock_elections_s"), 2, " s"),
            _n(t["resume_s"], 2, " s"),
            _n(t["resume_s"] - t.get("lock_elections_s", t["election_s"]), 2, " s"),
        ]
        for t in trials
    ]
    over = [t["resume_s"] - t.get("lock_elections_s", t["election_s"]) for t in trials]
    st = r.get("stream", {})
    return [
        "A 3-node loopback NATS cluster (stream and buckets at 3 replicas), two orchestrators, two jobs handing one "
        "group back and forth without pause (every grant the orchestrator's). Each trial kills (SIGKILL) the server "
        "that leads the `TIMESLICE` stream. Baseline, same run: the elections, from the kill until a surviving server "
        "answers that each stream the lock writes (the stream, its records `KV_groups`, its leader's lease "
        "`KV_leader`) whose leader was there has a new one. Resume: from the kill until the first grant of an acquire "
        "sent after it. At the end the stream is "
        f"folded through the core: {_n(st.get('grants'), 0)} grants published, {_n(st.get('fold_grants'), 0)} decided "
        f"by the fold, {_n(st.get('unpublished'), 0)} unpublished, violations {_n(r.get('violations'), 0)}.",
        "",
        *_cmd(r),
        *_table(
            [
                "killed",
                "leaders it held",
                "TIMESLICE elected after",
                "TIMESLICE, KV_groups, KV_leader elected after",
                "grants resumed after",
                "resume beyond those elections",
            ],
            rows,
        ),
        f"Against issue 23: resumes within the election time + 1 s — "
        f"{_met(bool(over) and max(over) <= 1.0)} (worst {_n(max(over) if over else None, 2, ' s')}); no violation "
        f"— {_met(r.get('violations') == 0)}; orchestrators alive {r.get('orchestrators_alive')} of 2. "
        f"{_n(r.get('handoffs'), 0)} handoffs in the run.",
        "",
    ]


def _handoff_auth(r: dict[str, Any]) -> list[str]:
    rounds = "secure_round_ratios_p50" in r  # results from before the per-round ratios have none
    head = ["stack", "p50", "p99", "p50 vs plain", "p99 vs plain"] + (
        ["p50 ratio per round", "median of rounds"] if rounds else []
    )

    def row(label: str, key: str) -> list[str]:
        out = [
            label,
            _n(r.get(f"{key}_p50_ms"), 3, " ms"),
            _n(r.get(f"{key}_p99_ms"), 3, " ms"),
            _n(r.get(f"{key}_ratio_p50"), 2, "x"),
            _n(r.get(f"{key}_ratio_p99"), 2, "x"),
        ]
        if rounds:
            out += [
                " ".join(f"{x:.2f}" for x in r.get(f"{key}_round_ratios_p50", [])),
                _n(r.get(f"{key}_ratio_p50_median_of_rounds"), 2, "x"),
            ]
        return out

    plain = ["plain", _n(r.get("plain_p50_ms"), 3, " ms"), _n(r.get("plain_p99_ms"), 3, " ms"), "1.00x", "1.00x"]
    return [
        "The handoff of two job processes ping-ponging a group (as `bench/handoff.py` P1), on three stacks started "
        "in the same run: no auth; NATS with the operator-mode auth of `timeslice auth` (every process with its own "
        "credential, the permissions of its role); and auth plus TLS on every client connection. "
        + (
            "Each round runs the three stacks one after the other, in an order that turns from round to round; "
            "besides the p50 over all rounds, each round's ratio to the plain stack of the same round, and their "
            "median. Auth adds no work per message, so the spread of its round ratios around 1 is the run's noise."
            if rounds
            else "Measured in alternating rounds."
        ),
        "",
        *_cmd(r),
        *_table(head, [plain + ([""] * 2 if rounds else []), row("auth", "auth"), row("auth + TLS", "secure")]),
        f"Against issue 24: auth and TLS within 10% of the same stack without them (p50) — "
        f"{_met((r.get('secure_ratio_p50') or 9) <= 1.10)}; auth alone — "
        f"{_met((r.get('auth_ratio_p50') or 9) <= 1.10)}. "
        f"{_n(r.get('samples'), 0)} samples per stack. Where the TLS time goes, hop by hop: bench/NOTES.md "
        '("Auth and TLS again").',
        "",
        *_handoff_auth_cpu(r, rounds),
    ]


def _handoff_auth_cpu(r: dict[str, Any], rounds: bool) -> list[str]:
    """Where the time goes: CPU per handoff of each process kind, per stack (results from before it had none)."""
    keys = (("plain", "plain"), ("auth", "auth"), ("secure", "auth + TLS"))
    if not all(isinstance(r.get(f"{k}_cpu_us_per_handoff"), dict) for k, _ in keys):
        return []
    kinds = ("server", "orchestrator", "jobs")
    rows = [[label, *(_n(r[f"{k}_cpu_us_per_handoff"].get(kind), 0, " µs") for kind in kinds)] for k, label in keys]
    how = (
        "the two jobs' from connected to done, nats-server's and the orchestrator's over each round"
        if rounds
        else "the two jobs' share includes their interpreter's start, the same on each stack"
    )
    return [
        f"CPU per handoff in the same run (on a machine with few cores, CPU spent anywhere on the path is latency; "
        f"{how}):",
        "",
        *_table(["stack", "nats-server", "orchestrator", "two jobs"], rows),
    ]


def _chaos(r: dict[str, Any]) -> list[str]:
    chk = r.get("check", {})
    kinds = ", ".join(f"{k} {n}" for k, n in r.get("faults", {}).items())
    viol = chk.get("violations", [])
    by_kind: dict[str, int] = {}
    for v in viol:
        by_kind[v[0]] = by_kind.get(v[0], 0) + 1
    stall = r.get("longest_stall_s")
    return [
        "A 3-node NATS cluster (replicas 3), two orchestrator processes, one agent, job processes handing groups "
        "around (each registered with the agent; the first of each group behind a TCP proxy), while a schedule of "
        "bounded faults runs (see the script's docstring for the kinds). The stream is then checked by "
        "`timeslice check`.",
        "",
        *_cmd(r),
        *_table(
            [
                "minutes",
                "handoffs",
                "faults",
                "longest live waiter without a grant",
                "timeslice check",
                "orchestrators alive",
            ],
            [
                [
                    _n(r.get("minutes")),
                    _n(r.get("handoffs"), 0),
                    kinds,
                    _n(stall, 2, " s"),
                    f"exit {r.get('check_exit')}: {chk.get('summary', NA)}",
                    f"{r.get('orchestrators_alive')} of 2",
                ]
            ],
        ),
        "Violations by kind: " + (", ".join(f"{k} {n}" for k, n in by_kind.items()) or "none") + ". Job errors "
        f"(logged, the loops went on): {r.get('job_errors', {})}."
        + (
            f" Stale commands the agent answered without running (delivered again after its restarts): "
            f"{r['stale_commands']}."
            if "stale_commands" in r
            else ""
        ),
        f"Against issue 23: >= 10 minutes — {_met((r.get('minutes') or 0) >= 10)}; >= 5,000 handoffs — "
        f"{_met((r.get('handoffs') or 0) >= 5000)}; 0 violations — {_met(not viol)}; longest stall <= lease + 2 s "
        f"(7 s) — {_met(stall is not None and stall <= 7.0)}.",
        *_policy_lines(r),
        "",
    ]


def _policy_lines(r: dict[str, Any]) -> list[str]:
    """A run with scheduling policies: the policy every group had, and what the policies did (``timeslice replay``)."""
    if "policy" not in r:
        return []
    pol = {k: v for k, v in r["policy"].items() if k not in ("type", "group")}
    if "shares" in pol:
        pol["shares"] = "job j of each group weighs j + 1"
    said = "; ".join(f"{k} {v}" for k, v in pol.items())
    act = r.get("policy_activity")
    did = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in act.items()) if isinstance(act, dict) else str(act)
    return [
        f"Policy of groups {', '.join(r.get('policy_groups') or ['all'])}, set before the jobs started: {said}. "
        f"What the policies did over the run (`timeslice replay`, all groups): {did}."
    ]


def _chaos_policies(r: dict[str, Any]) -> list[str]:
    """The chaos run with the scheduling policies on: the same table, and the policy lines."""
    return [
        "The same harness with the scheduling policies on every group (the predictive restore, weighted fair share, a "
        "quantum and a minimum hold), each job away from the accelerators between its release and its next acquire "
        "(`--away-ms`), so that groups go idle and the predictive restore plans.",
        "",
        *_chaos(r)[2:],
    ]
