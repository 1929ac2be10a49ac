"""NVML discovery and accounting, and an agent on a node without NVML or cuda-python."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest
from timeslice_agent import Agent, AgentConfig, GpuAccounting, GpuProcess
from timeslice_agent._cuda import cuda_unavailable_reason
from timeslice_agent._nvml import NvmlUnavailable, PynvmlSource, gpu_source_error, node_devices, process_tree
from timeslice_client import AsyncTimeSliceClient, HandlerResult, SuspendMode
from timeslice_client.bus import connect
from timeslice_client.errors import TimeSliceError
from timeslice_client.protocol import AGENTS_BUCKET, AgentInfo, DeviceInfo

from .helpers import running

GB = 1 << 30
_SPAWN = (
    "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], "
    "stdin=subprocess.PIPE); print(c.pid, flush=True); sys.stdin.read(); c.kill(); c.wait()"
)


@pytest.fixture
def family() -> Iterator[tuple[int, int]]:
    """A real child process with a child of its own: (child, grandchild)."""
    p = subprocess.Popen([sys.executable, "-c", _SPAWN], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        grandchild = int(p.stdout.readline())
        yield p.pid, grandchild
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(10)


@pytest.fixture
def session() -> Iterator[int]:
    """A process that leads its own process group (its pid is the pgid)."""
    p = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, start_new_session=True
    )
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait(10)


class Listing:
    """A GPU source with fixed processes (the seam ``GpuSource``)."""

    def __init__(self, *procs: GpuProcess) -> None:
        self.procs = procs

    def devices(self) -> tuple[DeviceInfo, ...]:
        return (
            DeviceInfo(
                index=0,
                uuid="GPU-0",
                memory_used_bytes=sum(p.used_bytes for p in self.procs),
                memory_total_bytes=80 * GB,
            ),
        )

    def processes(self) -> tuple[GpuProcess, ...]:
        return self.procs


def test_process_tree_follows_children_and_process_groups(family: tuple[int, int], session: int) -> None:
    child, grandchild = family
    assert {child, grandchild} <= process_tree([child])
    assert grandchild not in process_tree([session])
    assert session in process_tree([], session)
    assert process_tree([grandchild]) == {grandchild}


def test_job_processes_are_its_gpu_processes_holding_memory(family: tuple[int, int], session: int) -> None:
    child, grandchild = family
    acct = GpuAccounting(
        Listing(
            GpuProcess(grandchild, 1, 3 * GB),
            GpuProcess(child, 0, 0),
            GpuProcess(session, 0, GB),
            GpuProcess(grandchild, 0, GB),
        )
    )
    found = acct.job_processes([child])
    assert sorted((p.pid, p.device) for p in found) == [(grandchild, 0), (grandchild, 1)]  # child holds nothing
    assert {p.pid for p in acct.job_processes([], session)} == {session}
    assert acct.used_by([grandchild]) == 4 * GB and acct.used_by([child, 12345678]) == 0
    assert acct.devices()[0].memory_used_bytes == 5 * GB


def test_accounting_without_nvml_finds_and_measures_nothing(family: tuple[int, int]) -> None:
    acct = GpuAccounting(None)
    assert acct.job_processes(family) == () and acct.used_by(family) == 0 and acct.devices() == ()


def _fake_pynvml(monkeypatch: pytest.MonkeyPatch, **funcs: Any) -> None:
    mod = types.ModuleType("pynvml")
    for name, fn in funcs.items():
        setattr(mod, name, fn)
    monkeypatch.setitem(sys.modules, "pynvml", mod)


def test_pynvml_missing_or_failing_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with pytest.raises(NvmlUnavailable, match="install nvidia-ml-py"):
        PynvmlSource()

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    _fake_pynvml(monkeypatch, nvmlInit=no_driver)
    with pytest.raises(NvmlUnavailable, match="NVML did not initialise: NVML Shared Library Not Found"):
        PynvmlSource()


def test_pynvml_answers_become_devices_and_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    mem = types.SimpleNamespace(used=5 * GB, total=141 * GB)
    procs = [types.SimpleNamespace(pid=10, usedGpuMemory=4 * GB), types.SimpleNamespace(pid=11, usedGpuMemory=None)]
    _fake_pynvml(
        monkeypatch,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetUUID=lambda h: b"GPU-abc",
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda h: mem,
        nvmlDeviceGetComputeRunningProcesses=lambda h: procs,
    )
    src = PynvmlSource()
    assert src.devices() == (
        DeviceInfo(index=0, uuid="GPU-abc", name="NVIDIA H200", memory_used_bytes=5 * GB, memory_total_bytes=141 * GB),
    )
    assert src.processes() == (GpuProcess(10, 0, 4 * GB), GpuProcess(11, 0, 0))
    src.close()


# --------------------------------------------------------------------------- an agent without NVML / cuda-python


class Nothing:
    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return HandlerResult()

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return HandlerResult()


@pytest.fixture
async def agent(nats_url: str) -> AsyncIterator[Agent]:
    async with running(Agent(AgentConfig(node_id="cpu-node", nats_url=nats_url))) as a:
        yield a


async def test_agent_without_nvml_announces_no_devices_and_refuses_cuda(nats_url: str, agent: Agent) -> None:
    if gpu_source_error() is None or cuda_unavailable_reason() is None:
        pytest.skip("NVML or cuda-python works here")
    assert node_devices() == ()
    nc = await connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(AGENTS_BUCKET)
        entry = await kv.get("cpu-node")
        assert entry.value is not None
        info = msgspec.json.decode(entry.value, type=AgentInfo)
    finally:
        await nc.close()
    assert info.devices == () and await agent.devices() == ()
    assert "cuda" not in info.backends and {"app_endpoint", "app_channel", "freeze", "noop"} <= set(info.backends)
    async with AsyncTimeSliceClient("j", "g", nats_url) as c:
        with pytest.raises(TimeSliceError, match=r"backend 'cuda' is unavailable on node 'cpu-node': .*cuda"):
            await c.register_workload(Nothing(), node_id="cpu-node", backends=("cuda",))
        assert "j" not in agent.jobs()
        await c.register_workload(Nothing(), node_id="cpu-node")  # the agent still serves other backends
        assert "j" in agent.jobs()
