"""A TCP proxy on 127.0.0.1 in front of one server, for cutting one client's connection in fault tests.

``cut()`` closes every connection through the proxy and refuses new ones (accepted, then closed at once) until
``restore()``; the server sees the client disconnect, the client sees its socket close and reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlparse

from .helpers import loopback_url

__all__ = ["TcpProxy", "tcp_proxy"]


class TcpProxy:
    def __init__(self, upstream_url: str) -> None:
        u = urlparse(upstream_url)
        assert u.hostname in ("127.0.0.1", "localhost"), "fault tests target only the loopback address"
        self._up_host, self._up_port = u.hostname, u.port or 4222
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # the pipes
        self._handlers: set[asyncio.Task[None]] = set()  # one per accepted connection (the server's tasks)
        self._open = True
        self.cuts = 0

    @property
    def url(self) -> str:
        return loopback_url(self._server, "nats")

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        self._handlers.add(me)
        try:
            await self._serve(reader, writer)
        finally:
            self._handlers.discard(me)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._open:
            writer.close()
            return
        try:
            async with asyncio.timeout(5):
                up_r, up_w = await asyncio.open_connection(self._up_host, self._up_port)
        except (OSError, TimeoutError):
            writer.close()
            return
        self._conns.update((writer, up_w))
        t1 = asyncio.create_task(self._pipe(reader, up_w))
        t2 = asyncio.create_task(self._pipe(up_r, writer))
        self._tasks.update((t1, t2))
        try:
            await asyncio.wait({t1, t2}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in (writer, up_w):
                w.close()
                self._conns.discard(w)
            for t in (t1, t2):
                t.cancel()
            await asyncio.gather(t1, t2, return_exceptions=True)
            self._tasks.difference_update((t1, t2))

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()

    def cut(self) -> None:
        """Close every connection through the proxy and refuse new ones until ``restore()``."""
        self._open = False
        self.cuts += 1
        for w in list(self._conns):
            w.close()

    def restore(self) -> None:
        self._open = True

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # With their pipes gone the handlers end on their own; they are awaited here, not left for the loop's
        # shutdown to cancel (asyncio's stream server logs a cancelled handler as an error).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.gather(*self._handlers, return_exceptions=True)


@contextlib.asynccontextmanager
async def tcp_proxy(upstream_url: str) -> AsyncIterator[TcpProxy]:
    proxy = await TcpProxy(upstream_url).start()
    try:
        yield proxy
    finally:
        await proxy.close()
