"""The GPU check's duplex-across-jobs section (section 8 of ``bench/gpu_check.py``): job A's snapshot (device ->
host) beside job B's restore (host -> device) from two processes on one GPU, as the node agent runs them when the
node has room for both contexts (``services/agent/timeslice_agent/_restore_overlap.py``). Section 3 (``duplex``)
overlaps the two copies within one process; here each job has its own CUDA context.

Two worker processes (this module run as a script), each holding ``bytes`` of state on the device behind
``TorchOffloadHandler`` as the jobs hold it (its own side stream, its own registered pinned host buffer), each
through one warm-up suspend and resume first (host buffers allocated and pinned, not timed). Then ``reps`` times,
alternating which mode goes first, one switch each way (A out B in, then B out A in) in each mode:

- sequential: the outgoing job's ``suspend``, then the incoming job's ``resume`` once that is done (the copy time is
  the sum of the two calls, each timed in its own process);
- concurrent: both told to start at the same instant on CLOCK_MONOTONIC (system-wide on Linux; ``LEAD_S`` ahead,
  so that both have the order); each reports its own start and end on that clock, and the switch takes from the
  first start to the last end.

Figures: GB/s each way alone (the sequential calls' medians), each way and both together while concurrent, the
overlap ratio sequential / concurrent (2.0: perfect duplex, 1.0: none), how far apart the two starts were, and
bit-exactness: B's state after its resume, A's after a final resume. ``--device cpu``: the same code on CPU tensors
(a test of the plumbing: there both copies share the cores and the memory bus).

The section keeps to the check's budget: it does not start when its estimate (``need_s``) exceeds what is left, nor
on CUDA without device memory for both states at once; it runs fewer reps when the next might not fit (``cut``);
every answer from a worker is waited for at most what is left.

Private to ``bench/``; ``gpu_check.py`` puts ``bench/`` on the path before importing it. Its workers run
``python bench/_gpu_duplex_jobs.py --bytes N --device D`` (``bench/`` is then the script's folder, the project's
packages come with ``_child_env``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _gpu_offload import N_TENSORS, ROOT, _checksums, _child_env, _med, _random_state, _sync
from _gpu_report import GB
from _gpu_run import CLEANUP_S, Budget, LineReader, stop_tree

__all__ = ["CONTEXT_BYTES", "LEAD_S", "REST_S", "duplex_jobs", "need_s", "worker"]

LEAD_S = 0.05  # a concurrent switch starts this far ahead of the order, so that both workers have it by then
START_S = 20.0  # two processes importing torch and making their CUDA contexts at once (pessimistic)
PER_GB_S = 1.0  # per GB of one job's state: filling, pinning, checksums, the warm-up and final cycles, one rep
REST_S = 5.0  # kept for the final switch and the checks: no rep starts unless this and two reps' time are left
SWITCH_S = 120.0  # one switch's answer, at most (cut to what is left of the budget)
CONTEXT_BYTES = 1 << 30  # room kept per process beside its state for its CUDA context and the allocator's slack


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _until(t: float) -> None:
    """Return at CLOCK_MONOTONIC ``t`` (sleep, then spin the last 2 ms)."""
    while (left := t - _now()) > 0.002:
        time.sleep(left - 0.002)
    while _now() < t:
        pass


# --------------------------------------------------------------------------- the worker process


def worker(nbytes: int, device: str) -> None:
    """A job: ``nbytes`` of state behind the handler, one warm-up cycle, then ``ready <host memory>``. Each stdin
    line ``suspend T`` / ``resume T`` runs that call at CLOCK_MONOTONIC ``T`` (0: now) and answers ``start end
    bytes``; ``check`` answers ``intact`` or ``differ``. Ends with its stdin."""
    from timeslice_client.protocol import SuspendMode
    from timeslice_client.torch_offload import TorchOffloadHandler

    tensors = _random_state(nbytes, N_TENSORS, device)
    sums = _checksums(tensors)
    handler = TorchOffloadHandler(tensors={"state": tensors}, device=device)
    handler.prepare()
    calls = {"suspend": handler.suspend, "resume": handler.resume}
    for warm in ("suspend", "resume"):
        calls[warm](SuspendMode.OFFLOAD, frozenset())
    _sync(device)
    print(f"ready {handler.host_memory_in_use}", flush=True)
    for line in sys.stdin:
        what, *at = line.split()
        if what == "check":
            _sync(device)
            print("intact" if _checksums(tensors) == sums else "differ", flush=True)
            continue
        _until(float(at[0]))
        t0 = _now()
        moved = calls[what](SuspendMode.OFFLOAD, frozenset()).bytes_moved
        _sync(device)
        print(f"{t0!r} {_now()!r} {moved}", flush=True)


class _Job:
    """A worker process, asked through its stdin, answering on its stdout (each answer waited for a bounded time)."""

    def __init__(self, name: str, nbytes: int, device: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--bytes", str(nbytes), "--device", device],
            env=_child_env(),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self._lines = LineReader(self.proc.stdout)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float) -> str:
        said = self._lines.readline(timeout_s, f"job {self.name}'s worker")
        if not said:
            raise RuntimeError(f"job {self.name}'s worker exited with {self.proc.wait(5)} (its traceback is above)")
        return said

    def timed(self, timeout_s: float) -> tuple[float, float, int]:
        """The answer to ``suspend``/``resume``: (start, end, bytes moved)."""
        t0, t1, moved = self.answer(timeout_s).split()
        return float(t0), float(t1), int(moved)

    def stop(self) -> None:
        """End the worker with its stdin; stopped (SIGTERM, then SIGKILL) past ``CLEANUP_S / 4``."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(CLEANUP_S / 4)
        except subprocess.TimeoutExpired:
            stop_tree(self.proc, CLEANUP_S / 8)


