"""The ``cuda`` backend's state logic, through its driver seam (``CheckpointDriver``).

``RuleDriver`` enforces the driver's own state rules (lock only RUNNING, checkpoint only LOCKED, restore
only CHECKPOINTED, unlock only LOCKED), so a backend that calls things in the wrong order fails here
as it would on a GPU. The real driver is exercised by ``bench/gpu_check.py`` on a GPU machine.
"""

from __future__ import annotations

import asyncio
import enum
import os
import re
import subprocess
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from timeslice_agent import (
    Agent,
    AgentConfig,
    BackendError,
    BackendUnavailable,
    CudaBackend,
    DriverError,
    GpuAccounting,
    GpuProcess,
    OpContext,
    ProcessState,
    register_backend,
)
from timeslice_agent import backends as backends_mod
from timeslice_agent._cuda import CudaPythonDriver, cuda_unavailable_reason, make_cuda_backend
from timeslice_client import CallbackHandler, WorkloadChannel, register_workload
from timeslice_client.protocol import DeviceInfo, JobContext, JobState, OpKind, OpResult

from .helpers import eventually, running

GB = 1 << 30


class RuleDriver:
    """A CUDA checkpoint driver that keeps per-process state and refuses what the real one refuses."""

    def __init__(self, pids: dict[int, int]) -> None:
        self.states = {pid: ProcessState.RUNNING for pid in pids}
        self.memory = dict(pids)  # pid -> device bytes while not checkpointed
        self.calls: list[tuple[str, int]] = []
        self.lock_timeouts: dict[int, int] = {}  # pid -> how many lock attempts time out first
        self.lock_timeout_args: list[int] = []
        self.fail: dict[tuple[str, int], str] = {}  # (call, pid) -> error code, once
        self.barrier: threading.Barrier | None = None  # lock waits here: proves calls run side by side
        self._mu = threading.Lock()

    def _step(self, call: str, pid: int, need: ProcessState, then: ProcessState) -> None:
        with self._mu:
            self.calls.append((call, pid))
            if pid not in self.states:
                raise DriverError(call, pid, "CUDA_ERROR_INVALID_VALUE", "no CUDA process")
            if (code := self.fail.pop((call, pid), None)) is not None:
                raise DriverError(call, pid, code)
            if self.states[pid] is not need:
                raise DriverError(call, pid, "CUDA_ERROR_ILLEGAL_STATE", f"process is {self.states[pid].name}")
            self.states[pid] = then

    def state(self, pid: int) -> ProcessState:
        with self._mu:
            if pid not in self.states:
                raise DriverError("cuCheckpointProcessGetState", pid, "CUDA_ERROR_INVALID_VALUE")
            return self.states[pid]

    def lock(self, pid: int, timeout_ms: int) -> None:
        self.lock_timeout_args.append(timeout_ms)
        if self.barrier is not None:
            self.barrier.wait(timeout=10)
        with self._mu:
            if self.lock_timeouts.get(pid, 0) > 0:
                self.lock_timeouts[pid] -= 1
                self.calls.append(("lock", pid))
                raise DriverError("cuCheckpointProcessLock", pid, "CUDA_ERROR_TIMEOUT")
        self._step("lock", pid, ProcessState.RUNNING, ProcessState.LOCKED)

    def checkpoint(self, pid: int) -> None:
        self._step("checkpoint", pid, ProcessState.LOCKED, ProcessState.CHECKPOINTED)

    def restore(self, pid: int) -> None:
        self._step("restore", pid, ProcessState.CHECKPOINTED, ProcessState.LOCKED)

    def unlock(self, pid: int) -> None:
        self._step("unlock", pid, ProcessState.LOCKED, ProcessState.RUNNING)


