"""The ``app_endpoint`` backend: a serving engine frees and takes back its own GPU memory over HTTP.

The job registers its servers as ``endpoints``, each ``<app>+<url>``:

* ``vllm+http://host:8000``: snapshot ``POST /sleep?level=1`` (mode ``offload``: weights to host memory,
  KV cache dropped) or ``level=2`` (mode ``discard``: both dropped); restore ``POST /wake_up``, with
  ``?tags=weights&tags=kv_cache`` when the job registered tags. vLLM serves these only when started
  with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``.
* ``sglang+http://host:30000``: snapshot ``POST /release_memory_occupation``, restore
  ``POST /resume_memory_occupation``, JSON body ``{"tags": [...]}`` (``{}`` without tags: everything).
  SGLang needs ``--enable-memory-saver``.

Every endpoint of a job is called concurrently, each request bounded by the operation's deadline. When a
snapshot fails on one endpoint, the endpoints that went to sleep are woken again (and one that timed out,
which may be asleep), so the job runs again (``rolled_back``). Device bytes freed are measured with NVML
(the device memory of the job's registered processes and their children before and after) when NVML is
available; ``bytes_moved`` stays 0 (the engine does not say how much it copied to host memory).

The HTTP client is a small HTTP/1.1 client over asyncio streams (one request per connection).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Final, Literal, cast
from urllib.parse import urlencode, urlsplit

from timeslice_client.protocol import JobContext, SuspendMode

from ._backend_api import BackendError, OpContext, Outcome
from ._errors import HttpError
from ._nvml import GpuAccounting, gpu_source

__all__ = ["AppEndpointBackend", "Endpoint", "HttpError", "check_endpoints", "http_post", "parse_endpoint"]

App = Literal["vllm", "sglang"]
_APPS: Final = ("vllm", "sglang")
_MAX_BODY: Final = 1 << 20
_VLLM_HINT: Final = (
    "start vLLM with --enable-sleep-mode and the environment variable VLLM_SERVER_DEV_MODE=1 "
    "(the /sleep and /wake_up routes exist only in dev mode)"
)
_SGLANG_HINT: Final = "start SGLang with --enable-memory-saver (and a version that serves /release_memory_occupation)"


@dataclass(frozen=True, slots=True)
class Endpoint:
    app: App
    host: str
    port: int
    base_path: str
    url: str  # as registered, for messages

    def __str__(self) -> str:
        return self.url


def parse_endpoint(spec: str) -> Endpoint:
    """``vllm+http://host:port[/prefix]`` or ``sglang+http://…``; raises ``ValueError`` saying what is wrong."""
    app, sep, url = spec.partition("+")
    if not sep or app not in _APPS:
        raise ValueError(
            f"endpoint {spec!r} does not say which server it is: register it as "
            f"'vllm+http://host:port' or 'sglang+http://host:port'"
        )
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(
            f"endpoint {spec!r}: only plain http://host:port URLs are supported "
            "(the server is node-local; put TLS termination elsewhere)"
        )
    return Endpoint(
        app=cast("App", app),  # checked against _APPS above
        host=parts.hostname,
        port=parts.port or 80,
        base_path=parts.path.rstrip("/"),
        url=url,
    )


def check_endpoints(specs: tuple[str, ...]) -> tuple[Endpoint, ...]:
    """All of a job's endpoints, parsed; ``ValueError`` when there are none or one is malformed."""
    if not specs:
        raise ValueError("backend app_endpoint needs the job's endpoints, e.g. 'vllm+http://127.0.0.1:8000'")
    return tuple(parse_endpoint(s) for s in specs)


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes


