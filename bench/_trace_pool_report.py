"""trace_replay.py's multi-pool profiles (``verl_sync_disagg``, ``verl_async_disagg``): simulated runs per cost model
and policy (``bench/_trace_pools.py``), their figures beside the published ones the profile is modelled on, and the
report's text.

Per profile, cost model and policy: each of jobs 0 and 1 alone (the baseline) and the two sharing the pools; the
makespan, each pool's duty cycle (held share of the makespan, and while both jobs run), the mean over the pools, the
switches, and the switch time on the critical path (another job's release, or the incoming job's acquire if later,
to the grant) split into snapshot, restore and lock/bus. The real stack's runs of the same profiles:
``bench/_trace_pool_real.py``; this module prints both.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from _trace_model import Profile, load_profile, pool_schedule
from _trace_pools import POLICIES, POLICY_TEXT, Policy, run_figures, simulate_pools

JOBS = 2


def parse_policies(text: str) -> list[Policy]:
    out: list[Policy] = []
    for name in (x.strip() for x in text.split(",") if x.strip()):
        match = [p for p in POLICIES if p == name]
        if not match:
            raise ValueError(f"unknown policy {name!r}: one of {', '.join(POLICIES)}")
        out.append(match[0])
    return out


def _duty(fig: dict[str, Any], pool: str) -> float:
    return float(fig["mean_duty"] if pool == "mean" else fig["pools"][pool]["duty_cycle"])


def _duty_all_running(fig: dict[str, Any], pool: str) -> float:
    ps = fig["pools"]
    if pool != "mean":
        return float(ps[pool]["duty_all_running"])
    return sum(float(f["duty_all_running"]) for f in ps.values()) / len(ps) if ps else 0.0


def vs_published(prof: Profile, alone: list[dict[str, Any]], shared: dict[str, Any]) -> dict[str, Any]:
    """The simulated figures beside the published ones (None where nothing was published)."""
    pub = prof.published
    if pub is None:
        return {}
    solo = alone[0]
    return {
        "duty_pool": pub.duty_pool,
        "duty_solo": {"published": pub.duty_solo, "sim": _duty(solo, pub.duty_pool)},
        "duty_shared": {"published": pub.duty_shared, "sim": _duty(shared, pub.duty_pool)},
        "duty_shared_all_running": _duty_all_running(shared, pub.duty_pool),
        "swaps": {"published": pub.swaps, "sim": shared["switches"]},
        "solo_s": {"published": pub.solo_s, "sim": solo["makespan_s"]},
        "shared_s": {"published": pub.shared_s, "sim": shared["makespan_s"]},
    }


def run_pool_profile(
    name: str,
    costs: list[str],
    policies: list[Policy],
    hop_s: float,
    quantum_s: float,
    steps: int | None,
    min_hold_s: float = 30.0,
) -> dict[str, Any]:
    prof = load_profile(name)
    if not prof.pools:
        raise ValueError(f"profile {name} names no pools: run it with --profiles")
    n = steps or (prof.published.steps_per_job if prof.published else 10)
    scheds = {f"j{i}": pool_schedule(prof, n, i) for i in range(JOBS)}
    t = time.process_time()
    events = 0
    runs: dict[str, dict[str, Any]] = {}
    for cm in costs:
        if cm not in prof.costs:
            continue
        pools = prof.costs[cm].pools
        runs[cm] = {}
        for pol in policies:
            alone = []
            for j, sched in scheds.items():
                r = simulate_pools(
                    {j: sched}, pools, hop_s, pol, f"{prof.name}-{j}", quantum_s, prof.staleness, min_hold_s
                )
                alone.append(run_figures(r, n))
                events += r.events
            r = simulate_pools(scheds, pools, hop_s, pol, f"{prof.name}-shared", quantum_s, prof.staleness, min_hold_s)
            events += r.events
            shared = run_figures(r, n)
            back_to_back = sum(a["makespan_s"] for a in alone)
            shared["speedup_vs_back_to_back"] = back_to_back / shared["makespan_s"] if shared["makespan_s"] else 0.0
            runs[cm][pol] = {"alone": alone, "shared": shared, "vs_published": vs_published(prof, alone, shared)}
        fifo = runs[cm].get("fifo")
        for block in runs[cm].values():
            if fifo is not None:
                block["shared"]["makespan_vs_fifo"] = block["shared"]["makespan_s"] / fifo["shared"]["makespan_s"]
    return {
        "description": prof.description,
        "phases": [[ph.name, ph.on, ph.min_s, ph.max_s, list(ph.pools), ph.paced] for ph in prof.phases],
        "pools": list(prof.pools),
        "staleness": prof.staleness,
        "published": None if prof.published is None else msgspec.structs.asdict(prof.published),
        "costs": {
            cm: {
                "description": m.description,
                "pools": {
                    p: {"snapshot_s": c.snapshot, "restore_s": c.restore, "bytes_per_job": c.bytes_per_job}
                    for p, c in m.pools.items()
                },
            }
            for cm, m in prof.costs.items()
            if cm in costs
        },
        "sim": {
            "steps": n,
            "jobs": JOBS,
            "hop_ms": hop_s * 1000,
            "quantum_s": quantum_s,
            "min_hold_s": min_hold_s,
            "policies": {p: POLICY_TEXT[p] for p in policies},
            "events": events,
            "cpu_s": time.process_time() - t,
            "runs": runs,
        },
    }


def _pct(x: float) -> str:
    return f"{x * 100:5.1f}%"


def beyond_restore_ms(block: dict[str, Any], compression: float) -> float:
    """A real run's median switch beyond its incoming restore, in real milliseconds (the run's times are modelled:
    its real ones times ``compression``)."""
    return float(block["shared"].get("beyond_restore_median_s", 0.0)) / compression * 1000


def _in_rtts(block: dict[str, Any], compression: float) -> str:
    """`` (N round trips)``: a policy's median switch beyond its restore in bare bus round trips after the same idle
    (its run's ``idle_rtt``), or nothing when the run has none."""
    rtt = block.get("idle_rtt")
    if not rtt or not rtt.get("p50_ms"):
        return ""
    return f" ({beyond_restore_ms(block, compression) / rtt['p50_ms']:.1f} round trips)"


def real_notes(by_pol: dict[str, Any], compression: float) -> list[str]:
    """A real run's lines below its table: each policy's median switch beyond the incoming restore (real ms), and how
    many of the shared run's releases named the job expected next (the predictive restore's plans)."""
    beyond = ", ".join(
        f"{pol} {beyond_restore_ms(b, compression):.1f}{_in_rtts(b, compression)}" for pol, b in by_pol.items()
    )
    out = [f"Median switch beyond the incoming restore (a snapshot before it included), real ms: {beyond}."]
    rtts = [b["idle_rtt"] for b in by_pol.values() if "idle_rtt" in b]
    if rtts:
        said = ", ".join(f"{r['p50_ms']:.2f} ms after {r['gap_ms']:.0f} ms" for r in rtts)
        out.append(
            f"Baseline, same run: the bare bus round trip (NATS request-reply, two processes) after the shared run's "
            f"median hold of idle, p50 per policy: {said}. A grant on restore sends six messages on its critical path "
            "(release, command, the restore's request and answer, result, grant): three such round trips."
        )
    planned = {pol: sum(b["ahead"].values()) for pol, b in by_pol.items() if pol.endswith("predict") and "ahead" in b}
    if planned:
        said = ", ".join(f"{pol} {n}" for pol, n in planned.items())
        out.append(f"Releases of the shared run that named the job expected next (`Released.ahead`): {said}.")
    return out


def _print_runs(
    p: dict[str, Any], runs: dict[str, dict[str, Any]], mode: str, published: bool = True, compression: float = 0.0
) -> None:
    pools = p["pools"]
    for cm, by_pol in runs.items():
        costs = ", ".join(
            f"{pool} snapshot {c['snapshot_s']:.3f} s restore {c['restore_s']:.3f} s"
            for pool, c in p["costs"][cm]["pools"].items()
        )
        print(f"  {mode}, cost model {cm}: {costs}")
        head = " ".join(f"{pool + ' duty':>13}" for pool in pools)
        print(
            f"    {'run':<26} {'makespan':>9} {'vs fifo':>7} {head} {'mean':>6} {'switches':>8} "
            f"{'crit. path':>10}   median (s): switch = snapshot + restore + lock/bus"
        )
        fifo = by_pol.get("fifo") or next(iter(by_pol.values()))
        for i, a in enumerate(fifo["alone"]):
            duties = " ".join(f"{_pct(a['pools'][pool]['duty_cycle']):>13}" for pool in pools)
            print(
                f"    {'alone j' + str(i):<26} {a['makespan_s'] / 60:>7.1f} m {'':>7} {duties} {_pct(a['mean_duty'])} "
                f"{a['switches']:>8}"
            )
        for pol, block in by_pol.items():
            f = block["shared"]
            duties = " ".join(f"{_pct(f['pools'][pool]['duty_cycle']):>13}" for pool in pools)
            med = f["critical_path_median_s"]
            print(
                f"    {'shared, ' + pol:<26} {f['makespan_s'] / 60:>7.1f} m {f.get('makespan_vs_fifo', 1.0):>6.2f}x "
                f"{duties} {_pct(f['mean_duty'])} {f['switches']:>8} {f['critical_path_s']['total']:>8.1f} s   "
                f"{med['total']:.3f} = {med['snapshot']:.3f} + {med['restore']:.3f} + {med['lock_bus']:.3f}"
            )
        if compression:
            print("".join(f"    {line}\n" for line in real_notes(by_pol, compression)), end="")
        if compression and "room" in by_pol:
            ms = beyond_restore_ms(by_pol["room"], compression)
            print(
                f"    grant on restore (room): the median switch takes {ms:.1f} ms (real time) beyond the incoming "
                "restore (goal: at most 10 ms)"
            )
        vp = fifo.get("vs_published")
        if vp and published:
            pub_shared = vp["shared_s"]["published"]
            pub_solo = vp["solo_s"]["published"]
            print(
                f"    published ({vp['duty_pool']} duty): alone {_pct(vp['duty_solo']['published'])} (sim "
                f"{_pct(vp['duty_solo']['sim'])}), shared {_pct(vp['duty_shared']['published'])} (sim fifo "
                f"{_pct(vp['duty_shared']['sim'])}; {_pct(vp['duty_shared_all_running'])} while both run), "
                f"{vp['swaps']['published']} swaps (sim {vp['swaps']['sim']})"
                + (f", alone {pub_solo / 60:.0f} min (sim {vp['solo_s']['sim'] / 60:.1f})" if pub_solo else "")
                + (
                    f", shared {pub_shared / 60:.0f} min (sim fifo {vp['shared_s']['sim'] / 60:.1f})"
                    if pub_shared
                    else ""
                )
            )


# A profile's runs in the order printed: the line above each (filled in from the run's figures and the profile's
# ``pools``), the mode its rows are labelled with, and whether the published figures are set beside it.
_MODES = {
    "sim": (
        "  sim: {jobs} jobs x {steps} steps over pools {pools}, bus pass {hop_ms:.2f} ms, {events} events in "
        "{cpu_s:.2f} s CPU",
        "sim",
        True,
    ),
    "real": (
        "  real: {jobs} jobs x {steps} steps through the stack (an agent per pool), time x1/{compression:.0f}; the "
        "stack's overhead weighs {compression:.0f}x in modelled time",
        "real",
        True,
    ),
    "sim_same_steps": (
        "  sim at the real run's {steps} steps, bus pass {hop_ms:.2f} ms (for comparison)",
        "sim",
        False,
    ),
}


def print_pool_profile(name: str, p: dict[str, Any]) -> None:
    print(f"{name}: {p['description'][:110]}...")
    for mode, (heading, shown_as, published) in _MODES.items():
        if mode in p:
            print(heading.format_map({**p[mode], "pools": ", ".join(p["pools"])}))
            _print_runs(p, p[mode]["runs"], shown_as, published=published, compression=p[mode].get("compression", 0.0))
    print("    baseline: each job alone; vs fifo: the shared makespan over FIFO's with the same costs")
