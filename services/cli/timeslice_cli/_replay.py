"""``timeslice replay``: fold a window of the stream and print the summary, write the HTML and JSON."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from timeslice_client.protocol import validate_id
from timeslice_orchestrator.replay import Replay, fold_events, read_window, render_summary, write_html

from ._common import CliError, add_stream_flags, add_window_flags

__all__ = ["parse_time", "register"]

_AGO = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_time(text: str, now_ms: int) -> int:
    """A moment in ms since the epoch: ``10m``/``90s``/``2h``/``1d`` ago, ``now``, ms since the epoch
    (13 digits), or an ISO 8601 date-time (local time unless it names an offset). ValueError says what is accepted."""
    t = text.strip()
    if t == "now":
        return now_ms
    m = _AGO.fullmatch(t)
    if m is not None:
        return now_ms - int(float(m.group(1)) * _UNIT_MS[m.group(2)])
    if t.isdigit() and len(t) >= 12:
        return int(t)
    try:
        when = dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"cannot read the time {text!r}: give a duration ago (10m, 90s, 2h, 1d), 'now', milliseconds "
            "since the epoch, or an ISO 8601 date-time such as 2026-11-30T10:00:00Z"
        ) from None
    if when.tzinfo is None:
        when = when.astimezone()  # a time without a zone is local time (as ``timeslice events``)
    return (when - _EPOCH) // dt.timedelta(milliseconds=1)  # in integers: a float can land 1 ms early


async def _replay(args: argparse.Namespace) -> int:
    now = int(time.time() * 1000)
    try:
        since = parse_time(args.since, now) if args.since else None
        until = parse_time(args.until, now) if args.until else None
        group = validate_id("group", args.group) if args.group else None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if since is not None and until is not None and until <= since:
        raise CliError(f"--until ({args.until}) must come after --since ({args.since})")
    events = await read_window(args.nats_url, group=group, since_ms=since, until_ms=until, timeout=args.timeout)
    replay = fold_events(events, group=group, since_ms=since, until_ms=until)
    _write(replay, args)
    return 0


def _write(replay: Replay, args: argparse.Namespace) -> None:
    """``--json``: the intervals on stdout instead of the summary (notes go to stderr); ``-o FILE``: also to FILE."""
    notes = sys.stderr if args.json else sys.stdout
    if args.json:
        json.dump(replay.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_summary(replay))
    if args.output:
        Path(args.output).write_text(json.dumps(replay.to_json(), indent=2) + "\n", encoding="utf-8")
        print(f"intervals written to {args.output}", file=notes)
    if args.html:
        write_html(replay, Path(args.html))
        print(f"timeline written to {args.html}", file=notes)
    sys.stdout.flush()


def register(sub: Any) -> None:
    """Add ``replay`` to the ``timeslice`` command's subparsers."""
    p = sub.add_parser(
        "replay",
        help="rebuild a window of the event stream: summary, HTML timeline, JSON",
        description="Fold the TIMESLICE stream through the orchestrator's pure core and show "
        "who held which group when, who waited, and where the time went.",
    )
    p.add_argument("--group", default=None, help="one group only (default: every group)")
    add_window_flags(p)
    p.add_argument("--html", default=None, metavar="FILE", help="write the interactive timeline to FILE")
    p.add_argument(
        "--json", action="store_true", help="the reconstructed intervals as JSON on stdout, instead of the summary"
    )
    p.add_argument(
        "-o", "--output", default=None, metavar="FILE", help="also write the reconstructed intervals as JSON to FILE"
    )
    add_stream_flags(p)
    p.set_defaults(func=_replay)
