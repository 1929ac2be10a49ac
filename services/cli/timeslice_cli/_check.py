"""``timeslice check``: the stream's invariants, checked by an operator.

Reads the ``TIMESLICE`` stream from its first message (as ``timeslice replay`` does: the state at the window's
start needs the history before it), folds it through the orchestrator's pure core and
:class:`~timeslice_orchestrator.invariants.StreamChecker` (whose rules go on after a violation, so that every
one is reported), and through :class:`~timeslice_orchestrator._stream_checks.StreamChecks`, which reads only
what the stream shows (see there for the kinds). Reports every violation at or after ``--since`` with the
events that show it.

Exit 0: no violation (one summary line); 1: violations (one block each, or ``--json``); 2: usage or
connection errors (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

import msgspec
from timeslice_client.errors import InvalidId
from timeslice_client.protocol import Granted, validate_id
from timeslice_orchestrator._stream_checks import FOLD_RULE_KIND, STUCK_MARGIN_MS, Kind, StreamChecks, Violation
from timeslice_orchestrator.core import Notify
from timeslice_orchestrator.invariants import InvariantViolation, StreamChecker
from timeslice_orchestrator.replay import read_window
from timeslice_orchestrator.replay._fold import group_of
from timeslice_orchestrator.replay._model import StreamEvent

from ._common import add_stream_flags
from ._events import Event, event_data, format_line
from ._replay import parse_time

__all__ = ["CheckReport", "check_events", "parse_duration", "parse_since", "register", "run"]

_SEQ = re.compile(r"(?:seq:|#)(\d+)|(\d{1,11})")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class CheckReport:
    """What ``timeslice check`` found: the violations, and how many events (of which groups) the window held."""

    violations: list[Violation]
    events: int
    groups: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations


# ---------------------------------------------------------------------- arguments


def parse_since(text: str, now_ms: int) -> tuple[int, int | None]:
    """``--since``: (first stream sequence, first stream ms or None). A stream sequence is ``seq:N``, ``#N`` or a
    plain number of up to 11 digits; anything else is a time as ``timeslice replay`` reads it (``10m``, ``2h``,
    ``now``, ms since the epoch, ISO 8601). ValueError says what is accepted."""
    m = _SEQ.fullmatch(text.strip())
    if m is not None:
        return int(m[1] or m[2]), None
    try:
        return 0, parse_time(text, now_ms)
    except ValueError as exc:
        raise ValueError(f"--since: {exc}; or a stream sequence (seq:1234, #1234 or 1234)") from None


def parse_duration(text: str) -> int:
    """``30s`` / ``500ms`` / ``2m`` -> milliseconds. ValueError says what is accepted."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"--stuck-after {text!r}: give a duration such as 500ms, 30s, 2m")
    return int(float(m[1]) * _UNIT_MS[m[2]])


# ---------------------------------------------------------------------- the check


def check_events(
    events: Iterable[StreamEvent], *, stuck_after_ms: int | None = None, since_seq: int = 0, since_ms: int | None = None
) -> CheckReport:
    """Fold ``events`` (the stream from its first message, in order) and check them; report what shows at or
    after ``since_seq`` / ``since_ms``."""
    checker = StreamChecker()

    def faulted(group: str) -> Mapping[str, str]:
        rec = checker.records.get(group)
        return rec.faulted if rec is not None else {}

    checks = StreamChecks(stuck_after_ms=stuck_after_ms, faulted=faulted, since_seq=since_seq, since_ms=since_ms)
    fold: list[tuple[InvariantViolation, StreamEvent]] = []
    count = 0
    groups: set[str] = set()
    for ev in events:
        in_window = ev.seq >= since_seq and (since_ms is None or ev.ts_ms >= since_ms)
        if in_window:
            count += 1
            g = group_of(ev.subject, ev.data)
            if g is not None:
                groups.add(g)
        try:
            actions = checker.feed(ev.seq, ev.ts_ms, ev.subject, ev.data)
        except InvariantViolation as exc:  # the checker's state is kept: the next message goes on from it
            actions = []
            if in_window:
                fold.append((exc, ev))
        for a in actions:
            if isinstance(a, Notify) and isinstance(a.notice, Granted):
                checks.decided(a.notice, ev.ts_ms)
        checks.feed(ev)
    return CheckReport(_merge(checks.violations, fold), count, sorted(groups))


def _merge(found: list[Violation], fold: list[tuple[InvariantViolation, StreamEvent]]) -> list[Violation]:
    """The stream checks' violations with the fold's. A fold rule broken at a message where a stream check found
    a violation is named on that violation (``rules``: the same message, seen by the core) instead of reported
    apart; the others are reported under the kind they tell of, else as ``invariant``."""
    out = list(found)
    for exc, ev in fold:
        kind = FOLD_RULE_KIND.get(exc.rule)
        group = exc.group or group_of(ev.subject, ev.data) or "?"
        here = [i for i, v in enumerate(out) if v.seq == ev.seq and v.group == group and v.kind is not Kind.INVARIANT]
        same = next((i for i in here if out[i].kind is kind), here[0] if here else None)
        if same is not None:
            out[same] = dataclasses.replace(out[same], rules=(*out[same].rules, exc.rule))
            continue
        epochs, jobs = _epochs_and_jobs(exc.values)
        out.append(
            Violation(kind or Kind.INVARIANT, group, ev.seq, ev.ts_ms, exc.detail, epochs, jobs, (ev,), (exc.rule,))
        )
    out.sort(key=lambda v: (v.seq, v.kind is Kind.INVARIANT, v.kind))
    return out