class DriverNvml:
    """An NVML view of the RuleDriver's processes: a checkpointed process holds no device memory and is
    not listed (as on a real GPU)."""

    def __init__(self, driver: RuleDriver, extra: tuple[GpuProcess, ...] = ()) -> None:
        self.driver, self.extra = driver, extra

    def devices(self) -> tuple[DeviceInfo, ...]:
        used = sum(p.used_bytes for p in self.processes())
        return (DeviceInfo(index=0, uuid="GPU-fake", memory_used_bytes=used, memory_total_bytes=141 * GB),)

    def processes(self) -> tuple[GpuProcess, ...]:
        live = tuple(
            GpuProcess(pid, 0, self.driver.memory[pid])
            for pid, s in self.driver.states.items()
            if s is not ProcessState.CHECKPOINTED
        )
        return live + self.extra


def ctx(job: str = "j", pids: tuple[int, ...] = (), **kw: object) -> JobContext:
    return JobContext(node="n1", job=job, group="g", state=JobState.RUNNING, backends=("cuda",), pids=pids, **kw)  # type: ignore[arg-type]


def op(seconds: float = 10.0) -> OpContext:
    return OpContext(op_id="op", epoch=1, deadline=time.monotonic() + seconds)


@pytest.fixture
def children() -> Iterator[list[int]]:
    """Three real child processes of this test (so process discovery walks a real process tree)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        for _ in range(3)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def backend(driver: RuleDriver, *, nvml: bool = True, **kw: int) -> CudaBackend:
    return CudaBackend(driver, GpuAccounting(DriverNvml(driver) if nvml else None), **kw)


async def test_snapshot_locks_then_checkpoints_and_restore_restores_then_unlocks(children: list[int]) -> None:
    a, b, _ = children
    drv = RuleDriver({a: 3 * GB, b: 5 * GB})
    be = backend(drv)
    out = await be.snapshot(ctx(pids=(os.getpid(),)), op())  # found as descendants of the registered pid
    assert (out.bytes_moved, out.device_bytes_freed) == (8 * GB, 8 * GB)  # measured by NVML, before/after
    assert drv.states == {a: ProcessState.CHECKPOINTED, b: ProcessState.CHECKPOINTED}
    for pid in (a, b):
        assert [c for c, p in drv.calls if p == pid] == ["lock", "checkpoint"]
    assert be.saved_pids(ctx(pids=(os.getpid(),))) == (a, b)  # cached: NVML no longer lists them
    drv.calls.clear()
    out = await be.restore(ctx(pids=(os.getpid(),)), op())
    assert out.bytes_moved == 8 * GB and out.device_bytes_freed == 0
    assert drv.states == {a: ProcessState.RUNNING, b: ProcessState.RUNNING}
    for pid in (a, b):
        assert [c for c, p in drv.calls if p == pid] == ["restore", "unlock"]
    assert be.saved_pids(ctx(pids=(os.getpid(),))) is None


async def test_processes_without_device_memory_or_outside_the_job_are_left_alone(children: list[int]) -> None:
    a, b, c = children
    drv = RuleDriver({a: GB, b: 0})
    be = CudaBackend(drv, GpuAccounting(DriverNvml(drv, extra=(GpuProcess(1, 0, 7 * GB),))))
    out = await be.snapshot(ctx(pids=(a, b, c)), op())
    assert out.device_bytes_freed == GB
    assert drv.states == {a: ProcessState.CHECKPOINTED, b: ProcessState.RUNNING}
    assert all(p == a for _, p in drv.calls)


async def test_a_job_that_holds_no_gpu_memory_has_nothing_to_move(children: list[int]) -> None:
    drv = RuleDriver({})
    be = backend(drv)
    assert (await be.snapshot(ctx(pids=(children[0],)), op())).bytes_moved == 0
    assert (await be.restore(ctx(pids=(children[0],)), op())).bytes_moved == 0
    assert drv.calls == []


async def test_without_nvml_the_driver_finds_the_cuda_processes_and_no_bytes_are_guessed(children: list[int]) -> None:
    a, b, c = children
    drv = RuleDriver({a: GB, c: GB})
    be = backend(drv, nvml=False)
    out = await be.snapshot(ctx(pids=(a, b, c)), op())
    assert (out.bytes_moved, out.device_bytes_freed) == (0, 0)
    assert drv.states == {a: ProcessState.CHECKPOINTED, c: ProcessState.CHECKPOINTED}
    await be.restore(ctx(pids=(a, b, c)), op())
    assert set(drv.states.values()) == {ProcessState.RUNNING}


async def test_lock_timeouts_are_retried_within_bounds(children: list[int]) -> None:
    a = children[0]
    drv = RuleDriver({a: GB})
    drv.lock_timeouts[a] = 2
    be = backend(drv, lock_timeout_ms=250, lock_attempts=3)
    await be.snapshot(ctx(pids=(a,)), op())
    assert drv.states[a] is ProcessState.CHECKPOINTED
    assert drv.calls == [("lock", a), ("lock", a), ("lock", a), ("checkpoint", a)]
    assert all(0 < t <= 250 for t in drv.lock_timeout_args)


async def test_a_lock_that_keeps_timing_out_gives_up_and_the_process_keeps_running(children: list[int]) -> None:
    a = children[0]
    drv = RuleDriver({a: GB})
    drv.lock_timeouts[a] = 10
    be = backend(drv, lock_timeout_ms=100, lock_attempts=3)
    with pytest.raises(BackendError) as err:
        await be.snapshot(ctx(pids=(a,)), op())
    assert err.value.rolled_back is True
    assert "3 attempts of up to 100 ms" in str(err.value) and "CUDA_ERROR_TIMEOUT" in str(err.value)
    assert drv.states[a] is ProcessState.RUNNING and drv.lock_timeouts[a] == 7
    assert be.saved_pids(ctx(pids=(a,))) is None


async def test_the_lock_never_outlives_the_operation_deadline(children: list[int]) -> None:
    a = children[0]
    drv = RuleDriver({a: GB})
    be = backend(drv, lock_timeout_ms=60_000)
    await be.snapshot(ctx(pids=(a,)), op(seconds=2.0))
    assert 0 < drv.lock_timeout_args[0] <= 2000


async def test_checkpoint_failure_unlocks_and_undoes_the_other_processes(children: list[int]) -> None:
    a, b, _ = children
    drv = RuleDriver({a: GB, b: GB})
    drv.fail[("checkpoint", b)] = "CUDA_ERROR_OUT_OF_MEMORY"
    be = backend(drv)
    with pytest.raises(BackendError) as err:
        await be.snapshot(ctx(pids=(a, b)), op())
    assert err.value.rolled_back is True
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(err.value) and "run again" in str(err.value)
    assert drv.states == {a: ProcessState.RUNNING, b: ProcessState.RUNNING}
    assert [c for c, p in drv.calls if p == a] == ["lock", "checkpoint", "restore", "unlock"]
    assert [c for c, p in drv.calls if p == b] == ["lock", "checkpoint", "unlock"]


async def test_a_failed_unlock_during_rollback_is_not_called_rolled_back(children: list[int]) -> None:
    a = children[0]
    drv = RuleDriver({a: GB})
    drv.fail[("checkpoint", a)] = "CUDA_ERROR_UNKNOWN"
    drv.fail[("unlock", a)] = "CUDA_ERROR_ILLEGAL_STATE"
    with pytest.raises(BackendError) as err:
        await backend(drv).snapshot(ctx(pids=(a,)), op())
    assert err.value.rolled_back is False
    assert "unlock failed too" in str(err.value) and str(a) in str(err.value)


async def test_a_failed_process_is_refused_without_touching_it(children: list[int]) -> None:
    a = children[0]
    drv = RuleDriver({a: GB})
    drv.states[a] = ProcessState.FAILED
    with pytest.raises(BackendError) as err:
        await backend(drv, nvml=False).snapshot(ctx(pids=(a,)), op())
    assert err.value.rolled_back is False and "FAILED" in str(err.value)


async def test_restore_failure_is_reported_and_a_later_restore_finishes_the_job(children: list[int]) -> None:
    a, b, _ = children
    drv = RuleDriver({a: GB, b: GB})
    be = backend(drv)
    await be.snapshot(ctx(pids=(a, b)), op())
    drv.fail[("restore", b)] = "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(BackendError) as err:
        await be.restore(ctx(pids=(a, b)), op())
    assert err.value.rolled_back is False
    assert f"pid {b}" in str(err.value) and "CUDA_ERROR_OUT_OF_MEMORY" in str(err.value)
    assert drv.states == {a: ProcessState.RUNNING, b: ProcessState.CHECKPOINTED}
    await be.restore(ctx(pids=(a, b)), op())  # what was done is skipped; what was not is done
    assert drv.states == {a: ProcessState.RUNNING, b: ProcessState.RUNNING}


async def test_restore_after_an_agent_restart_asks_the_driver(children: list[int]) -> None:
    a, b, _ = children
    drv = RuleDriver({a: GB, b: GB})
    await backend(drv).snapshot(ctx(pids=(os.getpid(),)), op())
    fresh = backend(drv)  # a new agent process: no cached PIDs, NVML lists no checkpointed process
    await fresh.restore(ctx(pids=(os.getpid(),)), op())
    assert drv.states == {a: ProcessState.RUNNING, b: ProcessState.RUNNING}


async def test_processes_are_worked_on_concurrently_within_and_across_jobs(children: list[int]) -> None:
    a, b, c = children
    drv = RuleDriver({a: GB, b: GB, c: GB})
    drv.barrier = threading.Barrier(3)  # every lock waits until all three are inside the driver
    be = backend(drv)
    await asyncio.gather(be.snapshot(ctx("j1", pids=(a, b)), op()), be.snapshot(ctx("j2", pids=(c,)), op()))
    assert set(drv.states.values()) == {ProcessState.CHECKPOINTED}
    assert be.saved_pids(ctx("j1")) == (a, b) and be.saved_pids(ctx("j2")) == (c,)


def test_without_cuda_python_the_backend_is_unavailable_and_says_why() -> None:
    reason = cuda_unavailable_reason()
    if reason is None:
        pytest.skip("cuda-python and a GPU are present here")
    assert "cuda" in reason
    with pytest.raises(BackendUnavailable, match="cuda backend is unavailable on node 'n1'"):
        make_cuda_backend(None, "n1")
    with pytest.raises(BackendUnavailable, match="unavailable on node 'n1'") as err:
        backends_mod.make_backend("cuda", None, "n1")  # type: ignore[arg-type]
    assert reason in str(err.value)
    assert "cuda" not in backends_mod.available_backends()
    assert backends_mod.unavailable_backends()["cuda"] == reason


# --------------------------------------------------------------------------- the cuda-python translation


class CUresult(enum.IntEnum):  # the values of cuda.h
    CUDA_SUCCESS = 0
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_TIMEOUT = 909


def fake_bindings(
    monkeypatch: pytest.MonkeyPatch,
    *,
    init: CUresult = CUresult.CUDA_SUCCESS,
    version: int = 12080,
    lock: CUresult = CUresult.CUDA_SUCCESS,
    missing: str = "",
) -> list[tuple[Any, ...]]:
    """``cuda.bindings.driver`` as cuda-python shapes it (tuples led by a CUresult), recording the calls.
    Only the translation layer (CudaPythonDriver) is tested with it; the driver itself needs the GPU."""
    calls: list[tuple[Any, ...]] = []

    class CUcheckpointLockArgs:
        timeoutMs = 0

    def call(name: str, result: tuple[Any, ...]) -> Any:
        def fn(*args: Any) -> tuple[Any, ...]:
            calls.append((name, *[getattr(a, "timeoutMs", a) for a in args]))
            return result

        return fn

    driver = types.SimpleNamespace(
        CUresult=CUresult,
        CUcheckpointLockArgs=CUcheckpointLockArgs,
        cuInit=call("cuInit", (init,)),
        cuDriverGetVersion=call("cuDriverGetVersion", (CUresult(0), version)),
        cuGetErrorString=lambda err: (CUresult(0), f"text of {err.name}".encode()),
        cuCheckpointProcessGetState=call("state", (CUresult(0), 2)),
        cuCheckpointProcessLock=call("lock", (lock,)),
        cuCheckpointProcessCheckpoint=call("checkpoint", (CUresult(0),)),
        cuCheckpointProcessRestore=call("restore", (CUresult.CUDA_ERROR_ILLEGAL_STATE,)),
        cuCheckpointProcessUnlock=call("unlock", (CUresult(0),)),
    )
    if missing:
        delattr(driver, missing)
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver  # type: ignore[attr-defined]
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
    return calls


def test_cuda_python_calls_and_answers_are_translated(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_bindings(monkeypatch, lock=CUresult.CUDA_ERROR_TIMEOUT)
    drv = CudaPythonDriver()
    assert drv.state(42) is ProcessState.CHECKPOINTED
    with pytest.raises(DriverError) as err:
        drv.lock(42, 1500)
    assert err.value.timed_out and err.value.code == "CUDA_ERROR_TIMEOUT" and err.value.pid == 42
    assert "text of CUDA_ERROR_TIMEOUT" in str(err.value)
    drv.checkpoint(42)
    drv.unlock(42)
    with pytest.raises(DriverError, match=r"cuCheckpointProcessRestore.*CUDA_ERROR_ILLEGAL_STATE"):
        drv.restore(42)
    assert calls == [
        ("cuInit", 0),
        ("cuDriverGetVersion",),
        ("state", 42),
        ("lock", 42, 1500),
        ("checkpoint", 42, None),
        ("unlock", 42, None),
        ("restore", 42, None),
    ]


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"init": CUresult.CUDA_ERROR_NO_DEVICE}, "cuInit(0) returned CUDA_ERROR_NO_DEVICE"),
        ({"version": 12040}, "supports CUDA 12.4; the checkpoint API with lock timeouts needs driver r570+"),
        ({"missing": "cuCheckpointProcessLock"}, "lacks cuCheckpointProcessLock; install cuda-python >= 12.8"),
    ],
)
def test_cuda_python_that_cannot_checkpoint_is_unavailable(
    monkeypatch: pytest.MonkeyPatch, kw: dict[str, Any], says: str
) -> None:
    fake_bindings(monkeypatch, **kw)
    with pytest.raises(BackendUnavailable, match=re.escape(says)):
        CudaPythonDriver()


# --------------------------------------------------------------------------- through the real agent


@pytest.fixture
def rule_driver(children: list[int]) -> Iterator[tuple[RuleDriver, CudaBackend]]:
    """The agent's ``cuda`` backend, over a RuleDriver, for this test."""
    drv = RuleDriver({children[0]: 2 * GB})
    be = backend(drv)
    register_backend("cuda", lambda nc, node: be)
    try:
        yield drv, be
    finally:
        register_backend("cuda", make_cuda_backend, probe=cuda_unavailable_reason)
        be.close()


