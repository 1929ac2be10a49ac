"""``timeslice events``: the ``TIMESLICE`` stream, one human-readable line per event.

Every line: stream time (UTC), stream sequence, the message's type, group, job, then the fields that
explain it (epoch, node, operation, bytes, milliseconds, state change, reason). ``--json`` prints each
message raw (its decoded payload with sequence, time and subject), one JSON object per line.
``--since`` takes a duration back from now (``30s``, ``10m``, ``2h``, ``1d``) or an ISO time (a time
without a zone is local time); ``--follow`` keeps printing new events until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from timeslice_client.errors import Unavailable
from timeslice_client.protocol import STREAM, subjects, validate_id
from timeslice_orchestrator._delivery import seq_and_time

from ._common import add_nats_flag

__all__ = ["Event", "event_data", "format_line", "parse_since", "register", "to_json"]

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``10m`` → ten minutes before ``now``; ``2026-11-30T10:00:00Z`` → that instant (no zone: local time)."""
    m = _DURATION.fullmatch(text.strip())
    if m is not None:
        return (now or datetime.now(UTC)) - timedelta(seconds=float(m[1]) * _UNIT_S[m[2]])
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--since {text!r}: give a duration (30s, 10m, 2h, 1d) or an ISO time (2026-11-30T10:00:00Z)"
        ) from None
    return when if when.tzinfo is not None else when.astimezone()


def event_data(raw: bytes) -> dict[str, Any]:
    """A stream message's payload, decoded and untyped; one that is not a JSON object reads as type ``?`` with its
    ``raw`` content."""
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return {"type": "?", "raw": raw.decode(errors="replace")}
    return data if isinstance(data, dict) else {"type": "?", "raw": data}


@dataclass(frozen=True, slots=True)
class Event:
    """One stream message: where it sits, when it was stored (ms since the epoch, exactly as the server
    stamped it), and its payload (decoded, untyped)."""

    seq: int
    time_ms: int
    subject: str
    data: dict[str, Any]

    @property
    def time(self) -> datetime:
        return _EPOCH + timedelta(milliseconds=self.time_ms)

    @classmethod
    def of(cls, msg: Msg) -> Event:
        # from the reply subject's nanoseconds, in integers: nats-py's metadata goes through a float
        # and a datetime, which can land a millisecond early (1796117798341 ms read as ...340; docs/nats.md)
        seq, time_ms = seq_and_time(msg.reply)
        return cls(seq, time_ms, msg.subject, event_data(msg.data))

    @property
    def group(self) -> str | None:
        g = self.data.get("group")
        return g if isinstance(g, str) else None


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n}B"


