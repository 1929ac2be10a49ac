"""The trace jobs of trace_replay.py's real modes (``_trace_job``, one group; ``_trace_pool_job``, a group per
pool): the command line they take, and one run of some of them through the stack, started together.

Private to ``bench/``: the scripts import it as ``_trace_jobs``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common as c

__all__ = ["run_trace_jobs", "trace_job_parser"]


def trace_job_parser(doc: str, *flags: str) -> argparse.ArgumentParser:
    """The command line trace_replay.py starts a trace job with (``_trace_job``, ``_trace_pool_job``): the bus, the
    job, its profile, its ready and result files and its own string ``flags``, all required; the run's steps, seed
    and time compression; how long it waits for the go."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("--url", "--job", "--profile", "--ready", "--out", *flags):
        p.add_argument(flag, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--compression", type=float, required=True)
    p.add_argument("--go-timeout", type=float, default=300.0)
    return p


async def run_trace_jobs(
    script: Path,
    nc: Any,
    tmp: Path,
    run_id: str,
    jobs: Sequence[int],
    run_flags: list[str],
    timeout: float,
    what: str,
) -> list[dict[str, Any]]:
    """A job ``{run_id}-j{i}`` for each ``i`` of ``jobs`` (``script`` with the ``run_flags`` every job of the run
    shares, seed ``i``, its ready and result files under ``tmp``), started together once all are ready (the go on
    ``nc``); their results in ``jobs``' order once all are done, within ``timeout`` s. The jobs still running when it
    fails are stopped."""
    files = [tmp / f"{run_id}-j{i}.json" for i in jobs]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, res in zip(jobs, files, strict=True):
            ready = res.with_suffix(".ready")
            argv = [*run_flags, *c.flags(job=f"{run_id}-j{i}", seed=i, ready=ready, out=res)]
            procs.append(c.spawn(script, *argv, log_path=tmp / f"{run_id}-j{i}.log"))
        marks = [(res.with_suffix(".ready"), p) for res, p in zip(files, procs, strict=True)]
        await c.wait_all_ready(marks, 120, f"{tmp}/{run_id}-*.log")
        await c.go(nc, 0.0, 0.0)
        await c.wait_procs(procs, timeout, what)
        return [json.loads(f.read_text()) for f in files]
    finally:
        c.stop_procs(procs)
