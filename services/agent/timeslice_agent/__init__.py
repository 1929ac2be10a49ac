"""timeslice snapshot agent: the node-local daemon that moves job contexts off the accelerators and back."""

from ._cuda import CheckpointDriver, DriverError, ProcessState
from ._errors import AgentServiceError, AgentSocketError, HttpError, Refusal, Refused, UnknownProcessState
from ._nvml import GpuAccounting, GpuProcess, GpuSource
from ._standalone import OperationInProgress
from .backends import (
    AppChannelBackend,
    AppEndpointBackend,
    Backend,
    BackendError,
    BackendUnavailable,
    CudaBackend,
    FreezeBackend,
    NoopBackend,
    OpContext,
    Outcome,
    available_backends,
    register_backend,
    unavailable_backends,
)
from .metrics import AgentMetrics
from .service import Agent, AgentConfig

__all__ = [
    "Agent",
    "AgentConfig",
    "AgentMetrics",
    "AgentServiceError",
    "AgentSocketError",
    "AppChannelBackend",
    "AppEndpointBackend",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "CheckpointDriver",
    "CudaBackend",
    "DriverError",
    "FreezeBackend",
    "GpuAccounting",
    "GpuProcess",
    "GpuSource",
    "HttpError",
    "NoopBackend",
    "OpContext",
    "OperationInProgress",
    "Outcome",
    "ProcessState",
    "Refusal",
    "Refused",
    "UnknownProcessState",
    "available_backends",
    "register_backend",
    "unavailable_backends",
]
