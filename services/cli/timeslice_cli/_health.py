"""``timeslice health``: is the time-slicing stack able to grant, right now? One line per check, exit 1 on a failure.

Checks, in order (each bounded by ``--timeout``; one that cannot be read fails, it is never skipped):

* ``bus``: a NATS server of ``--nats-url`` answers (with this identity);
* ``stream``: the ``TIMESLICE`` stream exists and, on a cluster, has a leader (its replicas and lag are shown);
* ``orchestrator``: an orchestrator holds the leader lease (its instance, term and age);
* ``agents``: the node agents whose heartbeats are live; every ``--node-id`` given must be among them (without
  one, no agent at all is a warning: the lock works without agents, switches then move no state);
* ``groups``: no group is quarantined and every group record decodes; a faulted job is a warning.

``--json`` prints ``{"ok": ..., "checks": [{"name", "status", "detail"}, ...]}`` on stdout; ``--strict`` makes a
warning fail too. Exit codes: 0 healthy (warnings allowed unless ``--strict``), 1 a check failed, 2 a usage error.
Meant for people and for probes: a Kubernetes ``exec`` probe or a job's entrypoint can run it before starting.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ._common import add_nats_flag, emit_json, in_range
from ._term import show

__all__ = ["Check", "Status", "register", "run_checks"]


_STYLES = (
    (r"(?m)^OK\b", "green"),
    (r"(?m)^WARN\b", "yellow"),
    (r"(?m)^FAIL\b", "bold red"),
    (r"(?m)^healthy$", "bold green"),
    (r"(?m)^NOT healthy$", "bold red"),
)


_MAX_SHOWN = 8  # agents, and backends of one agent, named in the line


class Status(enum.StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str


def _age(ms: int) -> str:
    s = max(0.0, (time.time() * 1000 - ms) / 1000)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


async def _stream(nc: Any, timeout: float) -> Check:
    from timeslice_client.protocol import STREAM

    try:
        async with asyncio.timeout(timeout):
            info = await nc.jetstream().stream_info(STREAM)
    except Exception as exc:
        return Check(
            "stream",
            Status.FAIL,
            f"stream {STREAM} cannot be read ({type(exc).__name__}); an "
            "orchestrator creates it: `timeslice up` or `timeslice orchestrator`",
        )
    replicas = info.config.num_replicas or 1
    cluster = info.cluster
    if replicas > 1 and (cluster is None or not cluster.leader):
        return Check(
            "stream",
            Status.FAIL,
            f"stream {STREAM} ({replicas} replicas) has no leader: the NATS "
            "cluster is electing one, or has lost its quorum",
        )
    where = f", leader {cluster.leader}" if cluster is not None and cluster.leader else ""
    lagging = (
        [r.name for r in (cluster.replicas or []) if cluster is not None and (not r.current or r.offline)]
        if cluster is not None
        else []
    )
    detail = f"{STREAM}: {info.state.messages} messages, {replicas} replica{'s' if replicas > 1 else ''}{where}"
    if lagging:
        return Check("stream", Status.WARN, f"{detail}; replicas behind or offline: {', '.join(lagging)}")
    return Check("stream", Status.OK, detail)


async def _orchestrator(nc: Any, timeout: float) -> Check:
    from timeslice_orchestrator._leadership import read_leader

    try:
        leader = await read_leader(nc.jetstream(), timeout=timeout)
    except Exception as exc:
        return Check("orchestrator", Status.FAIL, f"the leader lease cannot be read ({type(exc).__name__})")
    if leader is None:
        return Check(
            "orchestrator",
            Status.FAIL,
            "no orchestrator leads: nothing is granted until one runs "
            "(`timeslice up`, or `timeslice orchestrator --nats-url URL`)",
        )
    return Check("orchestrator", Status.OK, f"{leader.holder} leads, term {leader.term}, for {_age(leader.since_ms)}")


async def _agents(nc: Any, timeout: float, nodes: list[str]) -> Check:
    import msgspec
    from timeslice_client.bus import kv_keys
    from timeslice_client.protocol import AGENTS_BUCKET, AgentInfo

    try:
        async with asyncio.timeout(timeout):
            kv = await nc.jetstream().key_value(AGENTS_BUCKET)
            live: dict[str, AgentInfo] = {}
            for key in await kv_keys(nc, AGENTS_BUCKET):
                try:
                    entry = await kv.get(key)
                    if entry.value:
                        live[key] = msgspec.json.decode(entry.value, type=AgentInfo)
                except Exception:  # deleted since (its TTL), or a record this version cannot read: not live
                    continue
    except Exception as exc:
        return Check("agents", Status.FAIL, f"the agents' heartbeats cannot be read ({type(exc).__name__})")
    missing = [n for n in nodes if n not in live]
    shown = _agents_shown(live)
    if missing:
        return Check(
            "agents",
            Status.FAIL,
            f"no live agent on {', '.join(missing)} (start `timeslice agent "
            f"--node-id {missing[0]}` there); live: {shown}",
        )
    if not live:
        return Check(
            "agents",
            Status.WARN,
            "no node agent runs: the lock works, but switches move no state (`timeslice agent` on each GPU node)",
        )
    return Check("agents", Status.OK, f"{len(live)} live: {shown}")


def _agents_shown(live: dict[str, Any]) -> str:
    """The live agents, as a line of bounded length: each record is anyone's write into KV ``agents``."""

    def one(node: str, a: Any) -> str:
        backends = "+".join(_cut(b, 32) for b in a.backends[:_MAX_SHOWN]) or "no backends"
        return f"{_cut(node, 64)} ({backends}, up {_age(a.started_at_ms)})"

    names = sorted(live)
    more = f", and {len(names) - _MAX_SHOWN} more" if len(names) > _MAX_SHOWN else ""
    return (", ".join(one(n, live[n]) for n in names[:_MAX_SHOWN]) + more) or "none"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


