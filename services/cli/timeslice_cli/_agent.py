"""``timeslice agent``, ``agent-status`` and ``agent-clear-fault``: the node agent and the questions it answers.

``timeslice agent`` runs the service with the flags of :mod:`timeslice_agent._main` (``python -m timeslice_agent``
takes the same); the other two ask a running agent over the bus and say in one line when none answers.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import msgspec

from ._common import CliError, add_nats_flag, emit_json

__all__ = ["register"]


async def _run_agent(args: argparse.Namespace) -> int:
    from timeslice_agent._main import run_agent

    return await run_agent(args)


async def _rpc(args: argparse.Namespace, verb: str, payload: bytes) -> bytes:
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeoutError
    from timeslice_client.bus import connect
    from timeslice_client.protocol import subjects, validate_id
    from timeslice_client.workload import default_node_id

    node = validate_id("node", args.node_id or default_node_id())
    nc = await connect(args.nats_url)
    try:
        try:
            msg = await nc.request(subjects.agent_rpc(node, verb), payload, timeout=args.timeout)
        except (NoRespondersError, NatsTimeoutError):
            seen = await _agents_seen(nc)
            raise CliError(
                f"no agent answers for node {node!r} (agents on this bus: {', '.join(seen) or 'none'}); "
                "give one of them with --node-id, or start it: `timeslice agent --node-id "
                f"{node}`"
            ) from None
        return bytes(msg.data)
    finally:
        await nc.close()


async def _agents_seen(nc: Any) -> list[str]:
    from timeslice_client.bus import kv_keys
    from timeslice_client.protocol import AGENTS_BUCKET

    try:
        return sorted(await kv_keys(nc, AGENTS_BUCKET))
    except Exception:  # no bucket yet: no orchestrator ran on this bus
        return []


async def _status(args: argparse.Namespace) -> int:
    jobs = msgspec.json.decode(await _rpc(args, "status", b""))
    if args.json:
        emit_json(jobs)
        return 0
    print(f"{'JOB':<20} {'GROUP':<16} {'STATE':<14} {'BACKENDS':<22} {'PROCESSES':<16} LAST OP")
    for j in jobs:
        outcome = (
            ("running" if j.get("state") == "TRANSITIONING" else "")
            if j.get("last_op_ok") is None
            else ("ok" if j.get("last_op_ok") else (j.get("last_op_error") or "failed"))
        )
        last = f"{j.get('last_op_id') or '-'} {outcome}"
        parts = [j, *(j.get("parts") or ())]  # a job of several processes here: each registered as a part
        pids = list(dict.fromkeys(p for part in parts for p in part.get("pids") or ()))
        backends = "+".join(dict.fromkeys(b for part in parts for b in part.get("backends") or ()))
        procs = _processes(pids, j.get("pgid"))
        print(f"{j['job']:<20} {j['group']:<16} {j['state']:<14} {backends:<22} {procs:<16} {last}")
        if j.get("reason"):
            print(f"{'':<20} reason: {j['reason']}")
    return 0


def _processes(pids: list[int] | tuple[int, ...], pgid: int | None) -> str:
    """The job's processes as the agent holds them: ``pid 123``, ``pids 1,2,3``, ``+pgid 123``; ``-``: none."""
    shown = (
        (
            f"pid {pids[0]}"
            if len(pids) == 1
            else f"pids {','.join(map(str, pids[:4]))}" + ("…" if len(pids) > 4 else "")
        )
        if pids
        else ""
    )
    group = f"pgid {pgid}" if pgid is not None else ""
    return " +".join(p for p in (shown, group) if p) or "-"


async def _clear(args: argparse.Namespace) -> int:
    from timeslice_client.protocol import AgentReply, ClearJobFault, encode, validate_id

    job = validate_id("job", args.job)
    reply = msgspec.json.decode(await _rpc(args, "clear_fault", encode(ClearJobFault(job=job))), type=AgentReply)
    if not reply.ok:
        raise CliError(f"the agent refused to clear job {job}'s fault: {reply.error}")
    if args.json:
        print(json.dumps({"job": job, "cleared": True, "state": str(reply.state) if reply.state else None}))
    else:
        print(f"job {job}: fault cleared (state {reply.state})")
    return 0


def _timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the agent's answer (default 5)")


def register(sub: Any) -> None:
    from timeslice_agent._main import add_agent_flags

    p = sub.add_parser("agent", help="run the node-local snapshot agent")
    add_agent_flags(p)
    p.set_defaults(func=_run_agent)
    s = sub.add_parser("agent-status", help="jobs on one node and their context states")
    s.add_argument("--node-id", default=None, help="the node to ask (default: $TIMESLICE_NODE_ID or the host name)")
    add_nats_flag(s)
    s.add_argument("--json", action="store_true", help="the agent's answer as JSON on stdout")
    _timeout(s)
    s.set_defaults(func=_status)
    c = sub.add_parser("agent-clear-fault", help="clear a job's FAULTED state on one node (and in its group)")
    c.add_argument("--node-id", default=None, help="the job's node (default: $TIMESLICE_NODE_ID or the host name)")
    c.add_argument("--job", required=True, help="the faulted job's id")
    add_nats_flag(c)
    c.add_argument("--json", action="store_true", help="the outcome as JSON on stdout")
    _timeout(c)
    c.set_defaults(func=_clear)
