"""The agent as a service: ``python -m timeslice_agent [--node-id N] [--nats-url URL[,URL...]] ...``.

A thin main that builds the agent from its flags and runs it. The ``timeslice`` command (package
``timeslice_cli``) serves the same flags as ``timeslice agent``; this package needs nothing from it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from timeslice_client._bus_auth import add_auth_flags as add_bus_auth_flags
from timeslice_client._bus_auth import auth_from_args, set_process_auth
from timeslice_client._internal.service_main import add_log_level_flag, add_nats_url_flag, exit_code

from ._config import DEFAULT_GRPC_PORT

__all__ = ["add_agent_flags", "main", "run_agent"]


async def run_agent(args: argparse.Namespace) -> int:
    """Run the agent the flags of ``add_agent_flags`` describe, until SIGINT/SIGTERM."""
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
    if args.default_backend:
        kwargs["default_backend"] = args.default_backend
    if args.pods:
        kwargs["pods"] = True
    for flag in ("pod_api", "pod_token_file", "pod_ca_file", "pod_node_name", "pod_scan_s", "pod_default_group"):
        if (value := getattr(args, flag)) is not None:
            kwargs[flag] = value
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


def add_agent_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the agent service (``timeslice agent`` serves the same)."""
    p.add_argument("--node-id", default=None, help="this node's id (default: $TIMESLICE_NODE_ID or the host name)")
    add_nats_url_flag(p)
    p.add_argument(
        "--grpc-port",
        type=int,
        nargs="?",
        const=DEFAULT_GRPC_PORT,
        default=None,
        help="serve the standalone SnapshotAgentService on this port (off unless given; alone: "
        f"{DEFAULT_GRPC_PORT}, the reference agent's; 0: any free port)",
    )
    p.add_argument("--grpc-host", default=None, help="address of the gRPC API (default 127.0.0.1: node-local)")
    p.add_argument("--grpc-tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS")
    p.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert")
    p.add_argument("--grpc-tls-client-ca", default=None, help="PEM CA certificate: require client certificates")
    from timeslice_client._internal.grpc_server.auth_config import add_auth_flags

    add_auth_flags(p)  # who may call it (docs/security.md ("Identities on the gRPC APIs"))
    p.add_argument(
        "--metrics-port",
        type=int,
        default=-1,
        help="serve Prometheus metrics at /metrics on this port (0: any free port; default -1: off)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0 for a scraper elsewhere)",
    )
    p.add_argument(
        "--no-overlap-restores",
        action="store_true",
        help="always restore a job only after the snapshots it follows have ended, even when the node "
        "has room for both contexts (default: overlap them then; "
        "$TIMESLICE_AGENT_OVERLAP_RESTORES=false does the same)",
    )
    p.add_argument(
        "--socket",
        default=None,
        metavar="PATH",
        help="the node-local Unix socket where jobs prove their processes ({node} becomes the node id; "
        "default: $TIMESLICE_AGENT_SOCKET, else /run/timeslice/agent-<node>.sock as root, else under "
        "$XDG_RUNTIME_DIR/timeslice or /tmp/timeslice-<uid>; 'off': none, so only backends that "
        "touch no process can be registered). Its directory must be the agent's, not writable by "
        "others; the socket is 0666",
    )
    p.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        default=[],
        metavar="UID",
        help="a uid a job's processes may run as besides the registering process's own (repeatable; "
        "$TIMESLICE_AGENT_ALLOWED_UIDS=1000,1001)",
    )
    p.add_argument(
        "--allow-other-uids",
        action="store_true",
        help="let a job's proven processes run as any uid (default: only the registering process's uid "
        "and --allow-uid; $TIMESLICE_AGENT_ALLOW_OTHER_UIDS=true)",
    )
    p.add_argument(
        "--default-backend",
        default=None,
        metavar="NAME",
        help="what a job that only acquires and yields (no handler registered) gets for its process: "
        "'auto' (default): the driver checkpoint (cuda) where this node can run it, else the lock "
        "alone; 'none': the lock alone; or a backend's name, e.g. freeze "
        "($TIMESLICE_AGENT_DEFAULT_BACKEND)",
    )
    pods = p.add_argument_group(
        "Kubernetes pods",
        "bind the processes of this node's pods labelled "
        "timeslice.io/job-id (and timeslice.io/group) to those jobs, with the default backend "
        "(docs/backends.md, 'Without code changes'; the agent needs hostPID and may read pods)",
    )
    pods.add_argument(
        "--pods",
        action="store_true",
        help="find jobs through this node's labelled pods: their processes by cgroup in /proc, those "
        "holding GPU memory where NVML works ($TIMESLICE_AGENT_PODS=1)",
    )
    pods.add_argument(
        "--pod-api",
        default=None,
        metavar="URL",
        help="the Kubernetes API server (default: in-cluster, from the service account and "
        "$KUBERNETES_SERVICE_HOST; $TIMESLICE_AGENT_POD_API)",
    )
    pods.add_argument(
        "--pod-token-file",
        default=None,
        metavar="PATH",
        help="a bearer token for --pod-api, read at every call ($TIMESLICE_AGENT_POD_TOKEN_FILE)",
    )
    pods.add_argument(
        "--pod-ca-file",
        default=None,
        metavar="PATH",
        help="the CA certificate --pod-api's TLS certificate is checked with (default: the system's; "
        "$TIMESLICE_AGENT_POD_CA_FILE)",
    )
    pods.add_argument(
        "--pod-node-name",
        default=None,
        metavar="NAME",
        help="this node's Kubernetes name (default: the node id; $TIMESLICE_AGENT_POD_NODE_NAME)",
    )
    pods.add_argument(
        "--pod-scan-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how often the pods and /proc are read (default 5; $TIMESLICE_AGENT_POD_SCAN_S)",
    )
    pods.add_argument(
        "--pod-default-group",
        default=None,
        metavar="GROUP",
        help="the group of a labelled pod without a timeslice.io/group label (default: none, such a "
        "pod is skipped; $TIMESLICE_AGENT_POD_DEFAULT_GROUP)",
    )
    add_bus_auth_flags(p)  # its identity and TLS on the bus (docs/security.md)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m timeslice_agent [flags]``: the agent alone."""
    parser = argparse.ArgumentParser(prog="python -m timeslice_agent", description="the node-local snapshot agent")
    add_log_level_flag(parser)
    add_agent_flags(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    set_process_auth(auth_from_args(args))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("nats").setLevel(logging.WARNING)
    return exit_code(run_agent(args), "agent", logging.getLogger("timeslice.agent"))
