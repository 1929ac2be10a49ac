"""``timeslice status``: who holds which group, who waits, and where each job's context is.

Reads the KV buckets the orchestrator and the agents keep (``groups``: the lock records; ``jobs``: each
job's context state per node). ``--watch`` follows both buckets with KV watchers and redraws when they
change (at most ``--max-rate`` times a second, and once a second anyway so the clocks move); ``--json``
prints the records and job states as stored, for scripts (one document per line with ``--watch``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from timeslice_client.bus import kv_keys
from timeslice_client.errors import Unavailable
from timeslice_client.protocol import (
    GROUPS_BUCKET,
    JOBS_BUCKET,
    GroupRecord,
    JobContext,
    OpKind,
    decode_record,
    is_group_key,
    validate_id,
)
from timeslice_orchestrator._fair_share import decayed, describe
from timeslice_orchestrator._leadership import LeaderRecord, read_leader
from timeslice_orchestrator._quarantine import read_quarantined

from ._common import add_nats_flag, in_range
from ._term import show

__all__ = ["View", "fit", "read_control", "read_view", "register", "render_json", "render_table"]

_ctx_decoder = msgspec.json.Decoder(JobContext)
#: How ``status`` colours a terminal (``_term``): states, and what needs a person's eye.
STATE_STYLES = (
    (r"\bHELD\b", "green"),
    (r"\b(SWITCHING|TRANSITIONING)\b", "yellow"),
    (r"\bIDLE\w*\b", "dim"),
    (r"\b(FAULTED|QUARANTINED|UNREADABLE)\b|faulted:", "bold red"),
    (r"(?m)^leader: none.*", "bold red"),
)


@dataclass
class View:
    """What ``status`` shows: group records by group, job contexts by ``<node>.<job>`` key."""

    groups: dict[str, GroupRecord] = field(default_factory=dict)
    jobs: dict[str, JobContext] = field(default_factory=dict)
    leader: LeaderRecord | None = None  # who leads the orchestrators (None: nobody, or not readable)
    quarantined: dict[str, str] = field(default_factory=dict)  # group -> why the orchestrator does not serve it
    unreadable: dict[str, str] = field(default_factory=dict)  # key -> why its stored record does not decode

    def selected(self, group: str | None) -> tuple[list[GroupRecord], list[JobContext]]:
        recs = [r for g, r in sorted(self.groups.items()) if group is None or g == group]
        if group is not None and not recs:
            recs = [GroupRecord(group=group)]  # a group nobody used yet reads as IDLE at epoch 0
        names = {r.group for r in recs}
        jobs = sorted((c for c in self.jobs.values() if c.group in names), key=lambda c: (c.group, c.job, c.node))
        return recs, jobs


# ---------------------------------------------------------------------- reading


async def _bucket(nc: NATS, name: str) -> KeyValue:
    try:
        return await nc.jetstream().key_value(name)
    except Exception as exc:
        raise Unavailable(f"the `{name}` bucket is missing (start the orchestrator first: `timeslice up`)") from exc


async def _entries(nc: NATS, kv: KeyValue, bucket: str, only: str | None = None) -> list[tuple[str, bytes]]:
    keys = [only] if only is not None else await kv_keys(nc, bucket)  # not kv.keys(): it can miss keys
    if bucket == GROUPS_BUCKET:
        keys = [k for k in keys if is_group_key(k)]  # not the orchestrator's own keys (the term marker)
    out = []
    for k in keys:
        try:
            entry = await kv.get(k)
        except KeyNotFoundError:  # never written, or deleted (a job unregistered): not there
            continue
        except Exception as exc:  # shown as an error, never as a missing row
            raise Unavailable(f"reading key {k!r} of bucket {bucket!r} failed ({exc.__class__.__name__})") from exc
        if entry.value:
            out.append((k, bytes(entry.value)))
    return out


async def read_view(nc: NATS, group: str | None = None) -> View:
    """One consistent-enough reading of both buckets (each key is read once, in no particular order), and of who
    leads and which groups are quarantined."""
    groups_kv, jobs_kv = await _bucket(nc, GROUPS_BUCKET), await _bucket(nc, JOBS_BUCKET)
    view = View()
    for key, value in await _entries(nc, groups_kv, GROUPS_BUCKET, group):
        _put_group(view, key, value)
    for key, value in await _entries(nc, jobs_kv, JOBS_BUCKET):
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            view.jobs[key] = _ctx_decoder.decode(value)
    await read_control(nc, view)
    return view


def _put_group(view: View, key: str, value: bytes) -> None:
    try:
        view.groups[key] = decode_record(value)
        view.unreadable.pop(key, None)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        view.groups.pop(key, None)
        view.unreadable[key] = str(exc)[:200]


async def read_control(nc: NATS, view: View, timeout_s: float = 2.0) -> None:
    """Who leads, and the quarantined groups (from the stream); left as they were when they cannot be read."""
    js = nc.jetstream()
    with contextlib.suppress(Exception):
        view.leader = await read_leader(js, timeout=timeout_s)
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            view.quarantined = await read_quarantined(js)


# ---------------------------------------------------------------------- rendering


def _dur(ms: int) -> str:
    s = max(0, ms) / 1000
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _queue(rec: GroupRecord, now_ms: int) -> str:
    parts = []
    sw = rec.switch
    if sw is not None and sw.to is not None:
        # Restores go out with the snapshots and run once those on their node ended: snapshot while any is left.
        phase = OpKind.SNAPSHOT if any(op.kind is OpKind.SNAPSHOT for op in sw.ops) else sw.phase
        parts.append(f"{sw.to.job} {_dur(now_ms - sw.to.enqueued_at_ms)} (switching: {phase})")
    parts += [
        f"{w.job} {_dur(now_ms - w.enqueued_at_ms)}" + (f" (class {w.priority})" if w.priority else "")
        for w in rec.queue
    ]  # in the order they asked (classes: docs/scheduling.md)
    if rec.trailing is not None and rec.queue:  # the next switch starts once the snapshots trailing a grant ended
        parts[0] += f" (after the snapshot of {', '.join(sorted({op.job for op in rec.trailing.ops}))})"
    return ", ".join(parts) or "-"


_FAIR_JOBS = 8  # jobs named on the fair-share line of a group, at most


def _fair(rec: GroupRecord, now_ms: int) -> str:
    """Each job's share and recent held time (decayed to ``now_ms`` as the core decays it), by job name."""
    from timeslice_orchestrator.core import LIMITS

    jobs = sorted(set(rec.shares) | set(rec.usage))
    parts = [
        f"{j}={rec.shares.get(j, 1)} held "
        + (_dur(decayed(rec.usage[j], now_ms, LIMITS.usage_half_life_ms)) if j in rec.usage else "-")
        for j in jobs[:_FAIR_JOBS]
    ]
    more = f", and {len(jobs) - _FAIR_JOBS} more" if len(jobs) > _FAIR_JOBS else ""
    return f"fair share: {', '.join(parts)}{more} (the others 1)"


