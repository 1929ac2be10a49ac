"""``timeslice demo``: real RL jobs time-slicing one "accelerator", end to end, in one command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._common import CliError

if TYPE_CHECKING:  # the modules themselves load when the demo runs: `timeslice --help` stays fast
    from ._report import DemoReport, Identity
    from ._runner import RunResult

__all__ = ["register", "run_demo"]

NODE = "demo-node"
SHARED_GROUP = "demo-shared"


def _backend(args: argparse.Namespace) -> tuple[str, str]:
    from ._job import torch_available
    from ._runner import DemoError

    has_torch = torch_available()
    if args.backend == "torch":
        if not has_torch:
            raise DemoError(
                "--torch asked for, but torch is not installed: `pip install 'timeslice-server[torch]'` "
                "(or your own torch build), or use --numpy"
            )
        return "torch", "asked for with --torch"
    if args.backend == "numpy":
        return "numpy", "asked for with --numpy" + ("" if has_torch else "; torch is not installed")
    return ("torch", "torch is installed") if has_torch else ("numpy", "torch is not installed")


def _identity(solo: RunResult, shared: RunResult) -> list[Identity]:
    from ._report import Identity, weights_identical

    out = []
    for job, r in solo.jobs.items():
        s = shared.jobs[job]
        assert r.done is not None and s.done is not None
        same = weights_identical(Path(r.done.weights), Path(s.done.weights))
        out.append(Identity(job, r.done.sha256, s.done.sha256, same and r.done.sha256 == s.done.sha256))
    return out


async def run_demo(args: argparse.Namespace) -> DemoReport:
    """Solo runs back to back, then (unless ``--solo``) the same jobs sharing one group; the report."""
    from ._progress import Progress
    from ._report import DemoReport, job_figures, lock_figures
    from ._runner import JobSpec, started_jobs
    from ._stack import embedded_stack

    backend, why = _backend(args)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="timeslice-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    html = Path(args.html) if args.html else workdir / "timeline.html"
    specs = [
        JobSpec(
            f"job-{i}",
            seed=i,
            backend=backend,
            steps=args.steps,
            hidden=args.hidden,
            reward_latency_ms=args.reward_latency_ms,
        )
        for i in range(1, args.jobs + 1)
    ]
    progress = Progress()
    print(
        f"timeslice demo: {args.jobs} jobs, {args.steps} steps, {backend} ({why}); work directory {workdir}", flush=True
    )
    try:
        async with contextlib.AsyncExitStack() as stack_of_jobs:
            stack = await stack_of_jobs.enter_async_context(embedded_stack(workdir, NODE))
            # Both sets of processes start now, together, so no interpreter start is ever timed.
            solo_set = await stack_of_jobs.enter_async_context(
                started_jobs(
                    stack,
                    specs,
                    label="solo",
                    groups={s.job: f"demo-solo-{s.job}" for s in specs},
                    workdir=workdir,
                    progress=progress,
                )
            )
            shared_set = (
                None
                if args.solo
                else await stack_of_jobs.enter_async_context(
                    started_jobs(
                        stack,
                        specs,
                        label="shared",
                        groups={s.job: SHARED_GROUP for s in specs},
                        workdir=workdir,
                        progress=progress,
                    )
                )
            )
            print("starting the job processes ...", flush=True)
            for js in (solo_set, shared_set):
                if js is not None:
                    await js.wait_built()
            print("solo runs, back to back (each job alone on the accelerator, in its own group):", flush=True)
            solo = await solo_set.run(sequential=True)
            report = DemoReport(
                backend,
                why,
                args.jobs,
                args.steps,
                args.reward_latency_ms,
                str(workdir),
                solo=job_figures(solo),
                back_to_back_s=solo.wall_s,
                html=str(html),
            )
            report.solo_lock = [
                await lock_figures(stack.nats_url, [r], html if args.solo and i == 0 else None)
                for i, r in enumerate(solo.jobs.values())
            ]
            if shared_set is not None:
                await _predict(report, stack.nats_url, solo)
                print(f"shared run: {args.jobs} jobs at once, one accelerator (group {SHARED_GROUP}):", flush=True)
                shared = await shared_set.run(sequential=False)
                report.shared, report.shared_s = job_figures(shared), shared.wall_s
                report.shared_lock = await lock_figures(stack.nats_url, list(shared.jobs.values()), html)
                report.identity = await asyncio.to_thread(_identity, solo, shared)
    finally:
        shutil.rmtree(workdir / "nats", ignore_errors=True)  # the stream's files; the report has what matters
    return report


async def _predict(report: DemoReport, nats_url: str, solo: RunResult) -> None:
    """``timeslice advise``'s prediction of the shared run from the solo runs, made before the shared run starts."""
    from timeslice_orchestrator import OrchestratorError

    from ._predict import predict_shared

    try:
        p = await predict_shared(nats_url, solo)
    except OrchestratorError as exc:  # a prediction that cannot be made never stops the demo
        report.prediction_error = str(exc)
        return
    report.predicted_shared_s, report.predicted_switch_costs = p.shared_s, p.switch_costs
    print(
        f"timeslice advise, from the solo runs: sharing should take {p.shared_s:.2f} s ({p.switches} switches)",
        flush=True,
    )


