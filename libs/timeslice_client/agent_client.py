"""``SnapshotAgentClient``: the standalone snapshot agent API over gRPC (``snapshot_agent.v1alpha1``).

For services that schedule themselves and move a job's accelerator context directly, without the
orchestrator::

    from timeslice_client import SnapshotAgentClient
    from timeslice_client.agent_client import AppChannel

    with SnapshotAgentClient("127.0.0.1:9001") as agent:
        op = agent.snapshot_and_wait("trainer-0", backend=AppChannel(mode="offload"))
        print(op.storage_bytes, op.elapsed_ms)
        ...
        agent.restore_and_wait("trainer-0", backend=AppChannel())

Every call has a finite default timeout. Failures raise :class:`~timeslice_client.TimeSliceError`
subclasses: :class:`AgentError` (with the gRPC ``code``), :class:`OperationFailed` (the operation
ran and failed), :class:`OperationNotFound`, :class:`OperationTimeout`,
:class:`~timeslice_client.Unavailable` (the agent does not answer) and
:class:`~timeslice_client.InvalidRequest` (bad ids).
"""

from __future__ import annotations

import abc
import asyncio
import enum
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import grpc

from ._async_closing import AsyncClosing
from ._grpc import snapshot_agent_pb2 as pb
from ._grpc.runtime import channel_credentials
from ._renamed import renamed_keywords
from .errors import (
    AgentError,
    InvalidRequest,
    OperationFailed,
    OperationNotFound,
    OperationTimeout,
    TimeSliceError,
    Unavailable,
)
from .protocol import JobState

__all__ = [
    "Accelerator",
    "AgentError",
    "AgentStatus",
    "AppChannel",
    "AppEndpoint",
    "AsyncSnapshotAgentClient",
    "Cuda",
    "Operation",
    "OperationFailed",
    "OperationNotFound",
    "OperationState",
    "OperationTimeout",
    "SnapshotAgentClient",
    "default_target",
]

_SERVICE = pb.DESCRIPTOR.services_by_name["SnapshotAgentService"]
Mode = Literal["offload", "discard"] | None


def default_target() -> str:
    """``$TIMESLICE_AGENT_GRPC_TARGET``, else this node's agent at ``127.0.0.1:9001``."""
    return os.environ.get("TIMESLICE_AGENT_GRPC_TARGET") or "127.0.0.1:9001"


# ---------------------------------------------------------------------- values (the errors are in ``errors``)


class OperationState(enum.StrEnum):
    PENDING = "pending"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Operation:
    op_id: str
    state: OperationState
    elapsed_ms: int
    storage_bytes: int | None = None  # bytes moved to or from host memory (when complete)
    device_bytes: int | None = None  # device memory freed by a snapshot (when complete)
    error: str | None = None  # when failed

    @property
    def done(self) -> bool:
        return self.state is not OperationState.PENDING

    @property
    def ok(self) -> bool:
        return self.state is OperationState.COMPLETE


@dataclass(frozen=True, slots=True)
class Accelerator:
    id: str
    memory_used_bytes: int
    memory_total_bytes: int


@dataclass(frozen=True, slots=True)
class AgentStatus:
    jobs: dict[str, JobState]
    accelerators: list[Accelerator]


@dataclass(frozen=True, slots=True)
class AppChannel:
    """The workload suspends/resumes itself through its registered channel (``register_workload``)."""

    mode: Mode = None
    tags: Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class Cuda:
    """The CUDA driver's process checkpoint of these processes (when the agent has the backend)."""

    pids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class AppEndpoint:
    """A vLLM or SGLang server's own sleep/wake HTTP API (when the agent has the backend)."""

    app: Literal["vllm", "sglang"]
    endpoints: Sequence[str] = field(default_factory=tuple)
    mode: Mode = None
    tags: Sequence[str] = ()


Backend = AppChannel | Cuda | AppEndpoint | None

_MODES = {None: pb.SUSPEND_MODE_UNSPECIFIED, "offload": pb.SUSPEND_MODE_OFFLOAD, "discard": pb.SUSPEND_MODE_DISCARD}
_APPS = {"vllm": pb.APP_VLLM, "sglang": pb.APP_SGLANG}
_STATES = {
    pb.OPERATION_STATUS_PENDING: OperationState.PENDING,
    pb.OPERATION_STATUS_COMPLETE: OperationState.COMPLETE,
    pb.OPERATION_STATUS_FAILED: OperationState.FAILED,
}
_JOB_STATES = {
    pb.JOB_STATE_IDLE: JobState.IDLE,
    pb.JOB_STATE_RUNNING: JobState.RUNNING,
    pb.JOB_STATE_TRANSITIONING: JobState.TRANSITIONING,
    pb.JOB_STATE_SAVED: JobState.SAVED,
    pb.JOB_STATE_FAULTED: JobState.FAULTED,
}


