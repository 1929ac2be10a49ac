"""A gRPC shim served beside the service it fronts (the orchestrator's, the agent's), and the flags of its port.

Both shims live as long as their service: started once the service is up, stopped when it ends, and a shim that
cannot start stops the service (``serve_beside``). Both read where they listen from the same ``--grpc-tls-*``
flags (``listen_settings_from_args``, beside ``auth_config.auth_settings_from_args`` for who may call). One copy
here, so that the two services cannot drift apart on either.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

__all__ = ["Shim", "listen_settings_from_args", "serve_beside"]


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