def _nodes(rec: GroupRecord) -> list[str]:
    nodes = set(rec.loaded)
    for ns in rec.placements.values():
        nodes.update(ns)
    return sorted(nodes)


def render_table(
    recs: Iterable[GroupRecord], jobs: Iterable[JobContext], now_ms: int, *, view: View | None = None
) -> str:
    """The human table: who leads, one line per group, then its nodes, job states and faults indented below;
    quarantined groups and unreadable records last."""
    by_group: dict[str, list[JobContext]] = {}
    for c in jobs:
        by_group.setdefault(c.group, []).append(c)
    lines = []
    if view is not None:
        ld = view.leader
        lines.append(
            f"leader: {ld.holder} (term {ld.term}, for {_dur(now_ms - ld.since_ms)})"
            if ld is not None
            else "leader: none (no orchestrator leads: start one, or wait for a standby to take over)"
        )
    lines.append(f"{'GROUP':<20} {'STATE':<13} {'HOLDER':<16} {'EPOCH':>6} {'FOR':>8}  {'ACTIVE':<16} QUEUE (waited)")
    recs = list(recs)
    if not recs:
        lines.append("(no groups yet: a group appears with its first acquire)")
    for r in recs:
        started = r.holder.granted_at_ms if r.holder is not None else r.since_ms
        held = _dur(now_ms - started) if started else "-"
        lines.append(
            f"{r.group:<20} {r.state:<13} {(r.holder.job if r.holder else '-'):<16} {r.epoch:>6} {held:>8}  "
            f"{(r.active_job or '-'):<16} {_queue(r, now_ms)}"
        )
        pad = " " * 21
        nodes = _nodes(r)
        if nodes:
            lines.append(pad + "nodes: " + ", ".join(f"{n} (loaded: {r.loaded.get(n, '-')})" for n in nodes))
        ctxs = by_group.get(r.group, [])
        if ctxs:
            lines.append(pad + "jobs:  " + ", ".join(f"{c.job}@{c.node} {c.state}" for c in ctxs))
        for c in ctxs:
            if c.reason:
                lines.append(pad + f"       {c.job}@{c.node}: {c.reason}")
        for job, why in sorted(r.faulted.items()):
            lines.append(pad + f"faulted: {job}: {why}")
        if r.quantum_ms:
            asked = r.holder is not None and r.yield_asked_epoch == r.holder.epoch
            lines.append(pad + f"quantum: {_dur(r.quantum_ms)}" + (" (the holder was asked to yield)" if asked else ""))
        if r.min_hold_ms or r.reserved is not None:
            kept = r.reserved
            lines.append(
                pad
                + f"min hold: {_dur(r.min_hold_ms)}"
                + (f" (kept for {kept.job} for {_dur(max(0, kept.until_ms - now_ms))} more)" if kept else "")
            )
        if r.shares:
            lines.append(pad + _fair(r, now_ms))
            if r.picked is not None:
                lines.append(pad + f"last {describe(r.picked)}")
        if r.predict:
            lines.append(pad + _predicting(r, now_ms))
    if view is not None:
        for g, why in sorted(view.quarantined.items()):
            lines.append(f"QUARANTINED {g}: {why} (not served; every other group is)")
        for g, why in sorted(view.unreadable.items()):
            lines.append(f"UNREADABLE record {g}: {why}")
    return "\n".join(lines)