@pytest.fixture
async def agent(nats_url: str) -> AsyncIterator[Agent]:
    async with running(Agent(AgentConfig(node_id="n1", nats_url=nats_url))) as a:
        yield a


async def _register_cuda_job(nats_url: str, pid: int) -> WorkloadChannel:
    """Job ``j`` (group ``standalone``) registered on node ``n1`` from this process, with the ``cuda`` backend over
    ``pid`` and handlers that do nothing."""
    return await register_workload(
        "j",
        "standalone",
        CallbackHandler(lambda m, t: None, lambda m, t: None),
        node_id="n1",
        nats_url=nats_url,
        backends=("cuda",),
        pids=(pid,),
    )


async def _finish(agent: Agent, op_id: str) -> OpResult:
    def done() -> OpResult:
        status = agent.operation(op_id)
        assert status is not None and status.done and status.result is not None, status
        return status.result

    return await eventually(done, what=f"operation {op_id} done")


async def test_agent_state_machine_over_the_cuda_backend(
    agent: Agent, rule_driver: tuple[RuleDriver, CudaBackend], children: list[int], nats_url: str
) -> None:
    drv, _ = rule_driver
    pid = children[0]
    # An unregistered job's pids are no proof: a standalone call naming them is refused (docs/security.md).
    with pytest.raises(ValueError, match="did not prove its processes"):
        await agent.run_standalone("j", OpKind.SNAPSHOT, backends=("cuda",), pids=(pid,))
    # Registered from this process (the agent socket proves it), its child is the job's to checkpoint.
    channel = await _register_cuda_job(nats_url, pid)
    assert agent.jobs()["j"].owner is not None and agent.jobs()["j"].owner.pid == os.getpid()
    r = await _finish(agent, await agent.run_standalone("j", OpKind.SNAPSHOT))
    assert r.ok and r.device_bytes_freed == 2 * GB and r.backend == "cuda"
    assert agent.jobs()["j"].state is JobState.SAVED and drv.states[pid] is ProcessState.CHECKPOINTED
    r = await _finish(agent, await agent.run_standalone("j", OpKind.RESTORE))
    assert r.ok and agent.jobs()["j"].state is JobState.RUNNING and drv.states[pid] is ProcessState.RUNNING
    # a checkpoint refused by the driver: unlocked, the job runs again, the error says why
    drv.fail[("checkpoint", pid)] = "CUDA_ERROR_NOT_SUPPORTED"
    r = await _finish(agent, await agent.run_standalone("j", OpKind.SNAPSHOT))
    assert not r.ok and "CUDA_ERROR_NOT_SUPPORTED" in (r.error or "") and "rolled back" in (r.error or "")
    assert agent.jobs()["j"].state is JobState.RUNNING and drv.states[pid] is ProcessState.RUNNING
    # a restore that fails leaves the job FAULTED (its state is unknown), with the driver's answer
    await _finish(agent, await agent.run_standalone("j", OpKind.SNAPSHOT))
    drv.fail[("restore", pid)] = "CUDA_ERROR_UNKNOWN"
    r = await _finish(agent, await agent.run_standalone("j", OpKind.RESTORE))
    assert not r.ok and agent.jobs()["j"].state is JobState.FAULTED
    assert "CUDA_ERROR_UNKNOWN" in (agent.jobs()["j"].reason or "")
    await channel.close()


