"""Offload and restore of 1, 2 and 4 GiB of tensors through the ``app_channel`` torch handler, end to end.

Starts a private nats-server and the orchestrator with the node agent in its process (as ``timeslice up``
deploys them; ``--agent-process``: the agent as a process of its own, as on a node without the
orchestrator), then for each size two job processes share one group:

* job A holds the state: ``N_TENSORS`` float32 tensors (parameters of one module) of ``size`` GiB in
  all, behind :class:`TorchOffloadHandler`; job B holds 8 MiB the same way. Both register with the
  agent (``register_workload``), and call ``prepare()`` before anything is timed, so the first touch of
  the host buffers is not counted;
* cycle, first half: A releases while B waits → A's offload (begun by A's client at its release, as
  the orchestrator told A that B waits; the agent's suspend command takes it: docs/backends.md, "Early
  suspend"; ``--no-early-suspend``: begun by the command), B is resumed (nothing to move on the first
  cycle) and B's acquire returns;
  second half: B releases while A waits → B's suspend, A's restore, A's acquire returns;
* inside each worker every handler call is timed (CLOCK_MONOTONIC): offload / restore bandwidth is
  A's bytes over its handler's own time;
* switch overhead = the whole switch (the releasing job calls ``release()`` → the other job's
  ``acquire()`` returns) minus the wall time of the handler calls made during it (both jobs; the union of
  their spans, since a restore the agent overlaps with the snapshot runs beside it); the agent's
  ``OpResult`` events split it into agent-side (the time beyond its handler call of each operation on the
  critical path, i.e. both, or of two overlapped ones the one that ended last: RPC to the workload, thread
  hand-off; only the part of a call inside its operation counts) and orchestrator + bus (the rest), and
  the times the stream stored ``OpStarted``/``OpResult`` (read back after the run: nothing extra runs
  during the switches) give the hops between;
* baselines, in the same run, in the driver process, for the same bytes in the same tensor shapes,
  before that size's workers start and again after they exited (never beside their memory):
  (1) ``dst.copy_(src)`` into a preallocated, already-touched buffer (source and destination advised
  to huge pages, as the handler's buffers are); (2) a copy into freshly allocated memory, advised to
  transparent huge pages as the handler advises its re-allocations, freed and allocated again each
  rep (as offload/restore cycles free and re-allocate); (2') ``src.clone()``, fresh memory without
  that advice. On CPU a restore must re-obtain the memory its offload freed (page faults + zeroing),
  which (1) never pays; an offload frees memory, which no copy pays (the time to free is printed).
  Also, paired with each offload, (1p): job A's own plain copy of the same tensors into a touched buffer
  of its own, timed at the start of the hold before it (``bench/_offload_baselines.py``), printed as the
  median of the per-cycle ratios; the goal stays on (1).
  Medians throughout; the first cycle and the first fresh copy are also shown: they can be far
  slower (cold memory, see bench/NOTES.md);
* the switch floor, on the same server after the sizes (``bench/_switch_floor.py``): the switch's bus
  hops (release through the stream, a stored command, core requests to both workloads, the result through
  the stream, a stored grant) with no timeslice code, in the same layout as the stack (the agent stand-in
  in the orchestrator stand-in's process, or with ``--agent-process`` in its own, reached through a push
  consumer), each after the same idle gap as the hold; the switch overhead is also given as a multiple of it.

With CUDA (``--device cuda``, the default when available) A's state lives on the GPU and the handler
copies to and from a pinned host buffer; without, the "device" is CPU memory (see ``torch_offload``)
and both directions are host-to-host copies. Run: ``python bench/offload.py [--sizes 1,2,4] [--cycles 9] [--json]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import _switch_floor
from _common import loop_run as _loop_run
from _offload_analysis import HANDED_BACK_GIB
from _offload_analysis import med as _med
from _offload_analysis import ms as _ms
from _offload_analysis import size_result as _size_result
from _offload_baselines import N_TENSORS
from _offload_baselines import baselines as _baselines
from _offload_job import NODE, run_job

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
B_BYTES = 8 << 20  # B's state
GOAL_BW_RATIO = 0.8
GOAL_OVERHEAD_MS = 5.0


# ---------------------------------------------------------------------- driver


async def _stored_ops(url: str, group: str) -> list[dict[str, Any]]:
    """NODE's ``OpStarted``/``OpResult`` events of ``group``, read back from the stream once the workers are done
    (a live subscriber would be one more process woken during every switch; measured, it added 0.6-0.8 ms to the
    overhead). ``t`` is when the stream stored the event, on CLOCK_MONOTONIC as the workers record theirs."""
    from timeslice_client.bus import connect
    from timeslice_client.protocol import STREAM, subjects

    nc = await connect(url)
    ops: list[dict[str, Any]] = []
    try:
        js = nc.jetstream()
        sub = await js.subscribe(f"ts.v1.agent.{NODE}.>", stream=STREAM, ordered_consumer=True)
        to_monotonic = time.monotonic_ns() - time.time_ns()  # the same host: one offset between the two clocks
        while True:
            try:
                msg = await sub.next_msg(timeout=2)
            except TimeoutError:
                break
            if msg.subject.endswith(".op") or msg.subject == subjects.agent_event(NODE, group):
                o = json.loads(msg.data)
                if o.get("group") == group and o.get("type") in ("op_result", "op_started"):
                    stored = msg.metadata.timestamp  # datetime, microseconds
                    o["t"] = int(stored.timestamp() * 1e6) * 1000 + to_monotonic
                    ops.append(o)
            if msg.metadata.num_pending == 0:
                break
        await sub.unsubscribe()
    finally:
        await nc.close()
    return ops


def _memory_setup() -> dict[str, Any]:
    """Transparent huge page settings, and whether a virtio balloon reports free pages to the host (a VM that
    takes freed memory back: touching it again costs far more, see bench/NOTES.md)."""

    def read(path: str) -> str | None:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            return None
        chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else text
        return chosen  # "always [madvise] never" -> "madvise"

    reporting = None
    for f in Path("/sys/bus/virtio/drivers/virtio_balloon").glob("virtio*/features"):
        bits = read(str(f)) or ""
        reporting = len(bits) > 5 and bits[5] == "1"  # VIRTIO_BALLOON_F_REPORTING
    return {
        "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "free_page_reporting": reporting,
    }


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, *args], cwd=ROOT)


def run(
    sizes: list[float],
    cycles: int,
    hold_ms: float,
    reps: int,
    device: str,
    floor_n: int,
    agent_process: bool = False,
    early: bool = True,
) -> dict[str, Any]:
    import torch
    from timeslice_orchestrator.embedded import NatsServer

    started = time.monotonic()
    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="ts-bench-offload-"))
    server = NatsServer(tmp / "nats")
    url = server.start()
    env = dict(os.environ, TIMESLICE_LOG_LEVEL="warning")
    orchestrator = [sys.executable, "-m", "timeslice_orchestrator", "orchestrator", "--nats-url", url]
    procs: list[subprocess.Popen[bytes]] = (
        [
            subprocess.Popen(orchestrator, env=env),
            subprocess.Popen(
                [sys.executable, "-m", "timeslice_agent", "--node-id", NODE, "--nats-url", url],
                env=env,
                stderr=subprocess.DEVNULL,
            ),
        ]
        if agent_process
        else [subprocess.Popen([*orchestrator, "--with-agent", NODE], env=env)]
    )
    results = []
    floor: dict[str, Any] | None = None
    try:
        _loop_run(_common.wait_agent(url, NODE))
        for i, size in enumerate(sizes):
            nbytes = int(size * GiB) // (4 * N_TENSORS) * (4 * N_TENSORS)
            group = f"offload-{i}"
            before = _baselines(nbytes, reps, device)  # before A and B start, and again after they exited
            common = [
                "--url",
                url,
                "--group",
                group,
                "--cycles",
                str(cycles),
                "--hold",
                str(hold_ms / 1000),
                "--device",
                device,
            ]
            a_out, b_out, a_ready, b_ready = (tmp / f"{i}-{n}" for n in ("a.json", "b.json", "a.ready", "b.ready"))
            common += ["--done", str(tmp / f"{i}-a.done")] + ([] if early else ["--no-early-suspend"])
            # Job ids differ per size: the agent keys jobs by id alone (see bench/NOTES.md).
            a = _spawn(
                "--role",
                "job",
                "--job",
                f"job-a{i}",
                "--bytes",
                str(nbytes),
                "--leader",
                "--out",
                str(a_out),
                "--ready",
                str(a_ready),
                *common,
            )
            procs.append(a)
            _common.wait_file(a_ready, a, 120)  # A allocated, prepared, registered and holds the group
            b = _spawn(
                "--role",
                "job",
                "--job",
                f"job-b{i}",
                "--bytes",
                str(B_BYTES),
                "--out",
                str(b_out),
                "--ready",
                str(b_ready),
                *common,
            )
            procs.append(b)
            a.wait()
            b.wait()
            if a.returncode or b.returncode:
                raise RuntimeError(f"a worker failed (A: {a.returncode}, B: {b.returncode})")
            after = _baselines(nbytes, reps, device)
            base = {k: v + after[k] for k, v in before.items()}
            ops = _loop_run(_stored_ops(url, group))
            r = _size_result(nbytes, json.loads(a_out.read_text()), json.loads(b_out.read_text()), ops, group, base)
            for when, b_ in (("before", before), ("after", after)):
                r[f"base_copy_{when}_gbps"] = nbytes / 1e9 / _med(b_["copy"])
                r[f"base_fresh_{when}_gbps"] = nbytes / 1e9 / _med(b_["fresh"])
            r["loadavg_1m_after"] = os.getloadavg()[0]
            results.append(r)
        floor = _switch_floor.measure(url, floor_n, hold_ms, colocated=not agent_process) if floor_n else None
        for r in results:
            r["overhead_vs_floor"] = r["overhead_ms"] / floor["p50_ms"] if floor else None
    finally:
        _common.stop_procs(procs)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/offload.py", *sys.argv[1:]]),
        "device": device if device == "cuda" else "cpu (CPU memory stands in for the device)",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "cycles": cycles,
        "hold_ms": hold_ms,
        "baseline_reps": reps,
        "memory": _memory_setup(),
        "agent": "own process" if agent_process else "in the orchestrator's process",
        "early_suspend": early,
        "sizes": results,
        "switch_floor": floor,
        "wall_s": time.monotonic() - started,
    }


def _handed_back_line(r: dict[str, Any]) -> str | None:
    """Which of A's calls ran while the guest handed free memory back to its host (where the kernel counts it)."""
    parts = []
    for k, calls in (("restore", "restores"), ("offload", "offloads")):
        h = r.get(f"{k}_handed_back")
        if h is None:
            return None
        part = f"{h['during']} of the {h['calls']} later {calls}"
        if h["during"]:
            part += f" (median {h['during_ms']:.0f} ms; the others {h['others_ms']:.0f} ms)"
        parts.append(part)
    return (
        "  the guest handed memory back to its host (free page reporting, >= "
        f"{HANDED_BACK_GIB * 1024:.0f} MiB) during {parts[0]}, {parts[1]} (the first cycle left out)"
    )