def _predicting(r: GroupRecord, now_ms: int) -> str:
    """The predictive restore's line: what it plans or runs now, else that it is on."""
    sw = r.switch
    if sw is not None and sw.ahead is not None:
        return f"predictive restore: bringing {sw.ahead}'s context back" + (
            f" ({sw.to.job} asked meanwhile)" if sw.to is not None else " ahead of its ask"
        )
    if r.plan is not None:
        starts = _dur(max(0, r.plan.at_ms - now_ms))
        cue = f" (its phase {r.plan.phase} started)" if r.plan.phase is not None else ""
        return f"predictive restore: {r.plan.job} expected next{cue}, its restore starts in {starts}"
    if r.restored_ahead is not None:
        return f"predictive restore: {r.restored_ahead}'s context is back, ahead of its ask"
    return "predictive restore: on"


def render_json(
    recs: list[GroupRecord], jobs: list[JobContext], now_ms: int, *, indent: int | None = 2, view: View | None = None
) -> str:
    """The records and job contexts exactly as stored (KV ``groups`` and ``jobs``), and the time of reading; with
    ``view``, also who leads, the quarantined groups and the records that do not decode."""
    doc: dict[str, Any] = {"now_ms": now_ms, "groups": msgspec.to_builtins(recs), "jobs": msgspec.to_builtins(jobs)}
    if view is not None:
        doc["leader"] = msgspec.to_builtins(view.leader)
        doc["quarantined"] = view.quarantined
        doc["unreadable"] = view.unreadable
    return json.dumps(doc, indent=indent)


# ---------------------------------------------------------------------- the command


def fit(text: str, width: int) -> str:
    """Each line of ``text`` cut to ``width`` columns (an ellipsis marks a cut), so a live view never wraps."""
    return "\n".join(line if len(line) <= width else line[: max(1, width - 1)] + "\u2026" for line in text.split("\n"))


