"""trace_replay.py's real mode for multi-pool profiles: the jobs of ``bench/_trace_pool_job.py`` through the real stack
(a private nats-server, the orchestrator, one node agent per pool, each its own process), time-compressed.

Per policy one stack: ``fifo`` runs the agents with ``--no-overlap-restores`` (snapshot, then restore, then grant);
``room`` with the agents' default, where a restore runs beside the snapshot when the node has room for both contexts
(the handlers report 1 MB moved, so the room rule says yes on any machine) and the orchestrator grants on it;
``precopy`` and ``room_precopy`` the same with the jobs' channels pre-copying while idle (``precopy="auto"``: the
handler's ``precopy`` takes the snapshot's time, and a suspend after it only frees); ``predict`` as ``fifo`` and
``room_predict`` as ``room_precopy``, with the predictive restore: before a run's jobs start, each of its groups gets
``SetPolicy(predict=True)`` as an operator sets it (``timeslice set-policy``'s ``apply_policy``: on the group's control
subject, then the group's record read until it shows it; the orchestrator creates the record on that event, as the
simulation applies the policy at time 0). For
each profile and cost model: jobs 0 and 1 alone, then the two sharing; the jobs' logs and their handlers' operations
give the same figures as the simulation (``_trace_pools.run_figures``). The stack's own overhead (a few ms per
message) is not compressed: in modelled time it weighs the compression factor more than it would for real.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any, Literal

import _common as c
from _trace_jobs import run_trace_jobs
from _trace_model import load_profile, resolve
from _trace_pools import OpSpan, PoolRun, exclusive, holds, run_figures

JOB_SCRIPT = c.BENCH / "_trace_pool_job.py"
HANDOFF_SCRIPT = c.BENCH / "handoff.py"  # its responder and requester roles: the bare bus round trip
IDLE_RTT_N = 30  # bare round trips measured after each shared run's idle gap
RealPolicy = Literal["fifo", "room", "precopy", "room_precopy", "predict", "room_predict"]
REAL_POLICIES: tuple[RealPolicy, ...] = ("fifo", "room", "precopy", "room_precopy", "predict", "room_predict")
SERIAL: frozenset[RealPolicy] = frozenset({"fifo", "precopy", "predict"})  # the agents restore after the snapshot
PRECOPY: frozenset[RealPolicy] = frozenset({"precopy", "room_precopy", "room_predict"})
PREDICT: frozenset[RealPolicy] = frozenset({"predict", "room_predict"})


def _to_run(results: list[dict[str, Any]]) -> PoolRun:
    logs: dict[str, dict[str, list[tuple[str, float]]]] = {}
    ops: list[OpSpan] = []
    ends: dict[str, float] = {}
    for r in results:
        job = r["job"].rsplit("-", 1)[-1]
        for pool, ev in r["logs"].items():
            logs.setdefault(pool, {})[job] = [(k, float(t)) for k, t in ev]
            ends[job] = max([float(t) for k, t in ev if k == "end"] + [ends.get(job, 0.0)])
        ops.extend(OpSpan(pool, job, kind, float(s), float(e)) for pool, kind, s, e in r["ops"])
    return PoolRun(logs=logs, ops=ops, events=0, yields=0, ends=ends)


async def _one_run(
    url: str,
    nc: Any,
    tmp: Any,
    run_id: str,
    node_prefix: str,
    prof: str,
    cost: str,
    jobs: list[int],
    steps: int,
    compression: float,
    policy: RealPolicy,
) -> list[dict[str, Any]]:
    if policy in PREDICT:
        await _predict(nc, [f"{run_id}-{pool}" for pool in load_profile(prof).pools])
    precopy = policy in PRECOPY
    flags = c.flags(url=url, group_prefix=run_id, node_prefix=node_prefix, profile=resolve(prof), cost=cost)
    flags += c.flags(steps=steps, compression=compression, precopy="auto" if precopy else "never")
    timeout = 120 + 4 * 3600 / compression * 2
    return await run_trace_jobs(JOB_SCRIPT, nc, tmp, run_id, jobs, flags, timeout, "trace pool job")


def _median_hold_s(run: PoolRun, compression: float) -> float:
    """The shared run's median hold (grant to release, any pool), in real seconds: how long the stack sits idle, but
    for lease renewals, before a switch's release."""
    spans = [g1 - g0 for log in run.logs.values() for hs in holds(log).values() for g0, g1 in hs]
    return statistics.median(spans) / compression if spans else 0.0


