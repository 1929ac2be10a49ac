"""timeslice snapshot agent: the node-local daemon that moves job contexts off the accelerators and back."""

from ._cuda import CheckpointDriver, DriverError, ProcessState
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
    "NoopBackend",
    "OpContext",
    "OperationInProgress",
    "Outcome",
    "ProcessState",
    "available_backends",
    "register_backend",
    "unavailable_backends",
]
