"""The agent's node-local Unix socket, where a job's process gets a proof of who it is (protocol:
``timeslice_client._agent_socket``). The kernel names the caller (``SO_PEERCRED``); the agent hands it a random,
single-use token bound to the job id it asked for and to those credentials, which its registration over the bus
then carries (``RegisterJob.proof``, taken with :meth:`PeerServer.take`).

Bounded: one line of at most ``MAX_LINE`` bytes each way, ``EXCHANGE_TIMEOUT_S`` per connection,
``max_connections`` at once (more are closed at once), tokens live ``TOKEN_TTL_S`` and at most ``max_per_uid``
unused ones per uid (``max_pending`` in all), so no local user can crowd out another's.

The socket's directory is the agent's: created 0755 when missing, and refused when another user owns it or it is
writable by group or others (someone else could then put a socket of their own at the path). The socket itself is
0666: every local user may ask, since a proof only repeats what the kernel says about the asker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from timeslice_client._agent_socket import EXCHANGE_TIMEOUT_S, MAX_LINE, TOKEN_TTL_S, Answer, Hello

from ._errors import AgentSocketError
from ._ownership import Peer, ProcessGuard
from ._untrusted import Refusal, Refused, check_id, shown
from .metrics import AgentMetrics

__all__ = ["AgentSocketError", "PeerServer"]

log = logging.getLogger("timeslice.agent")

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_MAX_PATH = 107  # bytes of sun_path, less its terminating NUL


@dataclass(frozen=True, slots=True)
class _Pending:
    job: str
    peer: Peer
    expires: float  # monotonic seconds


class PeerServer:
    def __init__(
        self,
        path: str,
        guard: ProcessGuard,
        metrics: AgentMetrics,
        *,
        node: str,
        ttl_s: float = TOKEN_TTL_S,
        max_connections: int = 64,
        max_per_uid: int = 64,
        max_pending: int = 4096,
    ) -> None:
        self.path, self.node = path, node
        self._guard, self._metrics = guard, metrics
        self.ttl_s, self.max_connections, self.max_per_uid, self.max_pending = (
            ttl_s,
            max_connections,
            max_per_uid,
            max_pending,
        )
        self._pending: dict[str, _Pending] = {}
        self._active = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        path = self.path
        if len(os.fsencode(path)) > _MAX_PATH:
            raise AgentSocketError(path, f"a Unix socket path has at most {_MAX_PATH} bytes; give a shorter --socket")
        directory = Path(path).parent
        if not directory.exists():
            directory.mkdir(mode=0o755, parents=True)
            os.chmod(directory, 0o755)  # whatever the umask
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise AgentSocketError(
                path,
                f"its directory {directory} must be a directory of the agent's user (uid "
                f"{os.geteuid()}), not writable by group or others (it is uid {st.st_uid}, "
                f"mode {stat.filemode(st.st_mode)}); fix it or give another --socket",
            )
        self._clear_stale(path)
        self._server = await asyncio.start_unix_server(self._serve, path=path, limit=MAX_LINE)
        os.chmod(path, 0o666)
        log.info("serving the agent socket at %s", path, extra={"node": self.node})

    @staticmethod
    def _clear_stale(path: str) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise AgentSocketError(path, "something that is no socket is there; remove it or give another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # left by an agent that is gone
            return
        finally:
            probe.close()
        raise AgentSocketError(path, "another agent serves it; stop that one or give this one another --socket")

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(EXCHANGE_TIMEOUT_S):
                await server.wait_closed()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def take(self, token: str, job: str) -> Peer:
        """The peer a registration's proof stands for (once: the token is used up). Refused (``unproven``) for an
        unknown, used or expired token, or one asked for another job."""
        entry = self._pending.pop(token, None)
        if entry is None or entry.expires < time.monotonic():
            raise Refused(
                Refusal.UNPROVEN,
                f"the proof token is unknown, used or expired (one serves one "
                f"registration within {self.ttl_s:g} s); ask the agent socket again",
            )
        if entry.job != job:
            raise Refused(Refusal.UNPROVEN, f"the proof was asked for job {entry.job!r}, not {job!r}")
        return entry.peer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._active >= self.max_connections:
            writer.close()
            return
        self._active += 1
        try:
            async with asyncio.timeout(EXCHANGE_TIMEOUT_S):
                answer = await self._exchange(reader, writer)
                writer.write(msgspec.json.encode(answer) + b"\n")
                await writer.drain()
        except (OSError, TimeoutError) as exc:
            log.info("agent socket exchange ended: %r", exc, extra={"node": self.node})
        finally:
            self._active -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Answer:
        sock = writer.get_extra_info("socket")
        pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        try:
            try:
                line = await reader.readline()
            except ValueError:  # past the limit
                raise Refused(Refusal.TOO_LARGE, f"a message has at most {MAX_LINE} bytes") from None
            try:
                hello = msgspec.json.decode(line, type=Hello)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise Refused(Refusal.UNDECODABLE, f"undecodable: {shown(str(exc), 200)}") from None
            job = check_id("job", hello.job)
            peer = self._guard.peer(pid, uid, gid, hello.pid)
            return Answer(ok=True, token=self._issue(job, peer), pid=peer.pid, expires_s=self.ttl_s)
        except Refused as exc:
            self._metrics.refusal("socket", exc.code)
            log.warning(
                "refused a proof to pid %d (uid %d): %s",
                pid,
                uid,
                exc,
                extra={"node": self.node, "refusal": str(exc.code)},
            )
            return Answer(ok=False, error=str(exc)[:400])

    def _issue(self, job: str, peer: Peer) -> str:
        now = time.monotonic()
        for token in [t for t, e in self._pending.items() if e.expires < now]:
            del self._pending[token]
        if sum(1 for e in self._pending.values() if e.peer.uid == peer.uid) >= self.max_per_uid:
            raise Refused(
                Refusal.TOO_LARGE,
                f"uid {peer.uid} has {self.max_per_uid} unused proofs; use them or wait {self.ttl_s:g} s",
            )
        if len(self._pending) >= self.max_pending:
            raise Refused(Refusal.TOO_LARGE, f"{self.max_pending} unused proofs; wait {self.ttl_s:g} s")
        token = secrets.token_hex(16)
        self._pending[token] = _Pending(job=job, peer=peer, expires=now + self.ttl_s)
        return token
