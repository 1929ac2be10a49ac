"""A NATS cluster on loopback for tests: ``size`` nats-server processes with JetStream, each with its own store
directory, client port and route port (chosen free once, kept across restarts, so a restarted node comes back
where its peers and clients look for it).

Ready when every node's log says ``Server is ready`` (``NatsServer.start``) and JetStream answers on every node,
which needs an elected meta leader (``NatsServer.wait_jetstream``). ``stop``/``kill``/``restart`` act on one node;
``stream_leader`` says which node leads a stream (``js.stream_info(...).cluster.leader``).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError
from timeslice_client.bus import connect
from timeslice_orchestrator.embedded import ClusterOptions, NatsServer

from .helpers import eventually

__all__ = ["NatsCluster", "free_ports"]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (held together while chosen, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


class NatsCluster:
    """``size`` clustered nats-servers named ``n0``, ``n1``, ... Use ``start()``, ``await ready()``, ``close()``."""

    def __init__(self, root: Path, size: int = 3, name: str = "tstest") -> None:
        ports = free_ports(2 * size)
        client, route = ports[:size], ports[size:]
        routes = [f"nats://127.0.0.1:{p}" for p in route]
        self.names = [f"n{i}" for i in range(size)]
        self.nodes = [
            NatsServer(
                root / self.names[i],
                port=client[i],
                server_name=self.names[i],
                cluster=ClusterOptions(port=route[i], routes=routes, name=name),
            )
            for i in range(size)
        ]
        self.urls = [f"nats://127.0.0.1:{p}" for p in client]  # known before start, stable across restarts

    @property
    def url(self) -> str:
        """All the nodes, comma-separated (what ``--nats-url`` takes)."""
        return ",".join(self.urls)

    def start(self, timeout: float = 15.0) -> None:
        for node in self.nodes:
            node.start(timeout)

    async def ready(self, timeout: float = 30.0) -> None:
        """Every running node's JetStream answers (a meta leader was elected)."""
        for node in self.nodes:
            if node.proc is not None:
                await node.wait_jetstream(timeout)

    def stop(self, i: int) -> None:
        self.nodes[i].stop()

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    async def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start node ``i`` again (same ports, same store) and wait until its JetStream answers."""
        await self.nodes[i].astart()
        await self.nodes[i].wait_jetstream(timeout)

    def running(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.proc is not None and n.proc.poll() is None]

    async def stream_info_replicas(self, stream: str) -> tuple[str | None, int, list[bool]]:
        """(leader's name, configured replicas, each follower current?) of ``stream``, asked of a running node."""
        nc = await connect([self.urls[i] for i in self.running()], name="test-cluster-info", connect_timeout_s=2)
        try:
            info = await nc.jetstream(timeout=2).stream_info(stream)
        finally:
            await nc.close()
        cl = info.cluster
        peers = [bool(p.current) for p in (cl.replicas or [])] if cl else []
        return (cl.leader if cl else None), int(info.config.num_replicas or 1), peers

    async def stream_leader(self, stream: str, timeout: float = 20.0) -> int:
        """The index of the node that leads ``stream`` (waiting while it has none, e.g. during an election)."""

        async def leader() -> str:  # "" while there is none
            try:
                name, _, _ = await self.stream_info_replicas(stream)
            except (NotFoundError, TimeoutError, OSError):
                return ""
            except Exception as exc:  # nats-py's own timeouts and "no responders" while electing
                if exc.__class__.__name__ in (
                    "TimeoutError",
                    "NoRespondersError",
                    "ServiceUnavailableError",
                    "Unavailable",
                    "ServerError",
                ):
                    return ""
                raise
            return name if name in self.names else ""

        return self.names.index(
            await eventually(leader, timeout=timeout, interval=0.05, what=f"a leader of stream {stream}")
        )

    async def wait_current(self, stream: str, timeout: float = 30.0) -> None:
        """Until ``stream`` has a leader and every one of its replicas is current (caught up)."""

        async def current() -> str:  # the leader's name once all are current, else ""
            try:
                name, n, peers = await self.stream_info_replicas(stream)
            except Exception:
                return ""
            return name or "" if len(peers) == n - 1 and all(peers) else ""

        leader: str = await eventually(
            current, timeout=timeout, interval=0.05, what=f"every replica of {stream} current"
        )
        assert leader

    def close(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    """A started 3-node loopback cluster whose JetStream answers; closed after the test."""
    c = NatsCluster(tmp_path / "cluster")
    try:
        c.start()
        await c.ready()
        yield c
    finally:
        c.close()
