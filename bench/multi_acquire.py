"""What taking two groups with one ``acquire_all`` costs against two single acquires (docs/multi-pool.md).

One nats-server and the orchestrator in this process; two free groups (``sampler``, ``trainer``) for each way. The
baseline is what a job did before ``acquire_all``: one client per group, ``acquire()`` on each in turn, then
``release()`` on each. The same job with one client: ``acquire_all([...])`` then ``release_all()``. Trials alternate
the two ways, so both see the same machine; each is measured with claims on (the default: a re-acquire right after a
release nobody waited for returns at the stream's PubAck) and off (every acquire answered by the orchestrator).
Prints p50/p95 of each, and the ratio to the baseline of the same run::

    python bench/multi_acquire.py [--trials 200] [--quick] [--json-out FILE]
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as c

GROUPS = ["trainer", "sampler"]


async def _trial_pair(one: Any, two: Any) -> tuple[float, float]:
    """Two single acquires, then two releases: (acquire ms, release ms)."""
    t0 = time.perf_counter()
    await one.acquire(timeout=30)
    await two.acquire(timeout=30)
    t1 = time.perf_counter()
    await two.release()
    await one.release()
    return (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000


async def _measure(url: str, trials: int, claims: bool, tag: str) -> dict[str, Any]:
    from timeslice_client import AsyncTimeSliceClient

    opts: dict[str, Any] = {"fast_reacquire": claims, "bind_process": False}
    times: dict[str, dict[str, list[float]]] = {k: {"acquire": [], "release": []} for k in ("pair", "all")}
    # Each way its own two groups, so that one way's requests never come between the other's release and its
    # next acquire (which would make that acquire's claim give way to a plain acquire).
    async with (
        AsyncTimeSliceClient(f"pair-{tag}", f"trainer-{tag}-1", url, **opts) as one,
        AsyncTimeSliceClient(f"pair-{tag}", f"sampler-{tag}-1", url, **opts) as two,
        AsyncTimeSliceClient(f"all-{tag}", f"trainer-{tag}-2", url, **opts) as multi,
    ):
        groups = [f"{g}-{tag}-2" for g in GROUPS]
        t0 = time.perf_counter()
        await multi.acquire_all(groups, timeout=30)  # the first call makes the sibling client (subscribe, flush)
        first_ms = (time.perf_counter() - t0) * 1000
        await multi.release_all()
        for i in range(trials * 2 + 2):
            pair = i % 2 == 0
            acq, rel = await (_trial_pair(one, two) if pair else _trial_all(multi, groups))
            if i >= 2:  # the first of each way warms up
                times["pair" if pair else "all"]["acquire"].append(acq)
                times["pair" if pair else "all"]["release"].append(rel)
    out: dict[str, Any] = {"first_acquire_all_ms": first_ms}
    for way, d in times.items():
        out[way] = {k: {"p50": c.pct(v, 50), "p95": c.pct(v, 95), "n": len(v)} for k, v in d.items()}
    out["ratio_acquire_p50"] = out["all"]["acquire"]["p50"] / out["pair"]["acquire"]["p50"]
    out["ratio_release_p50"] = out["all"]["release"]["p50"] / out["pair"]["release"]["p50"]
    return out


async def _trial_all(cl: Any, groups: list[str]) -> tuple[float, float]:
    """One acquire_all of both, then release_all: (acquire ms, release ms)."""
    t0 = time.perf_counter()
    await cl.acquire_all(groups, timeout=30)
    t1 = time.perf_counter()
    await cl.release_all()
    return (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000


async def run(trials: int) -> dict[str, Any]:
    from timeslice_orchestrator.embedded import NatsServer
    from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

    tmp = Path(tempfile.mkdtemp(prefix="ts-multi-", dir="/tmp"))
    server = NatsServer(tmp / "nats")
    url = await server.astart()
    orch = Orchestrator(OrchestratorConfig(nats_url=url))
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(orch.run())
            await asyncio.wait_for(orch.ready.wait(), 30)
            claims = await _measure(url, trials, True, "c")
            plain = await _measure(url, trials, False, "p")
            orch.shutdown()
    finally:
        server.stop()
        c.remove_dir(tmp)
    return {
        "command": c.command_line(),
        "machine": c.machine_facts(),
        "trials": trials,
        "claims": claims,
        "no_claims": plain,
    }


def _line(name: str, r: dict[str, Any]) -> str:
    p, a = r["pair"], r["all"]
    return (
        f"{name}: acquire two singles p50 {p['acquire']['p50']:.2f} ms p95 {p['acquire']['p95']:.2f} ms; "
        f"acquire_all p50 {a['acquire']['p50']:.2f} ms p95 {a['acquire']['p95']:.2f} ms; "
        f"ratio p50 {r['ratio_acquire_p50']:.2f}x | release two p50 {p['release']['p50']:.2f} ms, "
        f"release_all p50 {a['release']['p50']:.2f} ms, ratio {r['ratio_release_p50']:.2f}x | "
        f"first acquire_all (makes the sibling) {r['first_acquire_all_ms']:.2f} ms"
    )


def main() -> None:
    trials, json_out = c.trials_args(__doc__, trials=200, quick=10)
    r = c.loop_run(run(trials))
    print(f"{r['trials']} trials each way, 2 free groups (baseline: two single acquires, same run)")
    print(_line("claims on ", r["claims"]))
    print(_line("claims off", r["no_claims"]))
    c.write_json(json_out, r)


if __name__ == "__main__":
    main()