def _backend_config(backend: Backend) -> pb.BackendConfig | None:
    if backend is None:
        return None  # the backends the job registered with
    if isinstance(backend, AppChannel):
        return pb.BackendConfig(app_channel=pb.AppChannelConfig(mode=_MODES[backend.mode], tags=list(backend.tags)))
    if isinstance(backend, Cuda):
        return pb.BackendConfig(cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=list(backend.pids))))
    return pb.BackendConfig(
        app_endpoint=pb.AppEndpointConfig(
            app=_APPS[backend.app],
            endpoints=list(backend.endpoints),
            mode=_MODES[backend.mode],
            tags=list(backend.tags),
        )
    )


def _operation(op_id: str, r: pb.GetOperationResponse) -> Operation:
    return Operation(
        op_id=op_id,
        state=_STATES.get(r.status, OperationState.FAILED),
        elapsed_ms=r.elapsed_ms,
        storage_bytes=r.storage_bytes if r.HasField("storage_bytes") else None,
        device_bytes=r.snapshot_device_bytes if r.HasField("snapshot_device_bytes") else None,
        error=r.error if r.HasField("error") else None,
    )


def _status(r: pb.StatusResponse) -> AgentStatus:
    return AgentStatus(
        jobs={j.job_id: _JOB_STATES.get(j.state, JobState.FAULTED) for j in r.job_statuses},
        accelerators=[Accelerator(a.id, a.memory_used_bytes, a.memory_total_bytes) for a in r.accelerator_statuses],
    )


