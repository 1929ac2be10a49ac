"""The ``timeslice`` command.

Built-in subcommands live here; other packages add theirs through the ``timeslice.cli`` entry-point
group (a callable ``register(subparsers)``), so the agent's CLI needs no import from here and vice
versa.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from timeslice_client._bus_auth import BusAuth, add_auth_flags, auth_from_args, set_process_auth
from timeslice_client._metrics_http import MetricsEndpoint, serve_metrics
from timeslice_client._runner import run
from timeslice_client.bus import nats_url_arg, parse_servers
from timeslice_client.errors import TimeSliceError

from . import _auth_cmd, _check_cmd, _events_cmd, _status_cmd
from ._beside import AgentBeside
from .demo import register as _register_demo
from .replay import _cli as _replay_cli

if TYPE_CHECKING:
    from .embedded import ClusterOptions
    from .service import OrchestratorConfig

__all__ = ["main"]


def _run(coro: Coroutine[Any, Any, int]) -> int:
    return int(run(coro))


def _install_stop(stop: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop)


# ---------------------------------------------------------------------- orchestrator / up


async def _orchestrator(args: argparse.Namespace) -> int:
    from .metrics import OrchestratorMetrics
    from .service import Orchestrator, OrchestratorConfig

    cfg = _replicated(OrchestratorConfig(nats_url=args.nats_url) if args.nats_url else OrchestratorConfig(),
                      args.replicas)
    beside = AgentBeside(args.with_agent, cfg.nats_url, _metrics_registry()) if args.with_agent else None
    orch = Orchestrator(cfg, metrics=OrchestratorMetrics(_metrics_registry()), local_agent=beside)
    _install_stop(orch.shutdown)
    async with serve_metrics(orch.metrics.registry, args.metrics_port, args.metrics_host), \
            _beside_metrics(beside, args.agent_metrics_port, args.metrics_host):
        if _grpc_wanted(args):
            # imported only when asked for: without --grpc-port the orchestrator needs no gRPC packages
            from . import grpc_shim

            await grpc_shim.run_beside(orch, grpc_shim.from_args(args, cfg.nats_url))
        else:
            await orch.run()
    return 0


def _beside_metrics(beside: AgentBeside | None, port: int,
                    host: str) -> contextlib.AbstractAsyncContextManager[MetricsEndpoint | None]:
    """The in-process agent's metrics endpoint; nothing without one (an agent process serves its own)."""
    if beside is None:
        return contextlib.nullcontext(None)
    return serve_metrics(beside.metrics.registry, port, host)


def _grpc_wanted(args: argparse.Namespace) -> bool:
    """Whether the flags turn the gRPC API on (``--grpc-port`` given and not negative)."""
    port = getattr(args, "grpc_port", None)
    return port is not None and port >= 0


def _metrics_registry() -> Any:
    """A registry for a served process: its metrics plus the standard process and Python collectors."""
    from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def _replicated(cfg: OrchestratorConfig, replicas: int | None) -> OrchestratorConfig:
    """``cfg`` with the stream and buckets at ``replicas`` copies (None: as configured, e.g. ``$TIMESLICE_BUS``)."""
    if replicas is None:
        return cfg
    return cfg.model_copy(update={"bus": cfg.bus.model_copy(update={"replicas": replicas})})