def _print(res: dict[str, Any]) -> None:
    la, le = res["loadavg_start"], res["loadavg_end"]
    print(f"offload/restore through the app_channel torch handler, end to end; {res['date']}")
    print(f"  command: {res['command']}")
    print(
        f"  device: {res['device']}; torch {res['torch']}, {res['threads']} threads, {res['cpus']} CPUs; "
        f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} at start, {le[0]:.2f} {le[1]:.2f} {le[2]:.2f} at end"
    )
    m = res["memory"]
    rep = {True: "ON (freed memory goes back to the host; touching it again is slow)", False: "off", None: "no balloon"}
    print(
        f"  transparent huge pages: enabled {m['thp_enabled']}, defrag {m['thp_defrag']}; virtio-balloon free page "
        f"reporting: {rep[m['free_page_reporting']]}"
    )
    print(f"  the node agent runs {res.get('agent', 'in its own process')}")
    print(
        f"  {res['cycles']} cycles per size, medians; host buffers prepared (allocated and touched) before "
        "timing, so their first touch is not counted"
    )
    print("  bandwidth = bytes / the handler's own time, timed inside the worker; GB = 1e9 bytes")
    print(
        f"  baselines in the same run, same bytes and tensor shapes, {res['baseline_reps']} reps each before that "
        "size's workers start and again after they exited (never beside their memory); medians of both:"
    )
    if res["device"] == "cuda":
        print("    (1) copy  = device tensors -> preallocated pinned host buffer, dst.copy_(src)")
        print("    (2) fresh = pinned host buffer -> newly allocated device memory (after empty_cache(), as the")
        print("        handler frees), freed each rep")
        print("    (2') clone = src.to('cpu'): device -> fresh pageable host memory")
    else:
        print("    (1) copy  = dst.copy_(src), dst preallocated and touched (src and dst advised to huge pages, as")
        print("        the handler's host buffer and re-allocated tensors are)")
        print("    (2) fresh = torch.empty + MADV_HUGEPAGE (as the handler re-allocates) + copy_, freed each rep:")
        print("        new memory from the OS, faulted and zeroed")
        print("    (2') clone = src.clone(): fresh memory without huge-page advice")
    for r in res["sizes"]:
        print(
            f"{r['gib']:g} GiB ({r['bytes'] / 1e9:.2f} GB) in {N_TENSORS} float32 tensors; "
            f"1-min load average after: {r['loadavg_1m_after']:.2f}"
        )
        for k, what, sw in (("offload", "A->B", "ab"), ("restore", "B->A", "ba")):
            per = ", ".join(f"{x * 1e3:.0f}" for x in r[f"{k}_s"])
            print(
                f"  {k} {r[f'{k}_gbps']:5.2f} GB/s = {r[f'{k}_vs_copy']:.2f} x copy(1), "
                f"{r[f'{k}_vs_fresh']:.2f} x fresh(2); switch {what} {r[f'switch_{sw}_ms']:.0f} ms; "
                f"per cycle [{per}] ms: first {r[f'{k}_first_gbps']:.2f}, best {r[f'{k}_best_gbps']:.2f} GB/s"
            )
        if r.get("pair_copy_gbps") is not None:
            print(
                f"  offload = {r['offload_vs_pair']:.2f} x the copy paired with it (1p: A's own copy of the same "
                f"tensors at the start of the hold before it, {r['pair_copy_gbps']:.2f} GB/s median; median of "
                "the per-cycle ratios)"
            )
        if (line := _handed_back_line(r)) is not None:
            print(line)
        print(
            f"  baselines: copy(1) {r['base_copy_gbps']:.2f} GB/s (before {r['base_copy_before_gbps']:.2f}, after "
            f"{r['base_copy_after_gbps']:.2f}), fresh(2) {r['base_fresh_gbps']:.2f} GB/s (before "
            f"{r['base_fresh_before_gbps']:.2f}, after {r['base_fresh_after_gbps']:.2f}, first "
            f"{r['base_fresh_first_gbps']:.2f}),"
            f"\n             "
            f"clone(2') {r['base_clone_gbps']:.2f} GB/s; "
            f"freeing the fresh copy {r['base_free_ms']:.0f} ms"
        )
        print(
            f"  switch overhead (switch - the handler calls' wall time): A->B {r['overhead_ab_ms']:.2f} ms, "
            f"B->A {r['overhead_ba_ms']:.2f} ms, median {r['overhead_ms']:.2f} ms, "
            f"max {r['overhead_max_ms']:.2f} ms; of it agent-side {r['agent_side_ms']:.2f} ms, "
            f"orchestrator+bus {r['orchestrator_bus_ms']:.2f} ms; restore beside the snapshot in "
            f"{r.get('overlapped_switches', 0)} of {2 * r['cycles']} switches"
        )
        h = r["hops_ms"]
        print(
            "    hops (medians, by the times the stream stored the agent's events): "
            f"release -> snapshot starts {_ms(h['release_to_snapshot_start'])}, snapshot result -> restore "
            f"starts {_ms(h['snapshot_result_to_restore_start'])} (restores that waited), last result -> "
            f"acquire returns {_ms(h['last_result_to_grant'])}"
        )
        if r["errors"]:
            print(f"  ERRORS: {r['errors']}")
    if (f := res.get("switch_floor")) is not None:
        ratios = ", ".join(f"{r['gib']:g} GiB {r['overhead_vs_floor']:.2f}x" for r in res["sizes"])
        where = "agent stand-in in the orchestrator's process" if f.get("colocated") else "agent stand-in apart"
        print(
            f"switch floor (the switch's bus hops with no timeslice code, bench/_switch_floor.py, {where}; "
            f"{f['n']} switches, "
            f"{f['gap_ms']:g} ms gap): p50 {f['p50_ms']:.2f} ms, p90 {f['p90_ms']:.2f} ms, p99 {f['p99_ms']:.2f} ms; "
            f"switch overhead median = {ratios} the floor p50"
        )
    off = min(r["offload_vs_copy"] for r in res["sizes"])
    pair = min((r["offload_vs_pair"] for r in res["sizes"] if r.get("offload_vs_pair") is not None), default=None)
    of_pair = "" if pair is None else f" (of the copy paired with it: worst {pair:.0%})"
    rst = min(r["restore_vs_fresh"] for r in res["sizes"])
    rst1 = min(r["restore_vs_copy"] for r in res["sizes"])
    over = max(r["overhead_ms"] for r in res["sizes"])
    ok = "met", "NOT met"
    print(
        f"goals: offload >= {GOAL_BW_RATIO:.0%} of copy(1): worst {off:.0%}, {ok[off < GOAL_BW_RATIO]}{of_pair}; "
        f"restore >= {GOAL_BW_RATIO:.0%} of fresh(2): worst {rst:.0%}, {ok[rst < GOAL_BW_RATIO]} "
        f"(of copy(1): worst {rst1:.0%}, {ok[rst1 < GOAL_BW_RATIO]}); switch overhead <= {GOAL_OVERHEAD_MS:g} ms: "
        f"worst median {over:.2f} ms, {ok[over > GOAL_OVERHEAD_MS]}"
    )
    print(f"wall time {res['wall_s']:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,2,4", help="GiB of state in job A, comma-separated")
    p.add_argument(
        "--cycles",
        type=int,
        default=9,
        help="offload+restore cycles per size (medians: this VM makes a minority of cycles several times "
        "slower, see docs/benchmarks.md)",
    )
    p.add_argument("--hold-ms", type=float, default=200.0, help="each holder holds this long before releasing")
    p.add_argument(
        "--baseline-reps",
        type=int,
        default=2,
        help="baseline copies per kind and size, before the switches and again after them",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="where A's state lives (default: cuda when available, else cpu, as the handler chooses)",
    )
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--json-out", help="also write the figures, command and machine facts as JSON here")
    p.add_argument(
        "--floor-switches",
        type=int,
        default=40,
        help="switches of the same-run switch floor (bench/_switch_floor.py), each after a --hold-ms gap; 0: none",
    )
    p.add_argument(
        "--agent-process",
        action="store_true",
        help="run the node agent as a process of its own (default: in the orchestrator's process, as "
        "`timeslice up` runs it)",
    )
    p.add_argument(
        "--quick", action="store_true", help="a short run (0.25 GiB, 2 cycles, 1 baseline rep, 10 floor switches)"
    )
    p.add_argument(
        "--no-early-suspend",
        action="store_true",
        help="workloads suspend only at the agent's command, not at a release another job waits for",
    )
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--group", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--hold", type=float, help=argparse.SUPPRESS)
    p.add_argument("--leader", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ready", help=argparse.SUPPRESS)
    p.add_argument("--done", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "job":
        _loop_run(
            run_job(
                a.url,
                a.group,
                a.job,
                a.bytes,
                a.cycles,
                a.hold,
                a.out,
                a.ready,
                a.done,
                a.leader,
                a.device,
                not a.no_early_suspend,
            )
        )
        return
    if a.quick:
        a.sizes, a.cycles, a.baseline_reps, a.floor_switches = "0.25", min(a.cycles, 2), 1, min(a.floor_switches, 10)
    sizes = [float(s) for s in a.sizes.split(",") if s.strip()]
    if a.cycles < 1 or a.baseline_reps < 1 or not sizes or a.floor_switches < 0:
        p.error("--sizes, --cycles and --baseline-reps must be positive, --floor-switches not negative")
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    machine = _common.machine_facts()  # when the run starts: its time and load are those of the start
    res = run(
        sizes, a.cycles, a.hold_ms, a.baseline_reps, a.device, a.floor_switches, a.agent_process, not a.no_early_suspend
    )
    _common.write_result(a.json_out, "offload", machine, res)
    if a.json:
        print(json.dumps(res))
    else:
        _print(res)
    if any(r["errors"] for r in res["sizes"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
