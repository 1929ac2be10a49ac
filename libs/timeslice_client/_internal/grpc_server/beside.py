"""A gRPC shim served beside the service it fronts (the orchestrator's, the agent's): its port, and its lifetime.

Both shims listen as the same settings say (``ShimSettings``: host, port, TLS, read from the same ``--grpc-tls-*``
flags by ``listen_settings_from_args``, beside ``auth_config`` for who may call), offer the health service and
server reflection beside their own (``open_shim``), and live as long as their service: started once the service
is up, stopped when it ends, and a shim that cannot start stops the service (``serve_beside``). One copy here, so
that the two services cannot drift apart on any of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import Field

from .auth_config import GrpcAuthSettings
from .guard import add_port

__all__ = ["Shim", "ShimSettings", "listen_settings_from_args", "open_shim", "serve_beside"]


class ShimSettings(GrpcAuthSettings):
    """Where a shim listens, with what TLS, and how long its calls may finish when it stops; who may call it:
    :class:`GrpcAuthSettings`. Each shim's config names its environment prefix and its default port."""

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: mutual TLS, clients need a certificate signed by it
    stop_grace_s: float = Field(default=2.0, ge=0)


def open_shim(
    server: grpc.aio.Server,
    cfg: ShimSettings,
    health_servicer: health.aio.HealthServicer,
    services: Iterable[str],
    log: logging.Logger,
) -> int:
    """Offer the health service and server reflection (of ``services``, health's and reflection's own) on
    ``server``, and listen as ``cfg`` says: the port bound, or ``GrpcRefusedToStart`` (``guard.add_port``)."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return add_port(server, cfg, log)


class Shim(Protocol):
    """What ``serve_beside`` needs of a shim: start it (the port it bound), stop it."""

    async def start(self) -> int: ...

    async def stop(self) -> None: ...


async def serve_beside(
    run: Coroutine[Any, Any, None],
    up: asyncio.Event,
    shutdown: Callable[[], None],
    shim: Shim | None,
    *,
    started: asyncio.Event | None = None,
) -> None:
    """Await ``run`` (the service's ``run()``), with ``shim`` started once ``up`` is set and stopped when ``run``
    ends. A shim that fails to start calls ``shutdown`` (the service's), waits for ``run`` and raises; ``started``,
    if given, is set once the shim serves."""
    if shim is None:
        await run
        return
    loop = asyncio.get_running_loop()
    task = loop.create_task(run)
    ready = loop.create_task(up.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
    elif not task.done():
        try:
            await shim.start()
        except BaseException:
            shutdown()
            with contextlib.suppress(Exception):
                await task
            raise
        if started is not None:
            started.set()
    try:
        await task
    finally:
        await shim.stop()


def listen_settings_from_args(args: argparse.Namespace, *, port: int, host: str) -> dict[str, Any]:
    """The shim's listening fields from its flags: ``port``, ``host`` (as the caller resolved them) and the
    ``--grpc-tls-*`` files, as config fields."""
    return {
        "port": port,
        "host": host,
        "tls_cert": args.grpc_tls_cert,
        "tls_key": args.grpc_tls_key,
        "tls_client_ca": args.grpc_tls_client_ca,
    }
