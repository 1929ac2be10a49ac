"""``timeslice up`` (NATS, the orchestrator and this node's agent on one host), ``timeslice down``, and
``timeslice orchestrator``.

``up`` is one per data dir (``_daemon.UpLock``); its nats-server and agent process die with it; NATS keeps port 4222
unless it is taken; ``--detach`` runs it in the background with its log in the data dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from timeslice_client.bus import parse_servers

from . import _auth, _daemon
from ._common import CliError

if TYPE_CHECKING:
    from timeslice_orchestrator.embedded import ClusterOptions

__all__ = ["register"]


def _data_dir(given: str | None, default: Path | None = None) -> Path:
    return (Path(given).expanduser() if given else (default or Path.home() / ".timeslice" / "data")).absolute()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def _up(args: argparse.Namespace) -> int:
    data_dir = _data_dir(args.data_dir)
    if args.detach:
        return await asyncio.to_thread(_detach, args, data_dir)
    lock = _daemon.UpLock(data_dir)
    lock.acquire()
    try:
        return await _serve(args, data_dir, lock)
    finally:
        lock.release()


async def _serve(args: argparse.Namespace, data_dir: Path, lock: _daemon.UpLock) -> int:
    from timeslice_client._bus_auth import BusAuth, set_process_auth
    from timeslice_client._internal.metrics_http import serve_metrics
    from timeslice_client.bus import local_creds_file, url_file
    from timeslice_client.workload import default_node_id
    from timeslice_orchestrator import grpc_shim
    from timeslice_orchestrator._in_process_agent import AgentBeside
    from timeslice_orchestrator._main import beside_metrics, grpc_wanted, install_stop, metrics_registry, replicated
    from timeslice_orchestrator.embedded import EmbeddedNatsError, NatsServer
    from timeslice_orchestrator.metrics import OrchestratorMetrics
    from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

    cluster = _cluster(args)
    stopped = _daemon.stop_orphans(data_dir, _say)
    # The port this data dir's nats-server had: kept across a restart, so a restart right after a crash (or after
    # stopping an orphan) waits a moment for the dead server to let go of it.
    port = _daemon.pick_port(
        args.host, args.port, _say, wait_s=5.0 if stopped or _daemon.served_default_port(data_dir) else 0.0
    )
    # Auth on unless --no-auth: the keys in the data dir (or --auth-dir, shared by a cluster's servers), the
    # orchestrator's identity for this process, the agent's and the local user's written when ready.
    ups = None if args.no_auth else _auth.UpAuth(_data_dir(args.auth_dir, data_dir / "auth"))

    def nats_server(port: int | None) -> NatsServer:
        return NatsServer(
            data_dir,
            port=port,
            host=args.host,
            cluster=cluster,
            server_name=args.server_name or (default_node_id() if cluster else None),
            extra_args=("-c", str(ups.server_config)) if ups else (),
            preexec=_daemon.die_with_parent(),
        )

    if ups is not None:
        set_process_auth(BusAuth(creds=ups.orchestrator, source="timeslice up"))
    server = nats_server(port)
    try:
        url = await server.astart()
    except EmbeddedNatsError:
        if args.port is not None or port is None or _daemon.port_free(args.host, port):
            raise
        # Another program took the default port between the check above and the server's bind.
        _say(
            f"timeslice up: port {port} at {args.host} was taken as NATS started; it listens on a free port "
            "instead, which clients find through the URL file"
        )
        server = nats_server(None)
        url = await server.astart()
    lock.update(state="starting", url=url, nats_pid=server.pid, log=str(server.log_path))
    if ups is None:
        _auth.warn_no_auth(url)
    if cluster is not None:
        try:
            await server.wait_jetstream(args.cluster_wait)
        except BaseException:
            await server.astop()
            raise
    advert = url_file()
    agent: asyncio.subprocess.Process | None = None
    try:
        # The agent runs in this process unless asked otherwise: its commands then skip a bus hop
        # (_in_process_agent.py).
        beside = None if args.no_agent or args.agent_process else AgentBeside(args.node_id, url, metrics_registry())
        orch = Orchestrator(
            replicated(OrchestratorConfig(nats_url=url), args.replicas),
            metrics=OrchestratorMetrics(metrics_registry()),
            local_agent=beside,
        )
        shim = grpc_shim.from_args(args, url, host=args.host, auth_dir=data_dir / "auth") if grpc_wanted(args) else None
        install_stop(orch.shutdown)
        async with (
            serve_metrics(orch.metrics.registry, args.metrics_port, args.host) as metrics,
            beside_metrics(beside, args.agent_metrics_port, args.host) as agent_endpoint,
            asyncio.TaskGroup() as tg,
        ):
            run = tg.create_task(grpc_shim.run_beside(orch, shim))
            ready = tg.create_task(grpc_shim.ready(orch, shim))
            await asyncio.wait({run, ready}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                node = "-"
                port_ = args.agent_metrics_port
                agent_metrics = "-" if port_ < 0 else f"http://{args.host}:{port_ or '<logged>'}/metrics"
                if beside is not None:
                    node = f"{beside.node} (in this process)"
                    agent_metrics = agent_endpoint.url if agent_endpoint else "-"
                elif not args.no_agent:
                    agent, node = await _start_agent(
                        url, args.node_id, orch.shutdown, metrics=(args.agent_metrics_port, args.host), ups=ups
                    )
                advert.parent.mkdir(parents=True, exist_ok=True)
                creds = ups.local(local_creds_file()) if ups is not None else "-"  # before the URL: clients use both
                advert.write_text(url + "\n")
                grpc = shim.address if shim else "-"
                lock.update(state="ready", grpc=grpc, metrics=metrics.url if metrics else "-", url_file=str(advert))
                print(
                    f"timeslice up: nats={url} orchestrator=ready grpc={grpc} "
                    f"agent={node} data={data_dir} metrics={metrics.url if metrics else '-'} "
                    f"agent-metrics={agent_metrics} url-file={advert} creds={creds} (Ctrl-C or `timeslice down` "
                    "to stop)",
                    flush=True,
                )
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
    from timeslice_orchestrator.embedded import ClusterOptions

    if args.routes is None:
        if args.replicas is not None and args.replicas > 1:
            raise CliError(
                f"--replicas {args.replicas} needs a NATS cluster: give --routes and --cluster-port "
                "to join the embedded server to one (docs/cluster.md)"
            )
        return None
    if args.cluster_port is None:
        raise CliError("--routes needs --cluster-port (the port this server's routes listen on)")
    return ClusterOptions(port=args.cluster_port, routes=parse_servers(args.routes), name=args.cluster_name)


async def _start_agent(
    url: str,
    node_id: str | None,
    on_exit: Callable[[], None],
    *,
    metrics: tuple[int, str] = (-1, "127.0.0.1"),
    ups: _auth.UpAuth | None = None,
) -> tuple[asyncio.subprocess.Process, str]:
    """The node's snapshot agent as its own process (the agent and orchestrator share only messages), with its own
    credentials (by path in its environment: nothing secret on its command line). It dies with this process."""
    from timeslice_client.bus import connect
    from timeslice_client.protocol import AGENTS_BUCKET
    from timeslice_client.workload import default_node_id

    node = node_id or default_node_id()
    env = dict(os.environ, TIMESLICE_CREDS=str(ups.agent(node))) if ups is not None else None
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "timeslice_agent",
        "--node-id",
        node,
        "--nats-url",
        url,
        "--metrics-port",
        str(metrics[0]),
        "--metrics-host",
        metrics[1],
        env=env,
        preexec_fn=_daemon.die_with_parent(),
    )
    nc = await connect(url)
    try:
        kv = await nc.jetstream().key_value(AGENTS_BUCKET)
        async with asyncio.timeout(30):
            while True:
                if proc.returncode is not None:
                    raise CliError(f"the agent process exited with {proc.returncode} before it was ready")
                with contextlib.suppress(Exception):
                    if (await kv.get(node)).value:
                        break
                await asyncio.sleep(0.05)  # polling the agent's first heartbeat, bounded by the timeout above
    finally:
        await nc.close()
    return proc, node


def _detach(args: argparse.Namespace, data_dir: Path) -> int:
    """``up --detach``: the same ``up`` in the background (a session of its own, its output in
    ``<data-dir>/up.log``); returns once it is ready, with its line."""
    info = _daemon.running(data_dir)
    if info is not None:
        raise CliError(
            f"another `timeslice up` runs on data dir {data_dir}: {_daemon.describe(info)}; use it, or "
            f"stop it with `timeslice down --data-dir {data_dir}`"
        )
    argv = [a for a in args.argv if a != "--detach"]
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "up.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "timeslice_cli", *argv, "--data-dir", str(data_dir)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + args.detach_timeout
    while True:
        info = _daemon.running(data_dir)
        if info and info.get("pid") == proc.pid and info.get("state") == "ready":
            print(
                f"timeslice up: running in the background (pid {proc.pid}): nats={info.get('url')} "
                f"grpc={info.get('grpc')} data={data_dir} log={log}; `timeslice down --data-dir {data_dir}` stops it",
                flush=True,
            )
            return 0
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            raise CliError(
                f"the background `timeslice up` exited with {proc.returncode}: "
                f"{tail[0] if tail else '(no output)'} (log {log})"
            )
        if time.monotonic() > deadline:
            _daemon.stop_pid(proc.pid)
            raise CliError(f"the background `timeslice up` was not ready within {args.detach_timeout:g} s (log {log})")
        time.sleep(0.05)  # polling the lock file it writes when ready, bounded by the deadline


async def _down(args: argparse.Namespace) -> int:
    data_dir = _data_dir(args.data_dir)
    info = _daemon.running(data_dir)
    if info is None:
        raise CliError(f"no `timeslice up` runs on data dir {data_dir} (give the one it was started with: --data-dir)")
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 1:
        raise CliError(f"the lock file of data dir {data_dir} names no process to stop ({info})")
    stopped = await asyncio.to_thread(_daemon.stop_pid, pid, args.timeout)
    if not stopped or _daemon.running(data_dir) is not None:
        raise CliError(f"the `timeslice up` of data dir {data_dir} (pid {pid}) did not stop within {args.timeout:g} s")
    print(f"timeslice down: stopped the `timeslice up` of data dir {data_dir} (pid {pid})", flush=True)
    return 0


async def _orchestrator(args: argparse.Namespace) -> int:
    from timeslice_orchestrator._main import run_orchestrator

    return await run_orchestrator(args)


def _add_up(sub: Any) -> argparse.ArgumentParser:
    from timeslice_orchestrator._main import add_grpc_flags, add_replicas_flag

    up: argparse.ArgumentParser = sub.add_parser("up", help="run NATS, the orchestrator and an agent on this host")
    up.add_argument("--data-dir", help="JetStream data directory, one `up` at a time (default ~/.timeslice/data)")
    up.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"NATS client port (default {_daemon.DEFAULT_PORT}, or a free port when that is taken)",
    )
    up.add_argument("--host", default="127.0.0.1", help="address NATS, gRPC and metrics listen on (default 127.0.0.1)")
    up.add_argument("--node-id", default=None, help="the agent's node id (default: $TIMESLICE_NODE_ID or host name)")
    up.add_argument("--no-agent", action="store_true", help="run NATS and the orchestrator only")
    up.add_argument(
        "--no-auth",
        action="store_true",
        help="run NATS without credentials: anyone who reaches it may do anything (default: auth on, "
        "keys in <data-dir>/auth, the local user's credentials beside the URL file)",
    )
    up.add_argument(
        "--auth-dir",
        default=None,
        help="the auth dir (default <data-dir>/auth; the servers of a "
        "cluster share one: `timeslice auth init --dir D`)",
    )
    add_replicas_flag(up)
    up.add_argument(
        "--routes",
        default=None,
        metavar="URL[,URL...]",
        help="join the embedded NATS server to a cluster: the route URLs of all its servers, e.g. "
        "nats://10.0.0.1:6222,nats://10.0.0.2:6222,nats://10.0.0.3:6222 (docs/cluster.md)",
    )
    up.add_argument(
        "--cluster-port",
        type=int,
        default=None,
        help="with --routes: the port this server's routes listen on (at --host)",
    )
    up.add_argument("--cluster-name", default="timeslice", help="with --routes: the cluster's name (default timeslice)")
    up.add_argument(
        "--server-name",
        default=None,
        help="with --routes: this server's name in the cluster, stable across restarts (default: the node id)",
    )
    up.add_argument(
        "--cluster-wait",
        type=float,
        default=120.0,
        help="with --routes: seconds to wait for a majority of the cluster's servers (default 120)",
    )
    up.add_argument(
        "--agent-process",
        action="store_true",
        help="run the agent as a process of its own (default: in the orchestrator's process, where its "
        "commands skip a bus hop)",
    )
    add_grpc_flags(up, default_port=50051)
    up.add_argument(
        "--metrics-port",
        type=int,
        default=9464,
        help="the orchestrator's Prometheus metrics on this port at --host (default 9464; 0: any; -1: off)",
    )
    up.add_argument(
        "--agent-metrics-port",
        type=int,
        default=9465,
        help="the agent's Prometheus metrics on this port at --host (default 9465; -1: off)",
    )
    up.add_argument(
        "--detach",
        action="store_true",
        help="run in the background (output in <data-dir>/up.log); `timeslice down` stops it",
    )
    up.add_argument(
        "--detach-timeout",
        type=float,
        default=60.0,
        help="with --detach: seconds to wait for the background `up` to be ready (default 60)",
    )
    up.set_defaults(func=_up)
    return up


def register(sub: Any) -> None:
    from timeslice_orchestrator._main import add_orchestrator_flags

    _add_up(sub)
    down = sub.add_parser("down", help="stop the `timeslice up` running on a data dir")
    down.add_argument("--data-dir", help="the data dir it runs on (default ~/.timeslice/data)")
    down.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for it to stop before SIGKILL (default 30)"
    )
    down.set_defaults(func=_down)
    orch = sub.add_parser("orchestrator", help="run the orchestrator against a NATS server")
    add_orchestrator_flags(orch)
    orch.set_defaults(func=_orchestrator)
