"""The orchestrator as a service: ``python -m timeslice_orchestrator orchestrator --nats-url URL ...``.

A thin main that builds the orchestrator from its flags and runs it. The ``timeslice`` command (package
``timeslice_cli``) serves the same flags as ``timeslice orchestrator`` and reuses the pieces here for
``timeslice up``; this package needs nothing from it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from timeslice_client._bus_auth import add_auth_flags, auth_from_args, set_process_auth
from timeslice_client._internal.metrics_http import MetricsEndpoint, serve_metrics
from timeslice_client._internal.service_main import add_log_level_flag, add_nats_url_flag, exit_code

from ._errors import ServiceFailed
from ._in_process_agent import AgentBeside

if TYPE_CHECKING:
    from .service import OrchestratorConfig

__all__ = [
    "add_grpc_flags",
    "add_orchestrator_flags",
    "add_replicas_flag",
    "beside_metrics",
    "grpc_wanted",
    "install_stop",
    "main",
    "metrics_registry",
    "replicated",
    "run_orchestrator",
]


def install_stop(stop: Callable[[], None]) -> None:
    """SIGINT and SIGTERM call ``stop`` (a graceful shutdown) in the running loop."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop)


async def run_orchestrator(args: argparse.Namespace) -> int:
    """Run the orchestrator the flags of ``add_orchestrator_flags`` describe, until SIGINT/SIGTERM."""
    from .metrics import OrchestratorMetrics
    from .service import Orchestrator, OrchestratorConfig

    cfg = replicated(
        OrchestratorConfig(nats_url=args.nats_url) if args.nats_url else OrchestratorConfig(), args.replicas
    )
    beside = AgentBeside(args.with_agent, cfg.nats_url, metrics_registry()) if args.with_agent else None
    orch = Orchestrator(cfg, metrics=OrchestratorMetrics(metrics_registry()), local_agent=beside)
    install_stop(orch.shutdown)
    async with (
        serve_metrics(orch.metrics.registry, args.metrics_port, args.metrics_host),
        beside_metrics(beside, args.agent_metrics_port, args.metrics_host),
    ):
        if grpc_wanted(args):
            # imported only when asked for: without --grpc-port the orchestrator needs no gRPC packages
            from . import grpc_shim

            await grpc_shim.run_beside(orch, grpc_shim.from_args(args, cfg.nats_url))
        else:
            await orch.run()
    return 0


def beside_metrics(
    beside: AgentBeside | None, port: int, host: str
) -> contextlib.AbstractAsyncContextManager[MetricsEndpoint | None]:
    """The in-process agent's metrics endpoint; nothing without one (an agent process serves its own)."""
    if beside is None:
        return contextlib.nullcontext(None)
    return serve_metrics(beside.metrics.registry, port, host)


def grpc_wanted(args: argparse.Namespace) -> bool:
    """Whether the flags turn the gRPC API on (``--grpc-port`` given and not negative)."""
    port = getattr(args, "grpc_port", None)
    return port is not None and port >= 0


def metrics_registry() -> Any:
    """A registry for a served process: its metrics plus the standard process and Python collectors."""
    from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def replicated(cfg: OrchestratorConfig, replicas: int | None) -> OrchestratorConfig:
    """``cfg`` with the stream and buckets at ``replicas`` copies (None: as configured, e.g. ``$TIMESLICE_BUS``)."""
    if replicas is None:
        return cfg
    return cfg.model_copy(update={"bus": cfg.bus.model_copy(update={"replicas": replicas})})


def _replicas(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--replicas {text!r}: give a whole number, 1 to 5") from None
    if not 1 <= n <= 5:
        raise argparse.ArgumentTypeError(f"--replicas {n}: give 1 to 5 (at most the number of NATS servers)")
    return n


def add_grpc_flags(parser: argparse.ArgumentParser, default_port: int | None) -> None:
    """The gRPC API's flags (read by ``grpc_shim.from_args``)."""
    off = "off unless given" if default_port is None else f"default {default_port}"
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=default_port,
        help=f"serve the gRPC API on this port ({off}; 0: any free port; -1: off)",
    )
    parser.add_argument(
        "--grpc-host",
        default=None,
        help="address the gRPC API listens on (default 127.0.0.1; `up`: its --host); without TLS "
        "only loopback addresses serve, unless --grpc-insecure",
    )
    parser.add_argument("--grpc-tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS")
    parser.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert")
    parser.add_argument(
        "--grpc-tls-client-ca",
        default=None,
        help="PEM CA certificate: mutual TLS, clients must present a certificate it signed",
    )
    from timeslice_client._internal.grpc_server.auth_config import add_auth_flags as add_grpc_auth_flags

    add_grpc_auth_flags(parser, health=True)  # who may call it (docs/security.md ("Identities on the gRPC APIs"))


def add_replicas_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replicas",
        type=_replicas,
        default=None,
        metavar="N",
        help="copies of the stream and buckets on a NATS cluster, 1..5, when they are created "
        "(default: $TIMESLICE_BUS's, else 1); an existing one with another count is kept, "
        "with a warning (docs/cluster.md)",
    )


def add_orchestrator_flags(orch: argparse.ArgumentParser) -> None:
    """The flags of the orchestrator service (``timeslice orchestrator`` serves the same)."""
    add_nats_url_flag(orch, example="nats://a:4222,nats://b:4222,nats://c:4222")
    add_replicas_flag(orch)
    add_grpc_flags(orch, default_port=None)
    orch.add_argument(
        "--metrics-port",
        type=int,
        default=-1,
        help="serve Prometheus metrics at /metrics on this port (0: any free port; default -1: off)",
    )
    orch.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint listens on (default 127.0.0.1: this host only; 0.0.0.0: every interface)",
    )
    orch.add_argument(
        "--with-agent",
        metavar="NODE_ID",
        default=None,
        help="also run this node's snapshot agent in this process, on the orchestrator's connection "
        "(its commands skip a bus hop; as `timeslice up` runs it)",
    )
    orch.add_argument(
        "--agent-metrics-port",
        type=int,
        default=-1,
        help="with --with-agent: serve the agent's metrics on this port at --metrics-host (default -1: off)",
    )
    add_auth_flags(orch)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m timeslice_orchestrator orchestrator [flags]``: the orchestrator service alone."""
    from ._logging import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "orchestrator":
        print(
            "python -m timeslice_orchestrator runs the orchestrator service only: `python -m timeslice_orchestrator "
            "orchestrator --nats-url URL`; every other command is `timeslice ...` (python -m timeslice_cli)",
            file=sys.stderr,
        )
        return 2
    parser = argparse.ArgumentParser(
        prog="python -m timeslice_orchestrator orchestrator",
        description="the timeslice orchestrator against a NATS server or cluster",
    )
    add_log_level_flag(parser)
    add_orchestrator_flags(parser)
    args = parser.parse_args(argv[1:])
    setup_logging(args.log_level)
    set_process_auth(auth_from_args(args))
    log = logging.getLogger("timeslice.orchestrator")
    # ServiceFailed: stopped on its own error, which the log shows
    return exit_code(run_orchestrator(args), "orchestrator", log, logged=(ServiceFailed,))