# --------------------------------------------------------------------------- the section


def need_s(nbytes: int) -> float:
    """What the section may take at the least, by a pessimistic estimate (it is not started with less left)."""
    return START_S + PER_GB_S * nbytes / GB


def _no_room(nbytes: int, device: str) -> str | None:
    """Why the device cannot hold both jobs' states at once (None when it can, and always on CPU)."""
    if device != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info()
    need = 2 * (nbytes + CONTEXT_BYTES)
    if free >= need:
        return None
    return (
        f"the device has {free / GB:.1f} GB free of {total / GB:.1f} GB, both jobs' states and contexts need "
        f"{need / GB:.1f} GB: run it on its own (--only duplex_jobs) or with a smaller --duplex-jobs-gb"
    )


def _switch(out: _Job, into: _Job, concurrent: bool, budget: Budget) -> dict[str, float]:
    """``out`` suspends and ``into`` resumes, one after the other or started at the same instant."""
    wait = budget.bound(SWITCH_S)
    if concurrent:
        at = _now() + LEAD_S
        out.send(f"suspend {at!r}")
        into.send(f"resume {at!r}")
        (s0, s1, _), (r0, r1, _) = out.timed(wait), into.timed(wait)
        took = max(s1, r1) - min(s0, r0)
    else:
        out.send("suspend 0")
        s0, s1, _ = out.timed(wait)
        into.send("resume 0")
        r0, r1, _ = into.timed(wait)
        took = (s1 - s0) + (r1 - r0)
    return {"suspend_s": s1 - s0, "resume_s": r1 - r0, "s": took, "skew_s": abs(r0 - s0)}


def _check(job: _Job, budget: Budget) -> bool:
    job.send("check")
    return job.answer(budget.bound(SWITCH_S)) == "intact"


def _figures(nbytes: int, seq: list[dict[str, float]], conc: list[dict[str, float]]) -> dict[str, Any]:
    def med(rows: list[dict[str, float]], key: str) -> float:
        return _med([r[key] for r in rows])

    seq_s, conc_s = med(seq, "s"), med(conc, "s")
    return {
        "d2h_gbps": nbytes / GB / med(seq, "suspend_s"),
        "h2d_gbps": nbytes / GB / med(seq, "resume_s"),
        "sequential_s": seq_s,
        "concurrent_s": conc_s,
        "concurrent_gbps": 2 * nbytes / GB / conc_s,
        "concurrent_d2h_gbps": nbytes / GB / med(conc, "suspend_s"),
        "concurrent_h2d_gbps": nbytes / GB / med(conc, "resume_s"),
        "overlap": seq_s / conc_s,
        "start_skew_ms": med(conc, "skew_s") * 1e3,
        "start_skew_max_ms": max(r["skew_s"] for r in conc) * 1e3,
        "sequential_all_s": [r["s"] for r in seq],
        "concurrent_all_s": [r["s"] for r in conc],
    }


def duplex_jobs(nbytes: int, reps: int, device: str, budget: Budget) -> dict[str, Any]:
    """Measure the two jobs' switches (module doc); ``{"bytes", "skipped": why}`` when the budget or the device
    memory does not fit the section. Raises when a worker fails or does not answer within the budget."""
    if budget.left() < need_s(nbytes):
        return {
            "bytes": nbytes,
            "skipped": f"it needs about {need_s(nbytes):.0f} s for 2 x {nbytes / GB:.3g} GB and {budget.left():.0f} "
            "s of the budget are left: run it on its own (--only duplex_jobs), or raise --budget-s",
        }
    if why := _no_room(nbytes, device):
        return {"bytes": nbytes, "skipped": why}
    t0 = time.monotonic()
    a, b = _Job("A", nbytes, device), _Job("B", nbytes, device)
    try:
        ready = [job.answer(budget.bound(START_S + PER_GB_S * nbytes / GB * 4)) for job in (a, b)]
        if any(not r.startswith("ready") for r in ready):
            raise RuntimeError(f"the workers did not start (they said {ready})")
        start_s = time.monotonic() - t0
        b.send("suspend 0")  # B switched out, A running: where every rep starts and ends
        state = b.timed(budget.bound(SWITCH_S))[2]
        seq: list[dict[str, float]] = []
        conc: list[dict[str, float]] = []
        done, cut, rep_s = 0, None, 0.0
        for i in range(reps):
            if i and budget.left() < REST_S + 2 * rep_s:
                cut = f"{done} of {reps} reps: the next might not fit in the {budget.left():.0f} s left"
                break
            began = budget.elapsed()
            for concurrent in (False, True) if i % 2 == 0 else (True, False):
                for out, into in ((a, b), (b, a)):
                    (conc if concurrent else seq).append(_switch(out, into, concurrent, budget))
            rep_s = budget.elapsed() - began
            done += 1
        _switch(a, b, True, budget)  # B in, A out: then B is checked, and A after its final resume
        b_exact = _check(b, budget)
        a.send("resume 0")
        a.timed(budget.bound(SWITCH_S))
        a_exact = _check(a, budget)
    finally:
        for job in (a, b):
            job.stop()
    return {
        "device": device,
        "bytes": state,
        "reps": done,
        "reps_asked": reps,
        "cut": cut,
        "host_memory": ready[0].split()[1],
        "start_s": start_s,
        **_figures(state, seq, conc),
        "b_bit_exact": b_exact,
        "a_bit_exact": a_exact,
        "bit_exact": a_exact and b_exact,
    }


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="a worker of the duplex_jobs section (see the module doc)")
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    args = p.parse_args()
    worker(args.bytes, args.device)