async def test_the_grpc_api_refuses_a_process_the_job_did_not_prove_as_permission_denied(
    agent: Agent, rule_driver: tuple[RuleDriver, CudaBackend], children: list[int], nats_url: str
) -> None:
    """``BackendConfig.cuda.explicit_target`` naming a process that is not the registered job's (pid 1 here; the
    test's children are its own): PERMISSION_DENIED, not INVALID_ARGUMENT (the request is well formed; the caller
    may not act on that process), and the process is untouched."""
    import grpc
    from timeslice_agent.grpc_shim import AgentGrpcConfig, AgentGrpcShim

    from .grpc_proto_client import AGENT_PROTO, Stub, compile_proto

    drv, _ = rule_driver
    channel = await _register_cuda_job(nats_url, children[0])
    shim = AgentGrpcShim(agent, AgentGrpcConfig(host="127.0.0.1", port=0))
    port = await shim.start()
    pb = compile_proto(AGENT_PROTO)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            s = Stub(ch, pb, "SnapshotAgentService")
            cfg = pb.BackendConfig(cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=[1])))
            with pytest.raises(grpc.RpcError) as info:
                await asyncio.to_thread(s.Snapshot, pb.SnapshotRequest(job_id="j", backend_config=cfg), timeout=10)
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED, info.value
        assert drv.states[children[0]] is ProcessState.RUNNING
    finally:
        await shim.stop()
        await channel.close()
