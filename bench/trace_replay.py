"""RL jobs following phase profiles share one group: duty cycle and throughput, shared vs alone.

Profiles (``bench/profiles/``): ``grpo_sync`` (sync GRPO: ~20 s generation, ~10 s reward on CPU,
~15 s train per step), ``async_longcot`` (25-40 s on the accelerators, 5-20 s CPU gaps), and the
switch-cost profile ``switch_7b_pcie`` (bytes per job and offload/restore bandwidth → snapshot and
restore seconds). Each job draws its step durations from the profile with its own seed, so job i
follows the same schedule in every run and mode.

Modes (``--mode``, default ``both``):

* ``real``: the real stack (private nats-server, the orchestrator and a node agent, each its own
  process) and one process per job (``bench/_trace_job.py``): ``acquire``/``release`` around every
  accelerator phase, registered with the agent through ``register_workload`` with a
  ``CallbackHandler`` whose suspend/resume take the modelled snapshot/restore time; every duration
  divided by ``--compression`` (default 100). The stack's own overhead (a few ms per switch) is not
  compressed, so in modelled time it weighs ``--compression`` times more than it would for real;
* ``sim``: the same schedules folded through the pure core (``timeslice_orchestrator.core.apply``)
  with a simulated agent, in simulated time (``bench/_trace_sim.py``): ``--sim-steps`` steps per job
  (default 80: about an hour per job) in well under a second, each bus pass ``--hop-ms`` (default
  0.6 ms, one pass measured on the dev machine);
* ``both``: real, then sim twice: at ``--sim-steps`` with ``--hop-ms``, and at the real run's steps
  with the bus pass calibrated from the real run (its median switch minus the modelled snapshot and
  restore, over the 6 passes of a switch, in modelled time), to show how far the two agree.

Multi-pool profiles (``--pool-profiles``, default ``verl_sync_disagg,verl_async_disagg``: modelled on the reference
project's published veRL runs, not recorded): jobs holding a trainer pool and a sampler pool in turn, one core record
per pool (``bench/_trace_pools.py``), in sim mode (``--pool-mode``, default ``sim``; ``real``: the real stack with an
agent per pool, FIFO, grant on restore, pre-copy and the predictive restore (not priority, quantum, min_hold),
``--pool-real-steps`` steps at ``--pool-compression``: ``bench/_trace_pool_real.py``), per cost model (``--costs``:
``published``, the published checkpoint/restore medians; ``pcie``, the state's bytes over 55 GB/s each way) and policy
(``--policies``: ``fifo``, ``room``: grant on restore, ``precopy``: FIFO with pre-copy while idle, ``room_precopy``:
both, ``predict``: FIFO with the predictive restore (``SetPolicy.predict``, set as ``timeslice set-policy --predict``
sets it), ``room_predict``: grant on restore, pre-copy and the predictive restore, ``predict_phase`` and
``room_predict_phase``: the same two with each job's phase starts published too (sim mode only; not run unless
named), ``priority``: classes,
``quantum``: ``--quantum-s``, ``min_hold``: ``--min-hold-s``, not run unless named): jobs 0 and 1 alone and the two
sharing, the makespan, each pool's duty, the switches, and the switch time on the critical path split into snapshot,
restore and lock/bus, beside the published figures (``bench/_trace_pool_report.py``).

For 1 job alone (each of jobs 0..2: the baseline), 2 and 3 jobs sharing: wall time, throughput
(steps per modelled hour), accelerator duty cycle (time some job holds the group / wall time), the
share of wall time lost to switching (another job's release → the next grant), and the shared run's
speedup over the same jobs run back to back. Run:
``python bench/trace_replay.py [--mode both] [--steps 8] [--compression 100] [--quick] [--json-out FILE]
[--pool-profiles verl_sync_disagg,verl_async_disagg] [--costs published,pcie] [--policies fifo,room,predict]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import _common as c
from _trace_jobs import run_trace_jobs
from _trace_model import Log, Step, compare, figures, load_profile, load_switch, resolve, schedule
from _trace_pool_real import REAL_POLICIES, run_real_pools
from _trace_pool_report import parse_policies, print_pool_profile, run_pool_profile
from _trace_pools import Policy
from _trace_sim import simulate

JOB_SCRIPT = c.BENCH / "_trace_job.py"
NODE = "trace"
SHARED = (2, 3)
SWITCH_PASSES = 6  # release, snapshot command, its result, restore command, its result, grant


def _runs() -> list[tuple[str, list[int]]]:
    return [(f"alone{i}", [i]) for i in range(max(SHARED))] + [(f"shared{k}", list(range(k))) for k in SHARED]


def _summarise(logs: dict[str, Log], steps: int) -> dict[str, Any]:
    alone = [figures(logs[f"alone{i}"], steps) for i in range(max(SHARED))]
    out: dict[str, Any] = {"steps": steps, "alone": alone, "shared": {}}
    for k in SHARED:
        f = figures(logs[f"shared{k}"], steps)
        f.update(compare(alone, f))
        out["shared"][str(k)] = f
    return out


# ---------------------------------------------------------------------- sim


def run_sim(profile: str, switch: str, steps: int, hop_s: float) -> dict[str, Any]:
    prof, sw = load_profile(profile), load_switch(switch)
    logs: dict[str, Log] = {}
    events = 0
    t = time.process_time()
    for tag, jobs in _runs():
        scheds: dict[str, list[Step]] = {f"j{i}": schedule(prof, steps, i) for i in jobs}
        logs[tag], n = simulate(scheds, sw, hop_s, group=f"sim-{tag}")
        events += n
    out = _summarise(logs, steps)
    out.update(hop_ms=hop_s * 1000, events=events, cpu_s=time.process_time() - t)
    return out


# ---------------------------------------------------------------------- real


async def _agent_up(js: Any, proc: Any, timeout: float = 60.0) -> None:
    from timeslice_client.protocol import AGENTS_BUCKET

    kv = await js.key_value(AGENTS_BUCKET)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited with {proc.returncode}")
        try:
            if (await kv.get(NODE)).value:
                return
        except Exception:
            pass  # no heartbeat yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"the agent did not announce itself within {timeout} s")
        await asyncio.sleep(0.05)  # polling the agent's first heartbeat, bounded by the deadline


async def run_real(profiles: list[str], switch: str, steps: int, compression: float) -> dict[str, dict[str, Any]]:
    """One stack for every profile and run; distinct group and job ids per run."""
    import subprocess

    from timeslice_client.bus import connect
    from timeslice_orchestrator.embedded import NatsServer

    tmp = c.scratch_dir("ts-trace-")
    server = NatsServer(tmp / "nats")
    url = server.start()
    orch = c.Orchestrator(url, tmp / "orchestrator.log")
    agent: subprocess.Popen[bytes] | None = None
    out: dict[str, dict[str, Any]] = {}
    try:
        nc = await connect(url)
        js = nc.jetstream()
        orch.start()
        await orch.wait_ready(js)
        agent = c.start_agent(url, NODE, tmp / "agent.log")
        await _agent_up(js, agent)
        for prof in profiles:
            name = load_profile(prof).name
            logs: dict[str, Log] = {}
            handler: dict[str, float] = {"suspend": 0.0, "resume": 0.0}
            for tag, jobs in _runs():
                run_id = f"{name}-{tag}"
                flags = c.flags(url=url, group=run_id, node=NODE, profile=resolve(prof), switch=resolve(switch))
                flags += c.flags(steps=steps, compression=compression)
                timeout = 120 + steps * 200 / compression * 2
                results = await run_trace_jobs(JOB_SCRIPT, nc, tmp, run_id, jobs, flags, timeout, "trace job")
                logs[tag] = {}
                for i, r in zip(jobs, results, strict=True):
                    logs[tag][f"j{i}"] = [(k, t) for k, t in r["log"]]
                    for k2 in handler:
                        handler[k2] += r["handler_s"][k2]
            summary = _summarise(logs, steps)
            summary.update(compression=compression, handler_s=handler)
            out[prof] = summary
        await nc.close()
    finally:
        if agent is not None:
            c.stop_procs([agent])
        orch.stop()
        server.stop()
    c.remove_dir(tmp)
    return out


def _calibrated_hop_s(real: dict[str, Any], switch: str) -> float:
    """Modelled seconds per bus pass that make the sim's switches as long as the real run's."""
    sw = load_switch(switch)
    medians = [real["shared"][str(k)]["switch_median_s"] for k in SHARED if real["shared"][str(k)]["switches"]]
    if not medians:
        return 0.0
    overhead = statistics.median(medians) - sw.snapshot_s - sw.restore_s
    return float(max(0.0, overhead / SWITCH_PASSES))


def _agreement(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in SHARED:
        r, s = real["shared"][str(k)], sim["shared"][str(k)]
        out[str(k)] = {
            m: (s[m] - r[m]) / r[m] if r[m] else 0.0
            for m in ("throughput_steps_per_h", "duty_cycle", "speedup_vs_back_to_back")
        }
        out[str(k)]["switching_share_diff"] = s["switching_share"] - r["switching_share"]
    worst = max(abs(v) for d in out.values() for m, v in d.items() if m != "switching_share_diff")
    out["worst_relative_diff"] = worst
    return out


# ---------------------------------------------------------------------- report


def _table(title: str, block: dict[str, Any]) -> None:
    print(f"  {title}")
    print(
        f"    {'run':<10} {'wall (model s)':>15} {'steps/h':>8} {'duty':>6} {'switching':>10} {'switches':>9} "
        f"{'vs back-to-back':>16}"
    )
    for i, a in enumerate(block["alone"]):
        print(
            f"    {'alone j' + str(i):<10} {a['wall_s']:>15.0f} {a['throughput_steps_per_h']:>8.1f} "
            f"{a['duty_cycle'] * 100:>5.1f}% {a['switching_share'] * 100:>9.1f}% {a['switches']:>9}"
        )
    for k, f in block["shared"].items():
        print(
            f"    {k + ' shared':<10} {f['wall_s']:>15.0f} {f['throughput_steps_per_h']:>8.1f} "
            f"{f['duty_cycle'] * 100:>5.1f}% {f['switching_share'] * 100:>9.1f}% {f['switches']:>9} "
            f"{f['speedup_vs_back_to_back']:>15.2f}x"
        )


def print_report(res: dict[str, Any]) -> None:
    sw = res["switch"]
    print(
        f"trace replay: switch profile {sw['name']}: snapshot {sw['snapshot_s']:.3f} s, restore "
        f"{sw['restore_s']:.3f} s per switch ({res['machine']['cores']} cores, load {res['machine']['loadavg_1m']})"
    )
    for name, p in res["profiles"].items():
        print(f"{name}: {p['description'][:110]}...")
        if "real" in p:
            _table(
                f"real: {p['real']['steps']} steps/job through the stack, time x1/{p['real']['compression']:.0f}",
                p["real"],
            )
        if "sim" in p:
            s = p["sim"]
            _table(
                f"sim: {s['steps']} steps/job, bus pass {s['hop_ms']:.2f} ms, {s['events']} events in "
                f"{s['cpu_s']:.2f} s CPU",
                s,
            )
        if "sim_calibrated" in p:
            s = p["sim_calibrated"]
            _table(f"sim at the real run's steps, bus pass calibrated from it: {s['hop_ms']:.1f} ms (modelled)", s)
            print(
                f"    real vs calibrated sim: worst relative difference {p['agreement']['worst_relative_diff']:.1%} "
                f"(throughput, duty cycle, speedup at 2 and 3 jobs)"
            )
        print("    baseline: each job alone; ratio: the shared run's speedup over the same jobs back to back")
    for name, p in res.get("pool_profiles", {}).items():
        print_pool_profile(name, p)


def pool_block(names: list[str], costs: list[str], policies: list[Policy], a: argparse.Namespace) -> dict[str, Any]:
    """The multi-pool profiles: sim at their steps; real (fifo, room, pre-copies, predictive restores) and sim at the
    real run's steps."""
    out: dict[str, Any] = {}
    hop_s = a.hop_ms / 1000
    if a.pool_mode != "real":
        for n in names:
            out[load_profile(n).name] = run_pool_profile(
                n, costs, policies, hop_s, a.quantum_s, a.pool_steps, a.min_hold_s
            )
    if a.pool_mode != "sim":
        real_pols = [p for p in REAL_POLICIES if p in policies] or list(REAL_POLICIES)
        real_costs = [cm for cm in a.pool_real_costs.split(",") if cm.strip() and cm.strip() in costs]
        real = asyncio.run(run_real_pools(names, real_costs, real_pols, a.pool_real_steps, a.pool_compression))
        for n in names:
            name = load_profile(n).name
            same = run_pool_profile(n, real_costs, list(real_pols), hop_s, a.quantum_s, a.pool_real_steps)
            entry = out.setdefault(name, {k: v for k, v in same.items() if k != "sim"})
            entry["real"] = {
                "steps": a.pool_real_steps,
                "jobs": 2,
                "compression": a.pool_compression,
                "policies": real_pols,
                "runs": real.get(name, {}),
            }
            entry["sim_same_steps"] = same["sim"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("real", "sim", "both"), default="both")
    p.add_argument("--profiles", default="grpo_sync,async_longcot", help="comma-separated profile names or paths")
    p.add_argument("--switch", default="switch_7b_pcie", help="switch-cost profile name or path")
    p.add_argument("--steps", type=int, default=8, help="steps per job in real mode")
    p.add_argument("--sim-steps", type=int, default=80, help="steps per job in sim mode")
    p.add_argument("--compression", type=float, default=100.0, help="real mode: durations divided by this")
    p.add_argument("--hop-ms", type=float, default=0.6, help="sim mode: one bus pass, modelled ms")
    p.add_argument("--quick", action="store_true", help="few steps, more compression")
    p.add_argument(
        "--pool-profiles",
        default="verl_sync_disagg,verl_async_disagg",
        help="comma-separated multi-pool profiles, sim mode only ('' for none)",
    )
    p.add_argument("--costs", default="published,pcie", help="multi-pool profiles: the cost models to run")
    p.add_argument(
        "--policies",
        default="fifo,room,precopy,room_precopy,predict,room_predict,predict_phase,room_predict_phase,priority,quantum",
        help="multi-pool profiles: the policies to run",
    )
    p.add_argument("--quantum-s", type=float, default=120.0, help="multi-pool profiles: the quantum policy's quantum")
    p.add_argument(
        "--min-hold-s", type=float, default=30.0, help="multi-pool profiles: the min_hold policy's minimum hold"
    )
    p.add_argument(
        "--pool-steps", type=int, default=0, help="multi-pool profiles: steps per job (0: the profile's published)"
    )
    p.add_argument(
        "--pool-mode",
        choices=("sim", "real", "both"),
        default="sim",
        help="multi-pool profiles: sim (default), real (the stack: fifo, room, precopy, room_precopy, predict, "
        "room_predict), or both",
    )
    p.add_argument("--pool-real-steps", type=int, default=10, help="multi-pool profiles, real mode: steps per job")
    p.add_argument(
        "--pool-compression",
        type=float,
        default=200.0,
        help="multi-pool profiles, real mode: durations divided by this (200: the published restores take 12.5 and "
        "46 ms, several times the stack's own few ms a switch)",
    )
    p.add_argument(
        "--pool-real-costs",
        default="published",
        help="multi-pool profiles, real mode: the cost models to run through the stack (of --costs; the PCIe floor's "
        "copies, compressed, take less than the stack's own overhead, so by default only the published costs)",
    )
    p.add_argument("--json-out", help="write the result as JSON here")
    a = p.parse_args()
    if a.quick:
        a.steps, a.sim_steps, a.compression = min(a.steps, 2), min(a.sim_steps, 20), max(a.compression, 200.0)
        a.pool_real_steps = min(a.pool_real_steps, 2)
    if a.steps < 1 or a.sim_steps < 1 or a.compression <= 0:
        p.error("--steps, --sim-steps and --compression must be positive")
    profiles = [x for x in a.profiles.split(",") if x.strip()]
    pool_profiles = [x.strip() for x in a.pool_profiles.split(",") if x.strip()]
    costs = [x.strip() for x in a.costs.split(",") if x.strip()]
    try:
        policies = parse_policies(a.policies)
    except ValueError as e:
        p.error(str(e))
    if a.quantum_s <= 0 or a.min_hold_s <= 0 or a.pool_steps < 0 or a.pool_real_steps < 1 or a.pool_compression <= 0:
        p.error(
            "--quantum-s, --min-hold-s, --pool-real-steps and --pool-compression must be positive, --pool-steps at "
            "least 0"
        )
    sw = load_switch(a.switch)
    res: dict[str, Any] = {
        "bench": "trace_replay",
        "command": c.command_line(),
        "machine": c.machine_facts(),
        "mode": a.mode,
        "switch": {
            "name": sw.name,
            "description": sw.description,
            "bytes_per_job": sw.bytes_per_job,
            "snapshot_s": sw.snapshot_s,
            "restore_s": sw.restore_s,
        },
        "profiles": {},
    }
    real = asyncio.run(run_real(profiles, a.switch, a.steps, a.compression)) if a.mode != "sim" else {}
    for prof in profiles:
        pr = load_profile(prof)
        entry: dict[str, Any] = {
            "description": pr.description,
            "phases": [[ph.name, ph.on, ph.min_s, ph.max_s] for ph in pr.phases],
        }
        if prof in real:
            entry["real"] = real[prof]
        if a.mode != "real":
            entry["sim"] = run_sim(prof, a.switch, a.sim_steps, a.hop_ms / 1000)
        if prof in real and a.mode == "both":
            cal = run_sim(prof, a.switch, a.steps, _calibrated_hop_s(real[prof], a.switch))
            entry["sim_calibrated"] = cal
            entry["agreement"] = _agreement(real[prof], cal)
        res["profiles"][pr.name] = entry
    if pool_profiles:
        res["pool_profiles"] = pool_block(pool_profiles, costs, policies, a)
    print_report(res)
    c.write_json(a.json_out, res)


if __name__ == "__main__":
    main()
