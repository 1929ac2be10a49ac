"""The ``cuda`` backend: the CUDA driver's process checkpoint API (driver r570+, through ``cuda-python``).

A snapshot locks each of the job's GPU processes (``cuCheckpointProcessLock`` with a timeout, retried a
bounded number of times when it times out: the driver then leaves the process RUNNING) and checkpoints
it (``cuCheckpointProcessCheckpoint``: the driver moves the process's device memory to host memory and
releases the device). A restore is ``cuCheckpointProcessRestore`` then ``cuCheckpointProcessUnlock``.
When anything fails after a lock, the processes already locked or checkpointed are unlocked (restored
first where needed) so the job runs again, and the error says so (``rolled_back``); only when that undo
fails too is the job left to fault.

The driver calls block, so each process gets its own thread: the processes of one job, and of different
jobs, are worked on concurrently. The calls go through the :class:`CheckpointDriver` seam; the real one
(:class:`CudaPythonDriver`) is imported lazily, so a node without ``cuda-python`` or a GPU runs the agent
and answers "backend unavailable" with the reason.

The job's processes are found with NVML (its registered PIDs, their descendants and its process group,
those holding device memory) and cached at snapshot time (a checkpointed process no longer appears in
NVML); device bytes freed are measured with NVML before and after. Without NVML the PIDs are those of the
job's process tree that the driver knows as CUDA processes, and no bytes are reported (not guessed).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from timeslice_client.protocol import JobContext

from ._backend_api import BackendError, BackendUnavailable, OpContext, Outcome
from ._errors import DriverError, UnknownProcessState
from ._load_once import LoadOnce
from ._nvml import GpuAccounting, gpu_source, process_tree

__all__ = [
    "CheckpointDriver",
    "CudaBackend",
    "CudaPythonDriver",
    "DriverError",
    "ProcessState",
    "UnknownProcessState",
    "cuda_unavailable_reason",
    "make_cuda_backend",
]

T = TypeVar("T")
log = logging.getLogger("timeslice.agent")

MIN_DRIVER_VERSION = 12080  # CUDA 12.8 driver API = r570, the first with cuCheckpointProcessLock's timeout


class ProcessState(enum.IntEnum):
    """``CUprocessState``."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class CheckpointDriver(Protocol):
    """The blocking driver calls, one process at a time; each raises :class:`DriverError`."""

    def state(self, pid: int) -> ProcessState: ...

    def lock(self, pid: int, timeout_ms: int) -> None: ...

    def checkpoint(self, pid: int) -> None: ...

    def restore(self, pid: int) -> None: ...

    def unlock(self, pid: int) -> None: ...