def _print(view: View, args: argparse.Namespace, out: TextIO, *, clear: bool) -> None:
    """One frame. ``--watch`` on a terminal: redrawn in place, cut to the terminal's width; elsewhere (a file, a
    pipe) no control codes: frames one after another, a blank line between them."""
    now_ms = int(time.time() * 1000)
    recs, jobs = view.selected(args.group)
    if args.json:
        out.write(render_json(recs, jobs, now_ms, indent=None if args.watch else 2, view=view) + "\n")
    elif clear and out.isatty():
        width = shutil.get_terminal_size((120, 40)).columns
        show(out, fit(render_table(recs, jobs, now_ms, view=view), width), STATE_STYLES, clear=True)
    elif clear:
        out.write(render_table(recs, jobs, now_ms, view=view) + "\n\n")
    else:
        show(out, render_table(recs, jobs, now_ms, view=view), STATE_STYLES)
    out.flush()


async def _follow(kv: KeyValue, on_entry: Callable[[str, bytes | None], None], changed: asyncio.Event) -> None:
    """Apply every change of ``kv`` (initial values first) until cancelled."""
    watcher = await kv.watchall()
    try:
        while True:
            try:
                entry = await watcher.updates(timeout=5)  # type: ignore[no-untyped-call]
            except NatsTimeoutError:
                continue
            if entry is None:
                continue  # "initial values done" can come before the initial values (docs/nats.md); nothing waits on it
            deleted = entry.operation in ("DEL", "PURGE") or not entry.value
            on_entry(entry.key, None if deleted else bytes(entry.value))
            changed.set()
    finally:
        with contextlib.suppress(Exception):
            await watcher.stop()  # type: ignore[no-untyped-call]


async def _watch(nc: NATS, view: View, args: argparse.Namespace) -> None:
    groups_kv, jobs_kv = await _bucket(nc, GROUPS_BUCKET), await _bucket(nc, JOBS_BUCKET)
    stop, changed = asyncio.Event(), asyncio.Event()

    def on_stop() -> None:
        stop.set()
        changed.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_stop)

    def on_group(key: str, value: bytes | None) -> None:
        if not is_group_key(key):
            return
        if value is None:
            view.groups.pop(key, None)
            view.unreadable.pop(key, None)
        else:
            _put_group(view, key, value)

    def on_job(key: str, value: bytes | None) -> None:
        if value is None:
            view.jobs.pop(key, None)
        else:
            view.jobs[key] = _ctx_decoder.decode(value)

    gap = 1.0 / args.max_rate
    async with asyncio.TaskGroup() as tg:
        followers = [
            tg.create_task(_follow(groups_kv, on_group, changed)),
            tg.create_task(_follow(jobs_kv, on_job, changed)),
        ]
        try:
            while not stop.is_set():
                await read_control(nc, view, timeout_s=0.5)
                _print(view, args, sys.stdout, clear=True)
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):  # redraw once a second anyway: the clocks move
                        await changed.wait()
                        # bounded refresh: let a burst of changes land before drawing them all at once
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(gap):
                                await stop.wait()
        finally:
            for t in followers:
                t.cancel()


async def run(args: argparse.Namespace) -> int:
    from timeslice_client.bus import connect

    if args.group is not None:
        validate_id("group", args.group)  # a bad id is the caller's mistake, not the bus's
    nc = await connect(args.nats_url, name="timeslice-status")
    try:
        view = await read_view(nc, args.group)
        if not args.watch:
            _print(view, args, sys.stdout, clear=False)
            return 0
        await _watch(nc, view, args)
    finally:
        await nc.close()
    return 0


_rate = in_range("--max-rate", 0.1, 50, "refreshes per second")


def register(sub: Any) -> None:
    """Add ``status`` to the ``timeslice`` command's subparsers."""
    st = sub.add_parser("status", help="groups: state, holder, epoch, held for, queue, and job states per node")
    st.add_argument("--group", default=None, help="one group (default: all)")
    st.add_argument(
        "--json",
        action="store_true",
        help="the stored records and job states as JSON on stdout (with --watch: one document a line)",
    )
    st.add_argument("--watch", action="store_true", help="refresh live as the records change (Ctrl-C to stop)")
    st.add_argument("--max-rate", type=_rate, default=4.0, help="with --watch: at most this many refreshes a second")
    add_nats_flag(st)
    st.set_defaults(func=run)