def _replicas(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 5:
        raise argparse.ArgumentTypeError(f"--replicas {n}: give 1 to 5 (at most the number of NATS servers)")
    return n


def _data_dir(given: str | None, default: Path | None = None) -> Path:
    return Path(given).expanduser() if given else (default or Path.home() / ".timeslice" / "data")


async def _up(args: argparse.Namespace) -> int:
    from timeslice_client.bus import local_creds_file, url_file
    from timeslice_client.workload import default_node_id

    from . import grpc_shim
    from .embedded import NatsServer
    from .metrics import OrchestratorMetrics
    from .service import Orchestrator, OrchestratorConfig

    data_dir = _data_dir(args.data_dir)
    cluster = _cluster(args)
    # Auth on unless --no-auth: the keys in the data dir (or --auth-dir, shared by a cluster's servers), the
    # orchestrator's identity for this process, the agent's and the local user's written when ready.
    ups = None if args.no_auth else _auth_cmd.UpAuth(_data_dir(args.auth_dir, data_dir / "auth"))
    server = NatsServer(data_dir, port=args.port, host=args.host, cluster=cluster,
                        server_name=args.server_name or (default_node_id() if cluster else None),
                        extra_args=("-c", str(ups.server_config)) if ups else ())
    if ups is not None:
        set_process_auth(BusAuth(creds=ups.orchestrator, source="timeslice up"))
    url = await server.astart()
    if ups is None:
        _auth_cmd.warn_no_auth(url)
    if cluster is not None:
        try:
            await server.wait_jetstream(args.cluster_wait)
        except BaseException:
            await server.astop()
            raise
    advert = url_file()
    agent: asyncio.subprocess.Process | None = None
    try:
        # The agent runs in this process unless asked otherwise: its commands then skip a bus hop (_beside.py).
        beside = None if args.no_agent or args.agent_process else AgentBeside(args.node_id, url, _metrics_registry())
        orch = Orchestrator(_replicated(OrchestratorConfig(nats_url=url), args.replicas),
                            metrics=OrchestratorMetrics(_metrics_registry()), local_agent=beside)
        shim = (grpc_shim.from_args(args, url, host=args.host, auth_dir=data_dir / "auth")
                if _grpc_wanted(args) else None)
        _install_stop(orch.shutdown)
        async with serve_metrics(orch.metrics.registry, args.metrics_port, args.host) as metrics, \
                _beside_metrics(beside, args.agent_metrics_port, args.host) as beside_metrics, \
                asyncio.TaskGroup() as tg:
            run = tg.create_task(grpc_shim.run_beside(orch, shim))
            ready = tg.create_task(grpc_shim.ready(orch, shim))
            await asyncio.wait({run, ready}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                node = "-"
                port = args.agent_metrics_port
                agent_metrics = "-" if port < 0 else f"http://{args.host}:{port or '<logged>'}/metrics"
                if beside is not None:
                    node = f"{beside.node} (in this process)"
                    agent_metrics = beside_metrics.url if beside_metrics else "-"
                elif not args.no_agent:
                    agent, node = await _start_agent(url, args.node_id, orch.shutdown,
                                                     metrics=(args.agent_metrics_port, args.host), ups=ups)
                advert.parent.mkdir(parents=True, exist_ok=True)
                creds = ups.local(local_creds_file()) if ups is not None else "-"  # before the URL: clients use both
                advert.write_text(url + "\n")
                print(f"timeslice up: nats={url} orchestrator=ready grpc={shim.address if shim else '-'} "
                      f"agent={node} data={data_dir} metrics={metrics.url if metrics else '-'} "
                      f"agent-metrics={agent_metrics} url-file={advert} creds={creds} (Ctrl-C to stop)", flush=True)
            else:
                ready.cancel()
    finally:
        if agent is not None and agent.returncode is None:
            agent.terminate()
            try:
                await asyncio.wait_for(agent.wait(), 15)
            except TimeoutError:
                agent.kill()
                await agent.wait()
        with contextlib.suppress(OSError):
            if advert.exists() and advert.read_text().strip() == url:
                advert.unlink()
        await server.astop()
    print("timeslice up: stopped", flush=True)
    return 0


def _cluster(args: argparse.Namespace) -> ClusterOptions | None:
    """The embedded server's cluster, from ``up``'s flags (None: a server alone)."""
    from .embedded import ClusterOptions

    if args.routes is None:
        if args.replicas is not None and args.replicas > 1:
            raise TimeSliceError(f"--replicas {args.replicas} needs a NATS cluster: give --routes and --cluster-port "
                                 "to join the embedded server to one (docs/cluster.md)")
        return None
    if args.cluster_port is None:
        raise TimeSliceError("--routes needs --cluster-port (the port this server's routes listen on)")
    return ClusterOptions(port=args.cluster_port, routes=parse_servers(args.routes), name=args.cluster_name)


async def _start_agent(
    url: str, node_id: str | None, on_exit: Callable[[], None], *, metrics: tuple[int, str] = (-1, "127.0.0.1"),
    ups: _auth_cmd.UpAuth | None = None,
) -> tuple[asyncio.subprocess.Process, str]:
    """The node's snapshot agent as its own process (the agent and orchestrator share only messages), with its own
    credentials (by path in its environment: nothing secret on its command line)."""
    from timeslice_client.bus import connect
    from timeslice_client.protocol import AGENTS_BUCKET
    from timeslice_client.workload import default_node_id

    node = node_id or default_node_id()
    env = dict(os.environ, TIMESLICE_CREDS=str(ups.agent(node))) if ups is not None else None
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "timeslice_agent", "--node-id", node,
                                                "--nats-url", url, "--metrics-port", str(metrics[0]),
                                                "--metrics-host", metrics[1], env=env)
    nc = await connect(url)
    try:
        kv = await nc.jetstream().key_value(AGENTS_BUCKET)
        async with asyncio.timeout(30):
            while True:
                if proc.returncode is not None:
                    raise RuntimeError(f"the agent exited with {proc.returncode}")
                with contextlib.suppress(Exception):
                    if (await kv.get(node)).value:
                        break
                await asyncio.sleep(0.05)  # polling the agent's first heartbeat, bounded by the timeout above
    finally:
        await nc.close()
    return proc, node


# ---------------------------------------------------------------------- status and friends


async def _clear_fault(args: argparse.Namespace) -> int:
    from timeslice_client.bus import connect
    from timeslice_client.protocol import ClearFault, encode, subjects

    nc = await connect(args.nats_url)
    try:
        js = nc.jetstream()
        await js.publish(subjects.ctl(args.group, "clear_fault"), encode(ClearFault(group=args.group, job=args.job)))
    finally:
        await nc.close()
    print(f"fault of job {args.job} in group {args.group} cleared")
    return 0


# ---------------------------------------------------------------------- wiring


def _grpc_flags(parser: argparse.ArgumentParser, default_port: int | None) -> None:
    """The gRPC API's flags (read by ``grpc_shim.from_args``)."""
    off = "off unless given" if default_port is None else f"default {default_port}"
    parser.add_argument("--grpc-port", type=int, default=default_port,
                        help=f"serve the gRPC API on this port ({off}; 0: any free port; -1: off)")
    parser.add_argument("--grpc-host", default=None,
                        help="address the gRPC API listens on (default 127.0.0.1; `up`: its --host); without TLS "
                             "only loopback addresses serve, unless --grpc-insecure")
    parser.add_argument("--grpc-tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS")
    parser.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert")
    parser.add_argument("--grpc-tls-client-ca", default=None,
                        help="PEM CA certificate: mutual TLS, clients must present a certificate it signed")
    from timeslice_client._grpc.auth_config import add_auth_flags

    add_auth_flags(parser, health=True)  # who may call it (docs/security.md ("Identities on the gRPC APIs"))


def _replicas_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=_replicas, default=None, metavar="N",
                        help="copies of the stream and buckets on a NATS cluster, 1..5, when they are created "
                             "(default: $TIMESLICE_BUS's, else 1); an existing one with another count is kept, "
                             "with a warning (docs/cluster.md)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="timeslice", description="Cooperative GPU time-slicing for RL jobs")
    p.add_argument("--log-level", default=os.environ.get("TIMESLICE_LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run NATS, the orchestrator and an agent on this host")
    up.add_argument("--data-dir", help="JetStream data directory (default ~/.timeslice/data)")
    up.add_argument("--port", type=int, default=None, help="NATS client port (default: a free port)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--node-id", default=None, help="the agent's node id (default: $TIMESLICE_NODE_ID or host name)")
    up.add_argument("--no-agent", action="store_true", help="run NATS and the orchestrator only")
    up.add_argument("--no-auth", action="store_true",
                    help="run NATS without credentials: anyone who reaches it may do anything (default: auth on, "
                         "keys in <data-dir>/auth, the local user's credentials beside the URL file)")
    up.add_argument("--auth-dir", default=None, help="the auth dir (default <data-dir>/auth; the servers of a "
                                                     "cluster share one: `timeslice auth init --dir D`)")
    _replicas_flag(up)
    up.add_argument("--routes", default=None, metavar="URL[,URL...]",
                    help="join the embedded NATS server to a cluster: the route URLs of all its servers, e.g. "
                         "nats://10.0.0.1:6222,nats://10.0.0.2:6222,nats://10.0.0.3:6222 (docs/cluster.md)")
    up.add_argument("--cluster-port", type=int, default=None, help="with --routes: the port this server's routes "
                                                                   "listen on (at --host)")
    up.add_argument("--cluster-name", default="timeslice", help="with --routes: the cluster's name (default timeslice)")
    up.add_argument("--server-name", default=None, help="with --routes: this server's name in the cluster, stable "
                                                        "across restarts (default: the node id)")
    up.add_argument("--cluster-wait", type=float, default=120.0,
                    help="with --routes: seconds to wait for a majority of the cluster's servers (default 120)")
    up.add_argument("--agent-process", action="store_true",
                    help="run the agent as a process of its own (default: in the orchestrator's process, where its "
                         "commands skip a bus hop)")
    _grpc_flags(up, default_port=50051)
    up.add_argument("--metrics-port", type=int, default=9464,
                    help="the orchestrator's Prometheus metrics on this port at --host (default 9464; 0: any; -1: off)")
    up.add_argument("--agent-metrics-port", type=int, default=9465,
                    help="the agent's Prometheus metrics on this port at --host (default 9465; -1: off)")
    up.set_defaults(func=_up)

    orch = sub.add_parser("orchestrator", help="run the orchestrator against a NATS server")
    orch.add_argument("--nats-url", type=nats_url_arg, default=None,
                      help="NATS server(s), comma-separated, e.g. nats://a:4222,nats://b:4222,nats://c:4222 "
                           "(default: $TIMESLICE_NATS_URL or what `timeslice up` wrote)")
    _replicas_flag(orch)
    _grpc_flags(orch, default_port=None)
    orch.add_argument("--metrics-port", type=int, default=-1,
                      help="serve Prometheus metrics at /metrics on this port (0: any free port; default -1: off)")
    orch.add_argument("--metrics-host", default="127.0.0.1",
                      help="address the metrics endpoint listens on (default 127.0.0.1: this host only; 0.0.0.0: "
                           "every interface)")
    orch.add_argument("--with-agent", metavar="NODE_ID", default=None,
                      help="also run this node's snapshot agent in this process, on the orchestrator's connection "
                           "(its commands skip a bus hop; as `timeslice up` runs it)")
    orch.add_argument("--agent-metrics-port", type=int, default=-1,
                      help="with --with-agent: serve the agent's metrics on this port at --metrics-host (default -1: "
                           "off)")
    orch.set_defaults(func=_orchestrator)

    _status_cmd.register(sub)
    _events_cmd.register(sub)
    _replay_cli.register(sub)
    _check_cmd.register(sub)
    _register_demo(sub)

    cf = sub.add_parser("clear-fault", help="clear a job's fault in a group")
    cf.add_argument("--group", required=True)
    cf.add_argument("--job", required=True)
    cf.add_argument("--nats-url", type=nats_url_arg, default=None, help="NATS server(s), comma-separated")
    cf.set_defaults(func=_clear_fault)
    _auth_cmd.register(sub)

    for ep in entry_points(group="timeslice.cli"):
        with contextlib.suppress(Exception):
            ep.load()(sub)
    for cmd in sub.choices.values():  # every command that connects to NATS: its identity and TLS (docs/security.md)
        if cmd is not up and any("--nats-url" in a.option_strings for a in cmd._actions):
            add_auth_flags(cmd)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from ._logging import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    set_process_auth(auth_from_args(args))  # --creds / --tls-*: every connection of this process
    try:
        return _run(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from timeslice_client.errors import TimeSliceError

        if isinstance(exc, TimeSliceError):
            print(f"timeslice: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