def _details(d: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if "previous" in d and "state" in d:
        out.append(f"{d['previous']}->{d['state']}")
        if d.get("holder"):
            out.append(f"holder={d['holder']}")
    for key, label in (
        ("node", "node"),
        ("epoch", "epoch"),
        ("claim_epoch", "claim"),
        ("kind", "op"),
        ("name", "phase"),
        ("edge", "edge"),
        ("backend", "backend"),
        ("code", "code"),
    ):
        if d.get(key) is not None:
            out.append(f"{label}={d[key]}")
    if "ok" in d and d.get("type") == "op_result":
        out.append("ok" if d["ok"] else "FAILED")
    if d.get("bytes_moved"):
        out.append(f"bytes={_bytes(int(d['bytes_moved']))}")
    if d.get("elapsed_ms"):
        out.append(f"ms={float(d['elapsed_ms']):.1f}")
    if d.get("began_at_release"):  # an early suspend: the agent's ms are its end, work_ms all of it
        out.append("began_at_release" + (f" work_ms={float(d['work_ms']):.1f}" if d.get("work_ms") else ""))
    if d.get("waiters"):
        out.append(f"waiters={d['waiters']}")
    if "waited_ms" in d:
        out.append(f"waited_ms={d['waited_ms']}")
    if d.get("context_restored"):
        out.append("restored")
    if "pending_waiters" in d:
        out.append(f"pending={d['pending_waiters']}")
    for key in ("reason", "error", "message"):
        if d.get(key):
            out.append(f"{key}={d[key]!r}")
    return out


def format_line(ev: Event) -> str:
    """``2026-11-30T10:41:02.123Z      42 granted       gs        job=a epoch=3 waited_ms=12 restored``"""
    d = ev.data
    when = ev.time.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    job = d.get("job")
    head = f"{when} {ev.seq:>7} {d.get('type', '?')!s:<16} {ev.group or '-':<16}"
    return " ".join([head, f"job={job}" if job else "-", *_details(d)])


def to_json(ev: Event) -> str:
    return json.dumps({"seq": ev.seq, "time_ms": ev.time_ms, "subject": ev.subject, "data": ev.data})


async def stream_events(
    nc: NATS,
    out: TextIO,
    *,
    group: str | None,
    since: datetime | None,
    follow: bool,
    as_json: bool,
    stop: asyncio.Event,
    idle_s: float = 1.0,
) -> int:
    """Print the selected events; returns how many. Without ``follow`` it stops at the stream's last message
    as of the call; with it, when ``stop`` is set."""
    js = nc.jetstream()
    try:
        info = await js.stream_info(STREAM)
    except NotFoundError as exc:
        raise Unavailable(f"the {STREAM} stream is missing (start the orchestrator first: `timeslice up`)") from exc
    last = info.state.last_seq
    if not follow and info.state.messages == 0:
        return 0
    cfg = ConsumerConfig(description="timeslice events (CLI)")
    if since is not None:
        cfg.deliver_policy, cfg.opt_start_time = DeliverPolicy.BY_START_TIME, since
    if group is not None:
        # Server-side: the group's own subjects and the agents' (which name the group only in the payload).
        cfg.filter_subjects = [*subjects.group_filter(group), "ts.v1.agent.*.cmd", "ts.v1.agent.*.op"]
    sub = await js.subscribe(subjects.all_events, stream=STREAM, ordered_consumer=True, config=cfg)
    printed = 0
    try:
        if not follow:
            ci = await sub.consumer_info()
            if ci.num_pending == 0 and not (ci.delivered and ci.delivered.consumer_seq):
                return 0  # nothing at or after --since
        while not stop.is_set():
            try:
                msg = await sub.next_msg(timeout=idle_s)
            except NatsTimeoutError:
                continue
            ev = Event.of(msg)
            if group is None or ev.group == group:
                out.write((to_json(ev) if as_json else format_line(ev)) + "\n")
                out.flush()
                printed += 1
            if not follow and (ev.seq >= last or msg.metadata.num_pending == 0):
                break
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return printed


async def run(args: argparse.Namespace) -> int:
    from timeslice_client.bus import connect

    if args.group is not None:
        validate_id("group", args.group)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    nc = await connect(args.nats_url, name="timeslice-events")
    try:
        await stream_events(
            nc, sys.stdout, group=args.group, since=args.since, follow=args.follow, as_json=args.json, stop=stop
        )
    finally:
        await nc.close()
    return 0


def register(sub: Any) -> None:
    """Add ``events`` to the ``timeslice`` command's subparsers."""
    ev = sub.add_parser("events", help="the event stream, one line per event")
    ev.add_argument("--group", default=None, help="only this group's events")
    ev.add_argument(
        "--since",
        type=parse_since,
        default=None,
        help="a duration back from now (30s, 10m, 2h, 1d) or an ISO time (default: the whole stream)",
    )
    ev.add_argument("--follow", "-f", action="store_true", help="keep printing new events until Ctrl-C")
    ev.add_argument("--json", action="store_true", help="each message raw, one JSON object per line on stdout")
    add_nats_flag(ev)
    ev.set_defaults(func=run)
