"""``timeslice advise``: predict what sharing one group would give jobs that ran alone, from their recorded runs."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from timeslice_client.protocol import validate_id

from ._common import CliError, add_stream_flags, add_window_flags, emit_json
from ._replay import parse_time

__all__ = ["register"]


def _job(text: str) -> str:
    """``JOB`` or ``JOB@GROUP``, each a valid id."""
    job, _, group = text.partition("@")
    try:
        validate_id("job", job)
        if group:
            validate_id("group", group)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _between(unit: str, top: float) -> Callable[[str], float]:
    """An argparse type: a number of ``unit`` from 0 to ``top``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"give {unit} as a number, not {text!r}") from None
        if not 0 <= value <= top:
            raise argparse.ArgumentTypeError(f"must be between 0 and {top:g} {unit}, not {text}")
        return value

    return parse


_seconds = _between("s", 86_400)
_hop_ms = _between("ms", 1_000)


def _class(text: str) -> tuple[str, int]:
    """``JOB=N``: the priority class a job is to ask at in the prediction."""
    from timeslice_client.protocol import MAX_PRIORITY

    job, _, n = text.partition("=")
    try:
        validate_id("job", job)
        value = int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give JOB=CLASS (a job id and a whole number), not {text!r}") from None
    if not 0 <= value <= MAX_PRIORITY:
        raise argparse.ArgumentTypeError(f"a class lies between 0 and {MAX_PRIORITY}, not {value}")
    return job, value


async def _advise(args: argparse.Namespace) -> int:
    from timeslice_orchestrator.advise import SwitchCost, predict, render_prediction, traces
    from timeslice_orchestrator.replay import fold_events, read_window

    now = int(time.time() * 1000)
    try:
        since = parse_time(args.since, now) if args.since else None
        until = parse_time(args.until, now) if args.until else None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if since is not None and until is not None and until <= since:
        raise CliError(f"--until ({args.until}) must come after --since ({args.since})")
    given = None
    if args.snapshot_s is not None or args.restore_s is not None:
        given = {"*": SwitchCost(snapshot_s=args.snapshot_s or 0.0, restore_s=args.restore_s or 0.0, source="given")}
    events = await read_window(args.nats_url, since_ms=since, until_ms=until, timeout=args.timeout)
    replay = fold_events(events, since_ms=since, until_ms=until)
    jobs = traces(replay, args.jobs, given)
    classes = dict(args.priority)
    if unknown := sorted(set(classes) - {t.job for t in jobs}):
        raise CliError(f"--priority names {', '.join(unknown)}, not among the jobs predicted")
    jobs = [dataclasses.replace(t, priority=classes.get(t.job, 0)) for t in jobs]
    prediction = predict(jobs, hop_s=args.hop_ms / 1000, room=args.room)
    doc: dict[str, Any] = {"traces": [_trace_json(t) for t in jobs], "prediction": prediction.to_json()}
    if args.json:
        emit_json(doc)
    else:
        sys.stdout.write(render_prediction(prediction, jobs))
        sys.stdout.flush()
    if args.output:
        await asyncio.to_thread(Path(args.output).write_text, json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"prediction written to {args.output}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _trace_json(t: Any) -> dict[str, Any]:
    return {
        "job": t.job,
        "group": t.group,
        "priority": t.priority,
        "wall_s": t.wall_s,
        "held_s": t.held_s,
        "holds": t.holds,
        "switch": {
            "snapshot_s": t.cost.snapshot_s,
            "restore_s": t.cost.restore_s,
            "source": t.cost.source,
            "samples": t.cost.samples,
        },
        "phases": [[p.on_accelerator, p.seconds] for p in t.phases],
    }


def register(sub: Any) -> None:
    """Add ``advise`` to the ``timeslice`` command's subparsers."""
    p = sub.add_parser(
        "advise",
        help="predict what sharing one group would give jobs that ran alone",
        description="Read each job's recorded run off the event stream (its holds and the gaps between them), start "
        "the jobs together on one group in simulated time through the orchestrator's own core, and "
        "print the predicted makespan, duty cycle and switches beside the same jobs back to back. "
        "Switch costs are the jobs' own snapshots and restores in the window, or --snapshot-s/--restore-s "
        "(docs/scheduling.md, 'Predicting a shared run').",
    )
    p.add_argument(
        "jobs",
        nargs="+",
        type=_job,
        metavar="JOB[@GROUP]",
        help="two jobs or more; @GROUP names the group whose holds make the job's run, when it held several",
    )
    add_window_flags(p)
    p.add_argument(
        "--snapshot-s",
        type=_seconds,
        default=None,
        metavar="S",
        help="a snapshot's seconds, for every job (default: the median of each job's own in the window)",
    )
    p.add_argument(
        "--restore-s",
        type=_seconds,
        default=None,
        metavar="S",
        help="a restore's seconds, for every job (default: the median of each job's own in the window)",
    )
    p.add_argument(
        "--priority",
        type=_class,
        action="append",
        default=[],
        metavar="JOB=CLASS",
        help="the priority class (0-9) a job is to ask at when sharing (default 0: first come, first served); "
        "repeat for several jobs (docs/scheduling.md, 'Priorities')",
    )
    p.add_argument(
        "--room",
        action="store_true",
        help="the node fits two jobs' contexts at once: restores run beside the snapshots they follow and "
        "the incoming job is granted on its restore (default: snapshot, then restore)",
    )
    p.add_argument(
        "--hop-ms",
        type=_hop_ms,
        default=1.0,
        help="one pass through the bus, ms (default 1: a handoff's bus passes on one host)",
    )
    p.add_argument("--json", action="store_true", help="the traces and the prediction as JSON on stdout")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="also write them as JSON to FILE")
    add_stream_flags(p)
    p.set_defaults(func=_advise)