class CudaPythonDriver:
    """:class:`CheckpointDriver` over ``cuda.bindings.driver``. Raises :class:`BackendUnavailable`
    when the package, the driver or the API is missing."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError:
            try:
                from cuda import cuda as driver  # cuda-python < 12.6 layout
            except ImportError as exc:
                raise BackendUnavailable(
                    f"cuda-python is not installed ({exc}); install cuda-python >= 12.8 (e.g. "
                    "`pip install cuda-python`) on this node to use the cuda backend"
                ) from exc
        missing = [
            n
            for n in (
                "cuCheckpointProcessLock",
                "cuCheckpointProcessCheckpoint",
                "cuCheckpointProcessRestore",
                "cuCheckpointProcessUnlock",
                "cuCheckpointProcessGetState",
                "CUcheckpointLockArgs",
            )
            if not hasattr(driver, n)
        ]
        if missing:
            raise BackendUnavailable(f"this cuda-python lacks {', '.join(missing)}; install cuda-python >= 12.8")
        self._d: Any = driver
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise BackendUnavailable(f"cuInit(0) returned {self._name(err)}: no usable NVIDIA driver or GPU here")
        err, version = driver.cuDriverGetVersion()
        if err != driver.CUresult.CUDA_SUCCESS or version < MIN_DRIVER_VERSION:
            raise BackendUnavailable(
                f"the NVIDIA driver supports CUDA {version // 1000}.{version % 1000 // 10}; "
                "the checkpoint API with lock timeouts needs driver r570+ (CUDA 12.8)"
            )

    def _name(self, err: Any) -> str:
        name = getattr(err, "name", None)
        return str(name) if name else f"CUresult {int(err)}"

    def _detail(self, err: Any) -> str:
        try:
            e2, text = self._d.cuGetErrorString(err)
        except Exception:
            return ""
        return text.decode() if isinstance(text, bytes) and e2 == self._d.CUresult.CUDA_SUCCESS else ""

    def _call(self, call: str, pid: int, *args: Any) -> tuple[Any, ...]:
        try:
            err, *rest = getattr(self._d, call)(pid, *args)
        except RuntimeError as exc:  # the binding's own refusal, e.g. the driver lacks the symbol
            raise DriverError(call, pid, "RuntimeError", str(exc)) from exc
        if err != self._d.CUresult.CUDA_SUCCESS:
            raise DriverError(call, pid, self._name(err), self._detail(err))
        return tuple(rest)

    def state(self, pid: int) -> ProcessState:
        (state,) = self._call("cuCheckpointProcessGetState", pid)
        try:
            return ProcessState(int(state))
        except ValueError:
            raise UnknownProcessState(pid, int(state)) from None

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = self._d.CUcheckpointLockArgs()
        args.timeoutMs = max(1, timeout_ms)  # 0 would mean no timeout
        self._call("cuCheckpointProcessLock", pid, args)

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, None)

    def restore(self, pid: int) -> None:
        self._call("cuCheckpointProcessRestore", pid, None)

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, None)


class _PidFailed(Exception):
    def __init__(self, pid: int, message: str, *, rolled_back: bool) -> None:
        self.pid, self.rolled_back = pid, rolled_back
        super().__init__(message)


class CudaBackend:
    """The ``cuda`` backend (see the module doc). One instance serves every job of an agent process.

    ``lock_timeout_ms``: one lock attempt's bound; ``lock_attempts``: how many attempts a lock that times
    out gets (all within the operation's deadline)."""

    name = "cuda"

    def __init__(
        self,
        driver: CheckpointDriver,
        accounting: GpuAccounting | None = None,
        *,
        lock_timeout_ms: int = 10_000,
        lock_attempts: int = 3,
        max_threads: int = 64,
        drain_s: float = 300.0,
    ) -> None:
        if lock_timeout_ms <= 0 or lock_attempts <= 0:
            raise ValueError(
                f"lock_timeout_ms ({lock_timeout_ms}) and lock_attempts ({lock_attempts}) must be positive"
            )
        self.driver = driver
        self.accounting = accounting or GpuAccounting(None)
        self.lock_timeout_ms = lock_timeout_ms
        self.lock_attempts = lock_attempts
        self.drain_s = drain_s  # how long a cancelled operation waits for its driver calls to end
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="cuda-checkpoint")
        self._saved: dict[tuple[str, str], tuple[int, ...]] = {}  # (node, job) -> PIDs of its snapshot
        self._guard = threading.Lock()

    def saved_pids(self, ctx: JobContext) -> tuple[int, ...] | None:
        """The PIDs the last snapshot of this job checkpointed (None when no snapshot is outstanding)."""
        with self._guard:
            return self._saved.get((ctx.node, ctx.job))

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _each(self, pids: Iterable[int], fn: Callable[[int], None]) -> dict[int, BaseException | None]:
        """Run ``fn(pid)`` for every PID, each in its own thread, all at once; every outcome by PID.

        Cancelled (the operation's deadline, the processes gone, the agent stopping), it still waits for the
        driver calls under way, up to ``drain_s``: a thread cannot be stopped, and a checkpoint that went on after
        its operation ended would free (or fill) the device behind the agent's back."""
        order = list(pids)
        calls = asyncio.gather(*(self._in_thread(fn, pid) for pid in order), return_exceptions=True)
        try:
            outcomes = await asyncio.shield(calls)
        except asyncio.CancelledError:
            ended: list[Any] | None = None
            with contextlib.suppress(TimeoutError):
                ended = await asyncio.wait_for(asyncio.shield(calls), self.drain_s)
            if ended is None:
                log.warning(
                    "cuda driver calls of pids %s still run %.0f s after their operation ended", order, self.drain_s
                )
            else:
                log.warning(
                    "cuda driver calls of pids %s ended after their operation did: %s",
                    order,
                    [type(o).__name__ if isinstance(o, BaseException) else "ok" for o in ended],
                )
            raise
        return {pid: (o if isinstance(o, BaseException) else None) for pid, o in zip(order, outcomes, strict=True)}

    # ------------------------------------------------------------------ discovery

    def _cuda_pids(self, candidates: Iterable[int]) -> tuple[int, ...]:
        found: list[int] = []
        for pid in sorted(candidates):
            try:
                self.driver.state(pid)
            except UnknownProcessState:
                pass  # a CUDA process all the same: the snapshot refuses it (never skips its context)
            except DriverError:
                continue  # not a CUDA process (or gone)
            found.append(pid)
        return tuple(found)

    def _discover(self, ctx: JobContext) -> tuple[int, ...]:
        if self.accounting.source is not None:
            try:
                found = tuple(sorted({p.pid for p in self.accounting.job_processes(ctx.pids, ctx.pgid)}))
            except Exception as exc:  # NVML's own errors: the driver can still say which processes use CUDA
                log.warning(
                    "NVML could not list the job's GPU processes: %r; asking the driver",
                    exc,
                    extra={"node": ctx.node, "job": ctx.job},
                )
                found = ()
            if found:
                return found
        # No NVML, or it lists none of the job's processes (none holds memory yet, or NVML sees another
        # PID namespace): the driver says which of the job's processes are CUDA processes.
        return self._cuda_pids(process_tree(ctx.pids, ctx.pgid))

    # ------------------------------------------------------------------ snapshot

    async def snapshot(self, ctx: JobContext, op: OpContext) -> Outcome:
        pids = await self._in_thread(self._discover, ctx)
        if op.may_act is not None:  # the agent's rules (_ownership): never a process of another uid, never itself
            may_act = op.may_act
            pids = tuple(p for p in pids if may_act(p))
        if not pids:
            return Outcome()  # the job holds no GPU memory (yet): nothing to move
        before = await self._in_thread(self._used, pids)
        with self._guard:
            self._saved[(ctx.node, ctx.job)] = pids  # before anything moves: a half-done snapshot is restorable
        failed = {
            pid: exc
            for pid, exc in (await self._each(pids, lambda pid: self._snapshot_one(pid, op))).items()
            if exc is not None
        }
        if failed:
            raise await self._roll_back(ctx, op, pids, failed)
        after = await self._in_thread(self._used, pids)
        return Outcome(bytes_moved=before, device_bytes_freed=max(0, before - after))

    def _used(self, pids: tuple[int, ...]) -> int:
        """Device bytes of ``pids`` as NVML tells them; 0 when it cannot (a measurement never fails the move)."""
        try:
            return self.accounting.used_by(pids)
        except Exception as exc:
            log.warning("NVML could not measure the job's device memory: %r (reported as 0)", exc)
            return 0

    def _snapshot_one(self, pid: int, op: OpContext) -> None:
        try:
            state = self.driver.state(pid)
        except UnknownProcessState as exc:  # not touched, but nothing says it runs: the job is faulted
            raise _PidFailed(pid, str(exc), rolled_back=False) from exc
        except DriverError as exc:
            raise _PidFailed(pid, str(exc), rolled_back=True) from exc
        if state is ProcessState.CHECKPOINTED:
            return
        if state is ProcessState.FAILED:
            raise _PidFailed(pid, f"pid {pid} is in CU_PROCESS_STATE_FAILED", rolled_back=False)
        if state is ProcessState.RUNNING:
            self._lock(pid, op)
        try:
            self.driver.checkpoint(pid)
        except DriverError as exc:
            try:
                self.driver.unlock(pid)
            except DriverError as undo:
                raise _PidFailed(pid, f"{exc}; unlock failed too: {undo}", rolled_back=False) from exc
            raise _PidFailed(pid, f"{exc} (unlocked: running again)", rolled_back=True) from exc

    def _lock(self, pid: int, op: OpContext) -> None:
        last: DriverError | None = None
        for attempt in range(1, self.lock_attempts + 1):
            budget_ms = int(min(self.lock_timeout_ms, (op.deadline - time.monotonic()) * 1000))
            if budget_ms <= 0:
                break
            try:
                self.driver.lock(pid, budget_ms)
                return
            except DriverError as exc:
                last = exc
                if not exc.timed_out:
                    raise _PidFailed(pid, str(exc), rolled_back=True) from exc
                if attempt < self.lock_attempts:
                    continue
        tries = f"{self.lock_attempts} attempts of up to {self.lock_timeout_ms} ms"
        why = f"last: {last}" if last else "the operation's deadline passed"
        raise _PidFailed(
            pid,
            f"could not lock pid {pid} within {tries} ({why}); it keeps running. A process "
            "inside a long kernel or a blocking CUDA call cannot be locked until it returns",
            rolled_back=True,
        )

    async def _roll_back(
        self, ctx: JobContext, op: OpContext, pids: tuple[int, ...], failed: dict[int, BaseException]
    ) -> BackendError:
        """Bring every PID of a failed snapshot back to RUNNING; the error to raise says whether it worked."""
        reasons = "; ".join(f"pid {pid}: {exc}" for pid, exc in sorted(failed.items()))
        stuck = [pid for pid, exc in failed.items() if not (isinstance(exc, _PidFailed) and exc.rolled_back)]
        undone = await self._each([p for p in pids if p not in failed], self._restore_one)
        stuck += [pid for pid, exc in undone.items() if exc is not None]
        undo_errors = "; ".join(f"pid {pid}: {exc}" for pid, exc in sorted(undone.items()) if exc is not None)
        if stuck:
            return BackendError(
                f"cuda snapshot of job {ctx.job!r} failed ({reasons}); processes {sorted(stuck)} "
                f"could not be brought back to RUNNING{': ' + undo_errors if undo_errors else ''}",
                rolled_back=False,
            )
        with self._guard:
            self._saved.pop((ctx.node, ctx.job), None)
        return BackendError(
            f"cuda snapshot of job {ctx.job!r} failed ({reasons}); all its processes run again", rolled_back=True
        )

    # ------------------------------------------------------------------ restore

    async def restore(self, ctx: JobContext, op: OpContext) -> Outcome:
        pids = self.saved_pids(ctx)
        if pids is None:  # e.g. the agent restarted: ask the driver about the job's processes
            pids = await self._in_thread(self._cuda_pids, process_tree(ctx.pids, ctx.pgid))
        if not pids:
            return Outcome()
        outcomes = await self._each(pids, self._restore_one)
        failed = {pid: exc for pid, exc in outcomes.items() if exc is not None}
        if failed:
            reasons = "; ".join(f"pid {pid}: {exc}" for pid, exc in sorted(failed.items()))
            raise BackendError(f"cuda restore of job {ctx.job!r} failed: {reasons}", rolled_back=False)
        with self._guard:
            self._saved.pop((ctx.node, ctx.job), None)
        used = await self._in_thread(self._used, pids)
        return Outcome(bytes_moved=used)

    def _restore_one(self, pid: int) -> None:
        state = self.driver.state(pid)
        if state is ProcessState.FAILED:
            raise DriverError(
                "cuCheckpointProcessGetState",
                pid,
                "CU_PROCESS_STATE_FAILED",
                "the process failed during checkpoint or restore",
            )
        if state is ProcessState.CHECKPOINTED:
            self.driver.restore(pid)
            state = ProcessState.LOCKED
        if state is ProcessState.LOCKED:
            self.driver.unlock(pid)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- the agent's instance


def _new_backend() -> CudaBackend:
    try:
        return CudaBackend(CudaPythonDriver(), GpuAccounting(gpu_source()))
    except BackendUnavailable:
        raise
    except Exception as exc:  # a broken installation must not take the agent down
        raise BackendUnavailable(f"cuda-python failed to load: {exc!r}") from exc


_shared = LoadOnce(_new_backend, BackendUnavailable, "the cuda backend is unavailable: %s")


def cuda_unavailable_reason() -> str | None:
    """None when the cuda backend works on this node, else why not (tried once per process)."""
    return _shared.error()


def make_cuda_backend(nc: object, node: str) -> CudaBackend:
    """The backend factory: the process-wide instance (it keeps the PIDs of outstanding snapshots)."""
    backend = _shared.get()
    if backend is None:
        raise BackendUnavailable(f"the cuda backend is unavailable on node {node!r}: {_shared.error()}")
    return backend