async def _main(args: argparse.Namespace) -> int:
    from ._runner import DemoError

    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # stop the jobs, the agent and nats-server on the way out
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, task.cancel)
    if logging.getLogger().level <= logging.INFO:
        logging.getLogger("timeslice").setLevel(logging.WARNING)  # the stack's own logs would break the display
    # --json: the report is the only thing on stdout; the progress and the human report go to stderr
    human = sys.stderr if args.json else sys.stdout
    try:
        with contextlib.redirect_stdout(human):
            report = await run_demo(args)
    except DemoError as exc:
        raise CliError(str(exc)) from None
    except asyncio.CancelledError:
        print("timeslice demo: stopped", file=sys.stderr)
        return 130
    print(report.render(), end="", flush=True, file=human)
    doc = json.dumps(report.to_json(), indent=2) + "\n"
    if args.json:
        sys.stdout.write(doc)
        sys.stdout.flush()
    if args.output:
        await asyncio.to_thread(Path(args.output).write_text, doc)
    return 0 if report.identical else 1


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def register(sub: Any) -> None:
    """Add ``timeslice demo`` to the ``timeslice`` command's subparsers."""
    p = sub.add_parser(
        "demo",
        help="real RL jobs time-slicing one accelerator: shared vs back to back",
        description="Start a private stack (nats-server, orchestrator, snapshot agent), run small GRPO "
        "jobs back to back and then sharing one accelerator, and report wall times, the "
        "lock's duty cycle and handoffs, snapshot/restore times, a bit-identity check of "
        "each job's final weights, and an HTML timeline.",
    )
    p.add_argument("--jobs", type=_positive, default=2, help="RL jobs (default 2)")
    p.add_argument("--steps", type=_positive, default=20, help="training steps per job (default 20: ~1.5 min in all)")
    p.add_argument("--solo", action="store_true", help="run the jobs back to back only")
    p.add_argument(
        "--html",
        default=None,
        metavar="FILE",
        help="the HTML timeline of the shared run (with --solo: of the first job's solo run); default "
        "timeline.html in the work directory",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--torch",
        dest="backend",
        action="store_const",
        const="torch",
        help="torch model (default when torch is installed)",
    )
    which.add_argument(
        "--numpy", dest="backend", action="store_const", const="numpy", help="numpy model (default without torch)"
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="where weights, job logs and the timeline go (default: a new temporary directory)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="the report as JSON on stdout (the progress and the readable report go to stderr)",
    )
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("--hidden", type=_positive, default=768, help="hidden width of the policy MLP (default 768)")
    p.add_argument(
        "--reward-latency-ms",
        type=float,
        default=500.0,
        help="modelled latency of the remote reward service per step (default 500)",
    )
    p.set_defaults(func=_main, backend=None)
