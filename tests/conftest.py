"""Shared fixtures: a real nats-server per test (free port, temp dir), the orchestrator in-process or
as a real process."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from nats.aio.client import Client as NATS
from timeslice_client.bus import connect
from timeslice_orchestrator.embedded import NatsServer
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .agent_harness import node_agent, node_workloads, records_observer  # noqa: F401 - the fixtures agent, spawn, observer
from .cluster import cluster  # noqa: F401 - the fixture: a 3-node loopback NATS cluster
from .helpers import stop_process

if TYPE_CHECKING:
    from .auth_stack import SecureBus

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def agent_socket_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test's agents serve their Unix sockets (and its jobs look for them) in a directory of the test's own,
    one socket per node (``{node}``), so agents of tests running side by side never meet. Short: a socket path has
    at most 107 bytes, more than a test's tmp_path leaves."""
    directory = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    monkeypatch.setenv("TIMESLICE_AGENT_SOCKET", f"{directory}/agent-{{node}}.sock")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


_PORT_4222_LOCK = Path(tempfile.gettempdir()) / "timeslice-tests-port-4222.lock"


@pytest.fixture(autouse=True)
def port_4222(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked ``port_4222("shared")`` start a `timeslice up` that takes NATS port 4222 when it is free (and
    goes on without it); tests marked ``port_4222("exclusive")`` need it free for themselves (they check that
    `up` takes it and keeps it). A lock file across the suite's worker processes keeps the exclusive ones apart
    from every other: (pytest-xdist's ``xdist_group`` does not group tests under pytest 9, whose node ids it
    cannot suffix any more)."""
    mark = request.node.get_closest_marker("port_4222")
    if mark is None:
        yield
        return
    how = mark.args[0] if mark.args else "shared"
    assert how in ("shared", "exclusive"), mark
    with open(_PORT_4222_LOCK, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX if how == "exclusive" else fcntl.LOCK_SH)  # the test's timeout bounds this
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[SecureBus]:
    """A nats-server with timeslice's auth on (tests/auth_stack.py), for the security tests."""
    from .auth_stack import start_secure_bus

    b = start_secure_bus(tmp_path)
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    """A bus connection to this test's server."""
    c = await connect(nats_url)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def orchestrator(nats_url: str) -> AsyncIterator[Orchestrator]:
    """The orchestrator running in this test's event loop."""
    from .helpers import running

    async with running(Orchestrator(OrchestratorConfig(nats_url=nats_url))) as orch:
        yield orch


class OrchestratorProcess:
    """``timeslice orchestrator`` as a real process, for crash tests."""

    def __init__(
        self, nats_url: str, log_path: Path, *, blocked_imports: tuple[str, ...] = (), args: tuple[str, ...] = ()
    ) -> None:
        self.nats_url = nats_url
        self.log_path = log_path
        self.blocked_imports = blocked_imports  # modules made unimportable in the process
        self.args = args  # more flags, e.g. ("--with-agent", "n1")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, TIMESLICE_LOG_LEVEL="warning")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()/kill()
        argv = ["orchestrator", "--nats-url", self.nats_url, *self.args]
        if self.blocked_imports:
            code = (
                f"import sys; sys.modules.update(dict.fromkeys({list(self.blocked_imports)!r})); "
                f"from timeslice_orchestrator._main import main; sys.exit(main({argv!r}))"
            )
            cmd = [sys.executable, "-c", code]
        else:
            cmd = [sys.executable, "-m", "timeslice_orchestrator", *argv]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Ready when its durable consumer is bound (it creates the stream and buckets before that) and, with
        ``--with-agent``, its agent answers."""
        asyncio.run(self._wait_ready(timeout))

    async def _wait_ready(self, timeout: float) -> None:
        from timeslice_client.bus import connect
        from timeslice_client.protocol import STREAM, subjects

        from .helpers import eventually

        nc = await connect(self.nats_url)
        js = nc.jetstream()

        async def bound() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"orchestrator exited: {self.log_path}"
            try:
                info = await js.consumer_info(STREAM, "orchestrator")
            except Exception:
                return False
            return bool(info.push_bound)

        node = self.args[self.args.index("--with-agent") + 1] if "--with-agent" in self.args else None

        async def agent_answers() -> bool:  # the agent beside it subscribes after the consumer is bound
            assert node is not None
            try:
                await nc.request(subjects.agent_rpc(node, "status"), b"", timeout=1)
            except Exception:
                return False
            return True

        try:
            await eventually(bound, timeout=timeout, interval=0.02, what="orchestrator process ready")
            if node is not None:
                await eventually(agent_answers, timeout=timeout, interval=0.02, what=f"its agent {node} answers")
        finally:
            await nc.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        with contextlib.suppress(Exception):
            self._log.close()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self.proc = None
        with contextlib.suppress(Exception):
            self._log.close()


@pytest.fixture
def orchestrator_process(nats_url: str, tmp_path: Path) -> Iterator[OrchestratorProcess]:
    p = OrchestratorProcess(nats_url, tmp_path / "orchestrator.log")
    p.start()
    p.wait_ready()
    try:
        yield p
    finally:
        p.stop()