async def http_post(host: str, port: int, path: str, body: bytes | None, *, timeout: float) -> Response:
    """One ``POST`` over HTTP/1.1 (``Connection: close``) bounded by ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                head = [
                    f"POST {path} HTTP/1.1",
                    f"Host: {host}:{port}",
                    "Connection: close",
                    "Accept: application/json",
                    f"Content-Length: {len(body or b'')}",
                ]
                if body is not None:
                    head.append("Content-Type: application/json")
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b""))
                await writer.drain()
                return await _read_response(reader)
            finally:
                writer.close()
                try:
                    await writer.wait_closed()
                except OSError:
                    pass
    except TimeoutError:
        raise HttpError(f"no answer within {timeout:.1f} s", timed_out=True) from None
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        raise HttpError(f"{exc.__class__.__name__}: {exc}") from exc


async def _read_response(reader: asyncio.StreamReader) -> Response:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    version, _, rest = head[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x answer: {head[0]!r}")
    status = int(rest.split(" ", 1)[0])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks: list[bytes] = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                break
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)
            if sum(map(len, chunks)) > _MAX_BODY:
                raise ValueError("answer body too large")
        return Response(status, b"".join(chunks))
    if "content-length" in headers:
        n = int(headers["content-length"])
        if n > _MAX_BODY:
            raise ValueError(f"answer body too large ({n} bytes)")
        return Response(status, await reader.readexactly(n))
    return Response(status, await reader.read(_MAX_BODY))


class AppEndpointBackend:
    """The ``app_endpoint`` backend (see the module doc)."""

    name = "app_endpoint"

    def __init__(self, accounting: GpuAccounting | None = None) -> None:
        self.accounting = accounting or GpuAccounting(None)

    # ------------------------------------------------------------------ requests

    @staticmethod
    def _request(ep: Endpoint, ctx: JobContext, action: Literal["sleep", "wake"]) -> tuple[str, bytes | None]:
        if ep.app == "vllm":
            if action == "sleep":
                level = 2 if ctx.mode is SuspendMode.DISCARD else 1
                return f"{ep.base_path}/sleep?level={level}", None
            query = f"?{urlencode([('tags', t) for t in ctx.tags])}" if ctx.tags else ""
            return f"{ep.base_path}/wake_up{query}", None
        route = "release_memory_occupation" if action == "sleep" else "resume_memory_occupation"
        body = json.dumps({"tags": list(ctx.tags)} if ctx.tags else {}).encode()
        return f"{ep.base_path}/{route}", body

    async def _call(self, ep: Endpoint, ctx: JobContext, action: Literal["sleep", "wake"], timeout: float) -> None:
        path, body = self._request(ep, ctx, action)
        what = f"{ep.app} server {ep} (POST {path})"
        try:
            resp = await http_post(ep.host, ep.port, path, body, timeout=timeout)
        except HttpError as exc:
            raise BackendError(f"{what} for job {ctx.job!r}: {exc}") from exc
        if 200 <= resp.status < 300:
            return
        text = resp.body[:300].decode("utf-8", "replace").strip()
        hint = ""
        if resp.status in (404, 405):
            hint = f"; the route is not served: {_VLLM_HINT if ep.app == 'vllm' else _SGLANG_HINT}"
        raise BackendError(f"{what} for job {ctx.job!r} answered HTTP {resp.status}{': ' + text if text else ''}{hint}")

    def _endpoints(self, ctx: JobContext) -> list[Endpoint]:
        try:
            return list(check_endpoints(ctx.endpoints))
        except ValueError as exc:
            raise BackendError(f"app_endpoint backend, job {ctx.job!r}: {exc}") from exc

    def _measure(self, ctx: JobContext) -> tuple[int, ...]:
        return tuple(p.pid for p in self.accounting.job_processes(ctx.pids, ctx.pgid))

    async def _used(self, pids: tuple[int, ...]) -> int:
        return await asyncio.to_thread(self.accounting.used_by, pids) if pids else 0

    # ------------------------------------------------------------------ operations

    async def snapshot(self, ctx: JobContext, op: OpContext) -> Outcome:
        eps = self._endpoints(ctx)
        pids = await asyncio.to_thread(self._measure, ctx) if self.accounting.source is not None else ()
        before = await self._used(pids)
        outcomes = await asyncio.gather(
            *(self._call(ep, ctx, "sleep", op.remaining()) for ep in eps), return_exceptions=True
        )
        if any(o is not None for o in outcomes):
            raise await self._roll_back(ctx, eps, outcomes, max(5.0, op.remaining()))
        after = await self._used(pids)
        return Outcome(device_bytes_freed=max(0, before - after))

    async def _roll_back(
        self, ctx: JobContext, eps: list[Endpoint], outcomes: list[BaseException | None], timeout: float
    ) -> BackendError:
        """Wake the endpoints that may sleep after a failed snapshot: those that answered, and those that did
        not answer in time. An endpoint that answered with an error, or could not be reached, did not sleep."""
        why = "; ".join(str(o) for o in outcomes if o is not None)
        maybe_asleep = [
            ep
            for ep, o in zip(eps, outcomes, strict=True)
            if o is None or (isinstance(o.__cause__, HttpError) and o.__cause__.timed_out)
        ]
        undone = await asyncio.gather(
            *(self._call(ep, ctx, "wake", timeout) for ep in maybe_asleep), return_exceptions=True
        )
        stuck = [f"{ep} ({o})" for ep, o in zip(maybe_asleep, undone, strict=True) if isinstance(o, BaseException)]
        if stuck:
            return BackendError(f"{why}; waking again failed: {'; '.join(stuck)}", rolled_back=False)
        woken = f" (woke {', '.join(map(str, maybe_asleep))} again)" if maybe_asleep else ""
        return BackendError(f"{why}{woken}", rolled_back=True)

    async def restore(self, ctx: JobContext, op: OpContext) -> Outcome:
        eps = self._endpoints(ctx)
        outcomes = await asyncio.gather(
            *(self._call(ep, ctx, "wake", op.remaining()) for ep in eps), return_exceptions=True
        )
        failed = [str(o) for o in outcomes if isinstance(o, BaseException)]
        if failed:
            raise BackendError("; ".join(failed), rolled_back=False)
        return Outcome()


def make_app_endpoint_backend(nc: object, node: str) -> AppEndpointBackend:
    """The backend factory (NVML loaded once per process, where available)."""
    return AppEndpointBackend(GpuAccounting(gpu_source()))