def _error(exc: grpc.RpcError, target: str, what: str) -> TimeSliceError:
    call: Any = exc  # the errors grpc raises are also Calls (code(), details())
    code: grpc.StatusCode = call.code() if callable(getattr(call, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (call.details() if callable(getattr(call, "details", None)) else None) or str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(f"{what}: the snapshot agent at {target} did not answer ({code.name}: {details})")
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(f"{what}: {details}")
    if code is grpc.StatusCode.NOT_FOUND:
        return OperationNotFound(details, code=code, target=target)
    return AgentError(f"{what}: {details}", code=code, target=target)


def _credentials(
    tls_ca: str | Path | None, tls_cert: str | Path | None, tls_key: str | Path | None, tls: bool
) -> grpc.ChannelCredentials | None:
    if tls or tls_ca or tls_cert or tls_key:
        return channel_credentials(tls_ca, tls_cert, tls_key)
    return None


class _Poll:
    """Polling intervals for the *_and_wait helpers: fast first (most operations are quick), then slower."""

    def __init__(self) -> None:
        self.delay = 0.002

    def next(self) -> float:
        d, self.delay = self.delay, min(self.delay * 2, 0.2)
        return d


def _finished(op: Operation, limit: float, deadline: float) -> bool:
    """Whether ``wait()`` ends with ``op``: True when it succeeded; raises OperationFailed when it failed, and
    OperationTimeout (``limit`` seconds) when it is still running at ``deadline`` (monotonic)."""
    if op.done:
        if not op.ok:
            raise OperationFailed(op)
        return True
    if time.monotonic() >= deadline:
        raise OperationTimeout(op.op_id, limit)
    return False


class _AgentClient(abc.ABC):
    """What both clients share: the target, the bounds and the channel's calls, one per method of the service."""

    @renamed_keywords(wait_timeout="wait_timeout_s")
    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float = 10.0,
        wait_timeout_s: float = 300.0,
        tls: bool = False,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target or default_target()
        self.timeout = timeout
        self.wait_timeout_s = wait_timeout_s
        creds = _credentials(tls_ca, tls_cert, tls_key, tls)
        self._channel = self._open(creds, list(options))
        self._calls: dict[str, Any] = {
            m.name: self._channel.unary_unary(
                f"/{_SERVICE.full_name}/{m.name}",
                request_serializer=lambda msg: msg.SerializeToString(),
                response_deserializer=getattr(pb, m.output_type.name).FromString,
            )
            for m in _SERVICE.methods
        }

    @abc.abstractmethod
    def _open(self, creds: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]) -> Any:
        """The channel to the agent: a blocking or an asyncio one, by the client's kind."""


# ---------------------------------------------------------------------- the blocking client


class SnapshotAgentClient(_AgentClient):
    """Blocking client of one node's snapshot agent. ``target`` is ``host:port`` (default
    :func:`default_target`); ``tls=True`` (or any ``tls_*`` file) uses TLS, with ``tls_cert``/``tls_key``
    for mutual TLS."""

    def _open(self, creds: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]) -> grpc.Channel:
        if creds is not None:
            return grpc.secure_channel(self.target, creds, options)
        return grpc.insecure_channel(self.target, options)

    def _call(self, method: str, request: Any, timeout: float | None, what: str) -> Any:
        try:
            return self._calls[method](request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as exc:
            raise _error(exc, self.target, what) from exc

    def snapshot(self, job_id: str, group: str = "", *, backend: Backend = None, timeout: float | None = None) -> str:
        """Start moving ``job_id``'s context off the accelerators; returns the operation id."""
        req = pb.SnapshotRequest(job_id=job_id, group=group, backend_config=_backend_config(backend))
        return str(self._call("Snapshot", req, timeout, f"snapshot of {job_id!r}").operation_id)

    def restore(self, job_id: str, group: str = "", *, backend: Backend = None, timeout: float | None = None) -> str:
        """Start bringing ``job_id``'s context back; returns the operation id."""
        req = pb.RestoreRequest(job_id=job_id, group=group, backend_config=_backend_config(backend))
        return str(self._call("Restore", req, timeout, f"restore of {job_id!r}").operation_id)

    def get_operation(self, op_id: str, *, timeout: float | None = None) -> Operation:
        r = self._call("GetOperation", pb.GetOperationRequest(operation_id=op_id), timeout, f"operation {op_id}")
        return _operation(op_id, r)

    def status(self, *, timeout: float | None = None) -> AgentStatus:
        return _status(self._call("Status", pb.StatusRequest(), timeout, "status"))

    def wait(self, op_id: str, *, timeout: float | None = None) -> Operation:
        """Poll until the operation is done. Raises OperationFailed or OperationTimeout."""
        limit = self.wait_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        poll = _Poll()
        while True:
            op = self.get_operation(op_id, timeout=min(self.timeout, max(0.1, deadline - time.monotonic())))
            if _finished(op, limit, deadline):
                return op
            time.sleep(min(poll.next(), max(0.0, deadline - time.monotonic())))

    def snapshot_and_wait(
        self, job_id: str, group: str = "", *, backend: Backend = None, timeout: float | None = None
    ) -> Operation:
        return self.wait(self.snapshot(job_id, group, backend=backend), timeout=timeout)

    def restore_and_wait(
        self, job_id: str, group: str = "", *, backend: Backend = None, timeout: float | None = None
    ) -> Operation:
        return self.wait(self.restore(job_id, group, backend=backend), timeout=timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SnapshotAgentClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# ---------------------------------------------------------------------- the asyncio client


class AsyncSnapshotAgentClient(_AgentClient, AsyncClosing):
    """The same API for asyncio (``grpc.aio``); every method is a coroutine."""

    def _open(self, creds: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        if creds is not None:
            return grpc.aio.secure_channel(self.target, creds, options)
        return grpc.aio.insecure_channel(self.target, options)

    async def _call(self, method: str, request: Any, timeout: float | None, what: str) -> Any:
        try:
            return await self._calls[method](request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as exc:
            raise _error(exc, self.target, what) from exc

    async def snapshot(
        self, job_id: str, group: str = "", *, backend: Backend = None, timeout: float | None = None
    ) -> str:
        req = pb.SnapshotRequest(job_id=job_id, group=group, backend_config=_backend_config(backend))
        return str((await self._call("Snapshot", req, timeout, f"snapshot of {job_id!r}")).operation_id)

    async def restore(
        self, job_id: str, group: str = "", *, backend: Backend = None, timeout: float | None = None
    ) -> str:
        req = pb.RestoreRequest(job_id=job_id, group=group, backend_config=_backend_config(backend))
        return str((await self._call("Restore", req, timeout, f"restore of {job_id!r}")).operation_id)

    async def get_operation(self, op_id: str, *, timeout: float | None = None) -> Operation:
        r = await self._call("GetOperation", pb.GetOperationRequest(operation_id=op_id), timeout, f"operation {op_id}")
        return _operation(op_id, r)

    async def status(self, *, timeout: float | None = None) -> AgentStatus:
        return _status(await self._call("Status", pb.StatusRequest(), timeout, "status"))

    async def wait(self, op_id: str, *, timeout: float | None = None) -> Operation:
        limit = self.wait_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        poll = _Poll()
        while True:
            op = await self.get_operation(op_id, timeout=min(self.timeout, max(0.1, deadline - time.monotonic())))
            if _finished(op, limit, deadline):
                return op
            await asyncio.sleep(min(poll.next(), max(0.0, deadline - time.monotonic())))

    async def snapshot_and_wait(
        self, job_id: str, group: str = "", *, backend: Backend = None, timeout: float | None = None
    ) -> Operation:
        return await self.wait(await self.snapshot(job_id, group, backend=backend), timeout=timeout)

    async def restore_and_wait(
        self, job_id: str, group: str = "", *, backend: Backend = None, timeout: float | None = None
    ) -> Operation:
        return await self.wait(await self.restore(job_id, group, backend=backend), timeout=timeout)

    async def close(self) -> None:
        await self._channel.close()
