"""The ``cuda`` backend against what a real driver and NVML do that the happy path never shows (issue 26's read of
the GPU code against the CUDA, cuda-python and NVML docs), on the fake driver of tests/test_backend_cuda.py:

* a lock not taken in time answers ``CUDA_ERROR_NOT_READY`` (the documented code): it is retried like a timeout;
* a driver call that outlives its operation's deadline is waited for before the operation ends, so the agent
  never reports while a checkpoint still moves the job's memory;
* NVML raising inside the backend neither fails a move that happened nor leaves the job TRANSITIONING;
* a process state a newer driver reports (a checkpoint or restore in progress) is a CUDA process in a state
  nothing may assume: never skipped, never called running, the job faulted with the value named."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest
from timeslice_agent._backend_chain import perform
from timeslice_agent._cuda import CudaBackend, CudaPythonDriver, DriverError, ProcessState, UnknownProcessState
from timeslice_agent._nvml import GpuAccounting
from timeslice_client.protocol import JobState, OpKind

from .test_backend_cuda import GB, CUresult, DriverNvml, RuleDriver, backend, children, ctx, fake_bindings, op

__all__ = ["children"]  # the fixture, imported for these tests


class NotReadyDriver(RuleDriver):
    """Locks that cannot be taken in time answer as the driver documents: CUDA_ERROR_NOT_READY."""

    def lock(self, pid: int, timeout_ms: int) -> None:
        with self._mu:
            if self.lock_timeouts.get(pid, 0) > 0:
                self.lock_timeouts[pid] -= 1
                self.calls.append(("lock", pid))
                raise DriverError("cuCheckpointProcessLock", pid, "CUDA_ERROR_NOT_READY")
        super().lock(pid, timeout_ms)


async def test_a_lock_answered_not_ready_is_retried_like_a_timeout(children: list[int]) -> None:
    a = children[0]
    drv = NotReadyDriver({a: GB})
    drv.lock_timeouts[a] = 2
    await backend(drv, lock_timeout_ms=250, lock_attempts=3).snapshot(ctx(pids=(a,)), op())
    assert drv.states[a] is ProcessState.CHECKPOINTED
    assert drv.calls == [("lock", a), ("lock", a), ("lock", a), ("checkpoint", a)]


class SlowCheckpoint(RuleDriver):
    """A checkpoint that takes ``seconds`` in its thread, as a large context does."""

    def __init__(self, pids: dict[int, int], seconds: float) -> None:
        super().__init__(pids)
        self.seconds = seconds
        self.ended_at: float | None = None

    def checkpoint(self, pid: int) -> None:
        threading.Event().wait(self.seconds)  # the copy, in the driver's thread
        super().checkpoint(pid)
        self.ended_at = time.monotonic()


async def test_a_checkpoint_that_outlives_its_deadline_is_waited_for_before_the_operation_ends(
    children: list[int],
) -> None:
    a = children[0]
    drv = SlowCheckpoint({a: GB}, seconds=1.0)
    be = backend(drv)
    job = ctx(pids=(a,), op_timeout_ms=300)
    state, error, _ = await perform([be], job, op(0.3), OpKind.SNAPSHOT, JobState.RUNNING)
    ended = time.monotonic()
    assert state is JobState.FAULTED and error is not None and "timed out" in error
    assert drv.ended_at is not None and drv.ended_at <= ended  # the driver's call ended before the operation did
    assert drv.states[a] is ProcessState.CHECKPOINTED  # what really happened; a restore after the clear finds it


async def test_the_wait_for_a_driver_call_is_bounded(children: list[int]) -> None:
    a = children[0]
    drv = SlowCheckpoint({a: GB}, seconds=3.0)
    be = CudaBackend(drv, GpuAccounting(DriverNvml(drv)), drain_s=0.2)
    t0 = time.monotonic()
    state, _, _ = await perform([be], ctx(pids=(a,), op_timeout_ms=200), op(0.2), OpKind.SNAPSHOT, JobState.RUNNING)
    assert state is JobState.FAULTED and time.monotonic() - t0 < 2.5  # 0.2 s deadline + 0.2 s drain, not 3 s
    be.close()


class BrokenNvml(DriverNvml):
    def __init__(self, driver: RuleDriver, *, fail_after: int) -> None:
        super().__init__(driver)
        self.left = fail_after

    def processes(self) -> Any:
        if self.left <= 0:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")  # pynvml raises its own NVMLError subclasses
        self.left -= 1
        return super().processes()


@pytest.mark.parametrize("fail_after", [0, 1, 2])
async def test_nvml_failing_inside_the_backend_never_fails_a_move_that_happened(
    children: list[int], fail_after: int
) -> None:
    """0: NVML fails at discovery (the driver finds the processes); 1: at the measure before; 2: after."""
    a = children[0]
    drv = RuleDriver({a: GB})
    be = CudaBackend(drv, GpuAccounting(BrokenNvml(drv, fail_after=fail_after)))
    state, error, _ = await perform([be], ctx(pids=(a,)), op(), OpKind.SNAPSHOT, JobState.RUNNING)
    assert (state, error) == (JobState.SAVED, None)
    assert drv.states[a] is ProcessState.CHECKPOINTED
    state, error, _ = await perform([be], ctx(pids=(a,)), op(), OpKind.RESTORE, JobState.SAVED)
    assert (state, error) == (JobState.RUNNING, None) and drv.states[a] is ProcessState.RUNNING


async def test_any_error_a_backend_raises_faults_the_job_instead_of_leaving_it_transitioning() -> None:
    class Buggy:
        name = "buggy"

        async def snapshot(self, ctx: Any, op: Any) -> Any:
            raise KeyError("a bug")

        async def restore(self, ctx: Any, op: Any) -> Any:
            raise KeyError("a bug")

    for kind in (OpKind.SNAPSHOT, OpKind.RESTORE):
        state, error, _ = await perform([Buggy()], ctx(), op(), kind, JobState.RUNNING)  # type: ignore[list-item]
        assert state is JobState.FAULTED and error is not None and "KeyError('a bug')" in error


class NewerDriver(RuleDriver):
    """Reports a state value this agent does not know for one process (a newer driver's CHECKPOINTING)."""

    def __init__(self, pids: dict[int, int], odd: int) -> None:
        super().__init__(pids)
        self.odd = odd

    def state(self, pid: int) -> ProcessState:
        if pid == self.odd:
            raise UnknownProcessState(pid, 4)
        return super().state(pid)


async def test_a_state_a_newer_driver_reports_faults_the_job_and_is_never_skipped(children: list[int]) -> None:
    a, b = children[:2]
    drv = NewerDriver({a: GB, b: GB}, odd=b)
    be = backend(drv, nvml=False)  # discovery by the driver: b must count as a CUDA process
    state, error, _ = await perform([be], ctx(pids=(a, b)), op(), OpKind.SNAPSHOT, JobState.RUNNING)
    assert state is JobState.FAULTED and error is not None
    assert "CU_PROCESS_STATE_4" in error and f"pid {b}" in error
    assert drv.states[a] is ProcessState.RUNNING  # the other process was brought back


def test_the_cuda_python_driver_names_an_unknown_state_instead_of_raising_value_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_bindings(monkeypatch)
    drv = CudaPythonDriver()
    sys.modules["cuda.bindings.driver"].cuCheckpointProcessGetState = lambda pid: (CUresult(0), 5)
    with pytest.raises(UnknownProcessState) as err:
        drv.state(42)
    assert err.value.value == 5 and err.value.code == "CU_PROCESS_STATE_5" and isinstance(err.value, DriverError)