def idle_round_trip(url: str, tmp: Path, gap_s: float, n: int = IDLE_RTT_N) -> dict[str, float]:
    """The baseline of a switch's stack overhead, measured on the same server in the same run: a bare NATS
    request-reply between two processes (``bench/handoff.py``'s requester and responder roles), each after ``gap_s``
    of idle. On a VM whose idle CPUs wake slowly, each message after a long idle costs far more than in a tight loop
    (on the development VM 5 ms a round trip after 300 ms idle against 0.6 ms after 2 ms), and a switch's messages all
    come after such an idle."""
    ready, out = tmp / "idle-responder.ready", tmp / "idle-requester.json"
    resp = c.spawn(HANDOFF_SCRIPT, "--role", "responder", "--url", url, "--out", str(ready))
    try:
        c.wait_file(ready, resp, 30, "bare round-trip responder")
        req = c.spawn(
            HANDOFF_SCRIPT, "--role", "requester", "--url", url, "--n", str(n), "--gap", str(gap_s), "--out", str(out)
        )
        if req.wait(timeout=60 + n * (gap_s + 5)):
            raise RuntimeError(f"the bare round-trip requester exited with {req.returncode}")
        rtts = [x / 1e6 for x in json.loads(out.read_text())[max(1, n // 10) :]]
    finally:
        c.stop_procs([resp])
    return {"gap_ms": gap_s * 1000, "p50_ms": statistics.median(rtts), "n": len(rtts)}


async def _predict(nc: Any, groups: list[str]) -> None:
    """Turn the predictive restore on for ``groups``, as ``timeslice set-policy --group G --predict`` does."""
    from timeslice_cli._policy import apply_policy
    from timeslice_client.protocol import SetPolicy

    for group in groups:
        await apply_policy(nc, SetPolicy(group=group, predict=True), timeout=30.0)


async def run_real_pools(
    profiles: list[str], costs: list[str], policies: list[RealPolicy], steps: int | None, compression: float
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per profile, cost model and policy: the alone runs and the shared run's figures, as in sim mode."""
    from timeslice_client.bus import connect
    from timeslice_orchestrator.embedded import NatsServer

    out: dict[str, dict[str, dict[str, Any]]] = {}
    pools = sorted({p for name in profiles for p in load_profile(name).pools})
    for policy in policies:
        tmp = c.scratch_dir("ts-trace-pools-")
        server = NatsServer(tmp / "nats")
        url = server.start()
        orch = c.Orchestrator(url, tmp / "orchestrator.log")
        node_prefix = f"trace{os.getpid()}"
        agents: list[subprocess.Popen[bytes]] = []
        try:
            nc = await connect(url)
            orch.start()
            await orch.wait_ready(nc.jetstream())
            fifo = ["--no-overlap-restores"] if policy in SERIAL else []
            for pool in pools:
                agents.append(c.start_agent(url, f"{node_prefix}-{pool}", tmp / f"agent-{pool}.log", *fifo))
            for pool, agent in zip(pools, agents, strict=True):

                def check(agent: subprocess.Popen[bytes] = agent, where: Any = tmp) -> None:
                    if agent.poll() is not None:
                        raise RuntimeError(f"an agent exited with {agent.returncode}; see {where}")

                await c.wait_agent(url, f"{node_prefix}-{pool}", 60.0, check)
            for name in profiles:
                prof = load_profile(name)
                n = steps or (prof.published.steps_per_job if prof.published else 10)
                for cost in costs:
                    if cost not in prof.costs:
                        continue
                    handler = {"suspend": 0.0, "resume": 0.0}
                    ahead = dict.fromkeys(prof.pools, 0)
                    alone = []
                    for i in (0, 1):
                        rid = f"{prof.name[:20]}-{cost}-{policy}-a{i}"
                        res = await _one_run(url, nc, tmp, rid, node_prefix, name, cost, [i], n, compression, policy)
                        alone.append(run_figures(_to_run(res), n))
                    rid = f"{prof.name[:20]}-{cost}-{policy}-s"
                    res = await _one_run(url, nc, tmp, rid, node_prefix, name, cost, [0, 1], n, compression, policy)
                    for r in res:
                        for k in handler:
                            handler[k] += r["handler_s"][k]
                        for pool, k in r["ahead"].items():
                            ahead[pool] += k
                    run = _to_run(res)
                    shared = run_figures(run, n)
                    back_to_back = sum(a["makespan_s"] for a in alone)
                    shared["speedup_vs_back_to_back"] = (
                        back_to_back / shared["makespan_s"] if shared["makespan_s"] else 0
                    )
                    block = {
                        "alone": alone,
                        "shared": shared,
                        "handler_s": handler,
                        "ahead": ahead,  # the shared run's releases that named the job expected next, per pool
                        "steps": n,
                        "exclusive": exclusive(run),  # by the jobs' logs: no two held one pool at once
                        # the bare bus round trip after the shared run's median hold of idle (same server)
                        "idle_rtt": idle_round_trip(url, tmp, _median_hold_s(run, compression)),
                    }
                    out.setdefault(prof.name, {}).setdefault(cost, {})[policy] = block
            await nc.close()
        finally:
            c.stop_procs(agents)
            orch.stop()
            server.stop()
        c.remove_dir(tmp)
    for by_cost in out.values():
        for by_pol in by_cost.values():
            fifo = by_pol.get("fifo")
            for block in by_pol.values():
                if fifo is not None and fifo["shared"]["makespan_s"]:
                    block["shared"]["makespan_vs_fifo"] = block["shared"]["makespan_s"] / fifo["shared"]["makespan_s"]
    return out
