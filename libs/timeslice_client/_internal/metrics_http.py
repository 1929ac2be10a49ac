"""Serving a Prometheus registry over HTTP for the orchestrator and the agent (``--metrics-port``).

Shared by both services (they never import each other); jobs importing ``timeslice_client`` never load it.
The server is prometheus_client's own (a WSGI server on a daemon thread; scrapes read the registry under
its locks), wrapped so that it starts and stops inside an ``async with`` like every other resource.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server

from ..errors import MetricsServerError

__all__ = ["MetricsEndpoint", "MetricsServerError", "serve_metrics"]

log = logging.getLogger("timeslice.metrics")


@dataclass(frozen=True, slots=True)
class MetricsEndpoint:
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"


@contextlib.asynccontextmanager
async def serve_metrics(
    registry: CollectorRegistry, port: int, host: str = "0.0.0.0", stop_timeout_s: float = 5.0
) -> AsyncIterator[MetricsEndpoint | None]:
    """Serve ``registry`` at ``http://host:port/metrics`` for the duration of the block.

    ``port`` 0 picks a free port (the endpoint says which); a negative port serves nothing (yields None).
    """
    if port < 0:
        yield None
        return
    try:
        httpd, thread = start_http_server(port, host, registry)
    except OSError as exc:
        raise MetricsServerError(host, port, exc.strerror or str(exc)) from exc
    endpoint = MetricsEndpoint(host, int(httpd.server_port))
    log.info("metrics at %s", endpoint.url)
    try:
        yield endpoint
    finally:
        # shutdown() waits for serve_forever's poll (0.5 s): off the event loop, bounded.
        try:
            async with asyncio.timeout(stop_timeout_s):
                await asyncio.to_thread(httpd.shutdown)
        except TimeoutError:
            log.warning("metrics server did not stop within %.1f s", stop_timeout_s)
        httpd.server_close()
        await asyncio.to_thread(thread.join, stop_timeout_s)