async def _groups(nc: Any, timeout: float) -> Check:
    from ._status import read_view

    try:
        async with asyncio.timeout(timeout):
            view = await read_view(nc)
    except Exception as exc:
        return Check("groups", Status.FAIL, f"the group records cannot be read ({type(exc).__name__}: {exc})")
    bad = [f"{g} (quarantined: {why})" for g, why in sorted(view.quarantined.items())]
    bad += [f"{k} (unreadable: {why})" for k, why in sorted(view.unreadable.items())]
    if bad:
        return Check(
            "groups",
            Status.FAIL,
            f"{len(bad)} not served: {'; '.join(bad[:5])}{' …' if len(bad) > 5 else ''} (docs/availability.md)",
        )
    faulted = sorted(f"{j} in {g}" for g, r in view.groups.items() for j in r.faulted)
    held = sum(1 for r in view.groups.values() if r.holder is not None)
    detail = f"{len(view.groups)} groups, {held} held"
    if faulted:
        return Check(
            "groups",
            Status.WARN,
            f"{detail}; faulted: {', '.join(faulted[:5])}{' …' if len(faulted) > 5 else ''} (`timeslice clear-fault`)",
        )
    return Check("groups", Status.OK, detail)


async def run_checks(nats_url: str | None, *, timeout: float = 5.0, nodes: list[str] | None = None) -> list[Check]:
    """Every check, in order; the bus's failure fails the rest too (they cannot be read)."""
    from timeslice_client.bus import connect
    from timeslice_client.errors import TimeSliceError

    try:
        nc = await connect(nats_url, name="timeslice-health", connect_timeout_s=timeout)
    except TimeSliceError as exc:
        return [Check("bus", Status.FAIL, str(exc))]
    try:
        checks = [Check("bus", Status.OK, f"connected to {nc.connected_url.netloc if nc.connected_url else '?'}")]
        steps: list[Callable[[], Awaitable[Check]]] = [
            lambda: _stream(nc, timeout),
            lambda: _orchestrator(nc, timeout),
            lambda: _agents(nc, timeout, nodes or []),
            lambda: _groups(nc, timeout),
        ]
        for step in steps:
            checks.append(await step())
        return checks
    finally:
        await nc.close()


async def _run(args: argparse.Namespace) -> int:
    from timeslice_client.protocol import validate_id

    nodes = [validate_id("node", n) for n in args.node_id]
    checks = await run_checks(args.nats_url, timeout=args.timeout, nodes=nodes)
    failing = {Status.FAIL, Status.WARN} if args.strict else {Status.FAIL}
    ok = not any(c.status in failing for c in checks)
    if args.json:
        emit_json({"ok": ok, "checks": [{"name": c.name, "status": str(c.status), "detail": c.detail} for c in checks]})
    else:
        width = max(len(c.name) for c in checks)
        lines = [f"{c.status.value.upper():<4}  {c.name:<{width}}  {c.detail}" for c in checks]
        show(sys.stdout, "\n".join([*lines, "healthy" if ok else "NOT healthy"]), _STYLES)
    return 0 if ok else 1


_timeout = in_range("--timeout", 0.1, 300, "seconds")


def register(sub: Any) -> None:
    """Add ``health`` to the ``timeslice`` command's subparsers."""
    h = sub.add_parser(
        "health", help="can the stack grant now? bus, stream, orchestrator, agents, groups; exit 1 when not"
    )
    h.add_argument(
        "--node-id",
        action="append",
        default=[],
        metavar="NODE",
        help="require a live agent on this node (repeat for several)",
    )
    h.add_argument("--strict", action="store_true", help="a warning (no agent, a faulted job) fails too")
    h.add_argument("--timeout", type=_timeout, default=5.0, help="seconds each check may take (default 5)")
    h.add_argument("--json", action="store_true", help="the checks as one JSON document on stdout")
    add_nats_flag(h)
    h.set_defaults(func=_run)
