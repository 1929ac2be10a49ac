"""``timeslice agent …`` subcommands, plugged into the ``timeslice`` command by entry point."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

import msgspec
from timeslice_client._runner import run
from timeslice_client.bus import nats_url_arg

__all__ = ["main", "register"]


async def _run_agent(args: argparse.Namespace) -> int:
    from .service import Agent, AgentConfig

    kwargs: dict[str, Any] = {}
    if args.node_id:
        kwargs["node_id"] = args.node_id
    if args.nats_url:
        kwargs["nats_url"] = args.nats_url
    if args.no_overlap_restores:
        kwargs["overlap_restores"] = False
    if args.socket:
        kwargs["socket"] = args.socket
    if args.allow_uid:
        kwargs["allowed_uids"] = tuple(args.allow_uid)
    if args.allow_other_uids:
        kwargs["allow_other_uids"] = True
    from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

    from .metrics import AgentMetrics, serve_metrics

    registry = CollectorRegistry()  # the agent's metrics and the standard process and Python collectors
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    agent = Agent(AgentConfig(**kwargs), metrics=AgentMetrics(registry))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, agent.shutdown)
    async with serve_metrics(agent.metrics.registry, args.metrics_port, args.metrics_host):
        if args.grpc_port is None:
            await agent.run()
        else:
            from . import grpc_shim

            await grpc_shim.run_beside(agent, grpc_shim.from_args(agent, args))
    return 0


async def _rpc(args: argparse.Namespace, verb: str, payload: bytes) -> bytes:
    from timeslice_client.bus import connect
    from timeslice_client.protocol import subjects
    from timeslice_client.workload import default_node_id

    node = args.node_id or default_node_id()
    nc = await connect(args.nats_url)
    try:
        msg = await nc.request(subjects.agent_rpc(node, verb), payload, timeout=5)
        return bytes(msg.data)
    finally:
        await nc.close()


async def _status(args: argparse.Namespace) -> int:
    data = await _rpc(args, "status", b"")
    jobs = msgspec.json.decode(data)
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    print(f"{'JOB':<20} {'GROUP':<16} {'STATE':<14} {'BACKENDS':<22} LAST OP")
    for j in jobs:
        last = f"{j.get('last_op_id') or '-'} {'ok' if j.get('last_op_ok') else (j.get('last_op_error') or '')}"
        print(f"{j['job']:<20} {j['group']:<16} {j['state']:<14} {'+'.join(j['backends']):<22} {last}")
        if j.get("reason"):
            print(f"{'':<20} reason: {j['reason']}")
    return 0


async def _clear(args: argparse.Namespace) -> int:
    from timeslice_client.protocol import AgentReply, ClearJobFault, encode

    reply = msgspec.json.decode(await _rpc(args, "clear_fault", encode(ClearJobFault(job=args.job))), type=AgentReply)
    if not reply.ok:
        print(f"timeslice: {reply.error}", file=sys.stderr)
        return 2
    print(f"job {args.job}: fault cleared (state {reply.state})")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("agent", help="run the node-local snapshot agent")
    p.add_argument("--node-id", default=None, help="default: $TIMESLICE_NODE_ID or the host name")
    p.add_argument("--nats-url", type=nats_url_arg, default=None,
                   help="NATS server(s), comma-separated (default: $TIMESLICE_NATS_URL or what `timeslice up` wrote)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="serve the standalone SnapshotAgentService on this port (off unless given; 0: any free port)")
    p.add_argument("--grpc-host", default=None, help="address of the gRPC API (default 127.0.0.1: node-local)")
    p.add_argument("--grpc-tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS")
    p.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert")
    p.add_argument("--grpc-tls-client-ca", default=None, help="PEM CA certificate: require client certificates")
    from timeslice_client._grpc.auth_config import add_auth_flags

    add_auth_flags(p)  # who may call it (docs/security.md ("Identities on the gRPC APIs"))
    p.add_argument("--metrics-port", type=int, default=-1,
                   help="serve Prometheus metrics at /metrics on this port (0: any free port; default -1: off)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0 for a scraper elsewhere)")
    p.add_argument("--no-overlap-restores", action="store_true",
                   help="always restore a job only after the snapshots it follows have ended, even when the node "
                        "has room for both contexts (default: overlap them then; "
                        "$TIMESLICE_AGENT_OVERLAP_RESTORES=false does the same)")
    p.add_argument("--socket", default=None, metavar="PATH",
                   help="the node-local Unix socket where jobs prove their processes ({node} becomes the node id; "
                        "default: $TIMESLICE_AGENT_SOCKET, else /run/timeslice/agent-<node>.sock as root, else under "
                        "$XDG_RUNTIME_DIR/timeslice or /tmp/timeslice-<uid>; 'off': none, so only backends that "
                        "touch no process can be registered). Its directory must be the agent's, not writable by "
                        "others; the socket is 0666")
    p.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                   help="a uid a job's processes may run as besides the registering process's own (repeatable; "
                        "$TIMESLICE_AGENT_ALLOWED_UIDS=1000,1001)")
    p.add_argument("--allow-other-uids", action="store_true",
                   help="let a job's proven processes run as any uid (default: only the registering process's uid "
                        "and --allow-uid; $TIMESLICE_AGENT_ALLOW_OTHER_UIDS=true)")
    p.set_defaults(func=_run_agent)
    s = sub.add_parser("agent-status", help="jobs on one node and their context states")
    s.add_argument("--node-id", default=None)
    s.add_argument("--nats-url", type=nats_url_arg, default=None, help="NATS server(s), comma-separated")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_status)
    c = sub.add_parser("agent-clear-fault", help="clear a job's FAULTED state on one node (and in its group)")
    c.add_argument("--node-id", default=None)
    c.add_argument("--job", required=True)
    c.add_argument("--nats-url", type=nats_url_arg, default=None, help="NATS server(s), comma-separated")
    c.set_defaults(func=_clear)


def main(argv: list[str] | None = None) -> int:
    """``python -m timeslice_agent [--node-id N] [--nats-url URL[,URL...]]``: the agent alone."""
    parser = argparse.ArgumentParser(prog="timeslice-agent")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    from timeslice_client._bus_auth import add_auth_flags as add_bus_auth_flags
    from timeslice_client._bus_auth import auth_from_args, set_process_auth

    for cmd in sub.choices.values():  # its identity and TLS on the bus, as under `timeslice agent` (docs/security.md)
        add_bus_auth_flags(cmd)
    args = parser.parse_args(["agent", *(argv if argv is not None else sys.argv[1:])])
    set_process_auth(auth_from_args(args))
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("nats").setLevel(logging.WARNING)
    return int(run(args.func(args)))