def _epochs_and_jobs(values: Mapping[str, object]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    epochs: list[int] = []
    jobs: list[str] = []
    for key, value in values.items():
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, msgspec.Struct):
                epoch, job = getattr(item, "epoch", None), getattr(item, "job", None)
                if isinstance(epoch, int) and epoch not in epochs:
                    epochs.append(epoch)
                if isinstance(job, str) and job not in jobs:
                    jobs.append(job)
            elif isinstance(item, int) and not isinstance(item, bool) and "epoch" in key and item not in epochs:
                epochs.append(item)
            elif (
                isinstance(item, str)
                and key in ("holder", "owner", "epoch_granted_to", "epoch_granted_before_to")
                and item not in jobs
            ):
                jobs.append(item)
    return tuple(sorted(epochs)), tuple(jobs)


# ---------------------------------------------------------------------- output


def _event(ev: StreamEvent) -> Event:
    return Event(ev.seq, ev.ts_ms, ev.subject, event_data(ev.data))


def _when(ms: int) -> str:
    return (_EPOCH + timedelta(milliseconds=ms)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _summary(report: CheckReport) -> str:
    groups = ", ".join(report.groups) or "none"
    n = len(report.violations)
    head = "no violation" if n == 0 else f"{n} violation{'s' if n > 1 else ''}"
    return f"{head} in {report.events} events (groups: {groups})"


def render_text(report: CheckReport) -> str:
    """One block per violation, then the summary line."""
    lines: list[str] = []
    for i, v in enumerate(report.violations, 1):
        epochs = ",".join(map(str, v.epochs)) or "-"
        jobs = ",".join(v.jobs) or "-"
        kind = f"{v.kind}[{','.join(v.rules)}]" if v.kind is Kind.INVARIANT else str(v.kind)
        lines.append(
            f"VIOLATION {i}/{len(report.violations)} {kind}  group={v.group}  epochs={epochs}  "
            f"jobs={jobs}  at seq {v.seq} ({_when(v.ts_ms)})"
        )
        lines.append(f"  {v.detail}")
        if v.rules and v.kind is not Kind.INVARIANT:
            lines.append(f"  the fold broke here too: {', '.join(v.rules)}")
        lines.extend(f"    {format_line(_event(ev))}  [{ev.subject}]" for ev in v.events)
        lines.append("")
    lines.append(_summary(report))
    return "\n".join(lines) + "\n"


def to_json(report: CheckReport, *, since_seq: int, since_ms: int | None, stuck_after_ms: int | None) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "summary": _summary(report),
        "events": report.events,
        "groups": report.groups,
        "since_seq": since_seq,
        "since_ms": since_ms,
        "stuck_after_ms": stuck_after_ms,  # None: each group's largest lease plus the margin
        "stuck_margin_ms": STUCK_MARGIN_MS,
        "violations": [
            {
                "kind": str(v.kind),
                "group": v.group,
                "seq": v.seq,
                "time_ms": v.ts_ms,
                "epochs": list(v.epochs),
                "jobs": list(v.jobs),
                "detail": v.detail,
                "rules": list(v.rules),
                "events": [
                    {"seq": e.seq, "time_ms": e.time_ms, "subject": e.subject, "data": e.data}
                    for e in map(_event, v.events)
                ],
            }
            for v in report.violations
        ],
    }


# ---------------------------------------------------------------------- the command


def _fail(message: str) -> int:
    print(f"timeslice check: {message}", file=sys.stderr)
    return 2


async def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        since_seq, since_ms = parse_since(args.since, int(time.time() * 1000)) if args.since else (0, None)
        stuck = parse_duration(args.stuck_after) if args.stuck_after else None
        group = validate_id("group", args.group) if args.group else None
    except (ValueError, InvalidId) as exc:
        return _fail(str(exc))
    events = await read_window(args.nats_url, group=group, timeout=args.timeout)
    report = check_events(events, stuck_after_ms=stuck, since_seq=since_seq, since_ms=since_ms)
    if args.json:
        json.dump(to_json(report, since_seq=since_seq, since_ms=since_ms, stuck_after_ms=stuck), out, indent=2)
        out.write("\n")
    else:
        out.write(render_text(report))
    out.flush()
    return 0 if report.ok else 1


def register(sub: Any) -> None:
    """Add ``check`` to the ``timeslice`` command's subparsers."""
    p = sub.add_parser(
        "check",
        help="check the event stream's invariants; exit 1 on a violation",
        description="Fold the TIMESLICE stream through the orchestrator's pure core and the invariant "
        "checker, and report every violation (overlapping holds, epoch regressions or "
        "duplicates, grants to departed waiters, stuck groups, grants while another "
        "job's context was still loaded) with the events that show it. Exit 0: none; "
        "1: violations; 2: usage or connection error.",
    )
    p.add_argument("--group", default=None, help="one group only (default: every group)")
    p.add_argument(
        "--since",
        default=None,
        help="report only from here: 10m / 2h ago, ms since the epoch, ISO 8601, or a stream sequence "
        "(seq:1234, #1234, 1234); the stream is still read from its first message",
    )
    p.add_argument(
        "--stuck-after",
        default=None,
        metavar="DURATION",
        help="a group with a waiter and nothing moving this long (stream time) is stuck (500ms, 30s, 2m; "
        f"default: the group's largest acquire lease + {STUCK_MARGIN_MS // 1000}s)",
    )
    p.add_argument("--json", action="store_true", help="the report as one JSON document on stdout")
    add_stream_flags(p)
    p.set_defaults(func=run)
