"""``timeslice up`` as a daemon, with real processes and real signals: one per data dir (a second refuses and
names the first), its nats-server dies with it even on SIGKILL, an orphan from an older crash is stopped, NATS
keeps port 4222 across restarts, ``timeslice down`` stops it, ``--detach`` runs it in the background."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeslice_orchestrator.embedded import NatsServer

from .agent_harness import ROOT
from .helpers import eventually_sync

# `timeslice up` takes NATS port 4222 when it is free: tests that need it free to themselves wait (tests/conftest.py)
pytestmark = pytest.mark.port_4222("shared")

CLI = [sys.executable, "-m", "timeslice_cli"]
QUIET = ("--no-auth", "--grpc-port", "-1", "--metrics-port", "-1", "--agent-metrics-port", "-1", "--node-id", "n-up")


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, TIMESLICE_URL_FILE=str(tmp_path / "nats.url"), TIMESLICE_LOG_LEVEL="warning")
    env.pop("TIMESLICE_CREDS", None)
    return env


def _fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


class Up:
    """One ``timeslice up`` process on ``data``."""

    def __init__(self, tmp_path: Path, data: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [*CLI, "up", "--data-dir", str(data), *QUIET, *extra],
            env=_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        assert line.startswith("timeslice up: nats="), (line, self.proc.poll(), self._err())
        self.fields = _fields(line)
        self.info = json.loads((data / "up.lock").read_text())

    def _err(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return ""
        return self.proc.stderr.read().decode()[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture
def ups(tmp_path: Path) -> Iterator[list[Up]]:
    started: list[Up] = []
    try:
        yield started
    finally:
        for u in started:
            u.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(")")[-1].split()[0] != "Z"


def _run(tmp_path: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env=_env(tmp_path), capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False
    )


def test_a_second_up_on_the_same_data_dir_refuses_and_names_the_first(tmp_path: Path, ups: list[Up]) -> None:
    data = tmp_path / "data"
    ups.append(first := Up(tmp_path, data))
    log = Path(first.info["log"])
    before = log.read_text()
    r = _run(tmp_path, "up", "--data-dir", str(data), *QUIET)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1, r.stderr
    assert "another `timeslice up` runs on data dir" in line and f"pid {first.proc.pid}" in line, line
    assert first.fields["nats"] in line and "timeslice down" in line, line
    assert first.proc.poll() is None and log.read_text().startswith(before)  # the first runs on, its log kept


def test_its_nats_server_dies_with_it_on_sigkill(tmp_path: Path, ups: list[Up]) -> None:
    ups.append(up := Up(tmp_path, tmp_path / "data"))
    nats_pid = up.info["nats_pid"]
    assert _alive(nats_pid)
    up.proc.kill()
    up.proc.wait(10)
    eventually_sync(lambda: not _alive(nats_pid), timeout=10, what="the nats-server gone with its `up`")


def test_an_orphaned_nats_server_on_the_data_dir_is_stopped(tmp_path: Path, ups: list[Up]) -> None:
    data = tmp_path / "data"
    orphan = NatsServer(data)  # as an older `up` left it: same data dir, ports file, nobody to stop it
    orphan.start()
    try:
        ups.append(up := Up(tmp_path, data))
        assert orphan.proc is not None
        eventually_sync(
            lambda: orphan.proc is not None and orphan.proc.poll() is not None, timeout=10, what="the orphan stopped"
        )
        assert up.info["nats_pid"] != orphan.pid
    finally:
        orphan.stop()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.port_4222("exclusive")
def test_a_restarted_up_keeps_port_4222(tmp_path: Path, ups: list[Up]) -> None:
    if not _port_free(4222):
        pytest.skip("port 4222 is taken on this machine (a `timeslice up` of yours?): the default cannot be tested")
    data = tmp_path / "data"
    ups.append(first := Up(tmp_path, data))
    assert first.fields["nats"] == "nats://127.0.0.1:4222", first.fields
    first.proc.kill()  # a crash: nothing stops cleanly
    first.proc.wait(10)
    eventually_sync(lambda: not _alive(first.info["nats_pid"]), timeout=10, what="the old nats-server gone")
    ups.append(second := Up(tmp_path, data))
    assert second.fields["nats"] == first.fields["nats"]


@pytest.mark.port_4222("exclusive")
def test_a_taken_port_4222_is_said(tmp_path: Path, ups: list[Up]) -> None:
    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", 4222))
        except OSError:
            pytest.skip("port 4222 is taken on this machine already")
        holder.listen()
        ups.append(up := Up(tmp_path, tmp_path / "data"))
        assert up.fields["nats"] != "nats://127.0.0.1:4222"
        assert up.proc.poll() is None


def test_down_stops_a_running_up(tmp_path: Path, ups: list[Up]) -> None:
    data = tmp_path / "data"
    r = _run(tmp_path, "down", "--data-dir", str(data))
    assert r.returncode == 2 and "no `timeslice up` runs on data dir" in r.stderr and "Traceback" not in r.stderr
    ups.append(up := Up(tmp_path, data))
    r = _run(tmp_path, "down", "--data-dir", str(data))
    assert r.returncode == 0, r.stderr
    assert up.proc.wait(10) == 0
    assert not _alive(up.info["nats_pid"])


def test_detach_runs_it_in_the_background(tmp_path: Path) -> None:
    data = tmp_path / "data"
    r = _run(tmp_path, "up", "--data-dir", str(data), *QUIET, "--detach")
    try:
        assert r.returncode == 0, r.stderr
        assert "running in the background" in r.stdout and str(data / "up.log") in r.stdout, r.stdout
        info = json.loads((data / "up.lock").read_text())
        assert info["state"] == "ready" and _alive(info["pid"])
    finally:
        down = _run(tmp_path, "down", "--data-dir", str(data))
    assert down.returncode == 0, down.stderr
    eventually_sync(
        lambda: not _alive(info["pid"]) and not _alive(info["nats_pid"]),
        timeout=20,
        what="the background up and its nats-server gone",
    )
