"""timeslice client library: acquire and yield a group of accelerators at your phase boundaries.

Quick start::

    from timeslice_client import TimeSliceClient

    client = TimeSliceClient(job_id="job-a", group_id="gpus-0")

    @client.on_accelerators()          # acquire on entry, release on exit
    def train_step(batch):
        ...

The asyncio API (:class:`AsyncTimeSliceClient`) is the core; :class:`TimeSliceClient` runs it on a
loop thread of its own.
"""

from typing import TYPE_CHECKING, Any

from ._async_client import AsyncTimeSliceClient, Grant, ReleaseResult
from ._group_status import GroupStatus, HolderStatus, WaiterStatus
from ._sync_client import TimeSliceClient
from .errors import (
    AcquireAllFailed,
    AcquireAllTimeout,
    AcquireCancelled,
    AcquireTimeout,
    AgentError,
    AgentRefused,
    BusUnreachable,
    CredentialsError,
    GroupFull,
    GroupQuarantined,
    HandlerError,
    InvalidId,
    InvalidNatsUrl,
    InvalidRequest,
    JobFaulted,
    LeaseExpired,
    LockLost,
    LockOrderError,
    NotHolder,
    OperationFailed,
    OperationNotFound,
    OperationTimeout,
    StaleEpoch,
    TimeSliceError,
    Unavailable,
    UnresizableStorage,
)
from .handlers import CallbackHandler, HandlerResult, WorkloadHandler
from .protocol import GroupRecord, GroupState, JobState, SuspendMode
from .workload import WorkloadChannel, register_workload

if TYPE_CHECKING:
    from .agent_client import AsyncSnapshotAgentClient, SnapshotAgentClient


def __getattr__(name: str) -> Any:
    """The gRPC snapshot-agent clients load grpc and protobuf only when first used."""
    if name in ("SnapshotAgentClient", "AsyncSnapshotAgentClient"):
        try:
            from . import agent_client
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in ("grpc", "google"):
                raise
            raise ModuleNotFoundError(
                f"timeslice_client.{name} needs gRPC, which is not installed ({exc}): "
                "pip install 'timeslice-client[grpc]'",
                name=exc.name,
            ) from exc

        return getattr(agent_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AcquireAllFailed",
    "AcquireAllTimeout",
    "AcquireCancelled",
    "AcquireTimeout",
    "AgentError",
    "AgentRefused",
    "AsyncSnapshotAgentClient",
    "AsyncTimeSliceClient",
    "BusUnreachable",
    "CallbackHandler",
    "CredentialsError",
    "Grant",
    "GroupFull",
    "GroupQuarantined",
    "GroupRecord",
    "GroupState",
    "GroupStatus",
    "HandlerError",
    "HandlerResult",
    "HolderStatus",
    "InvalidId",
    "InvalidNatsUrl",
    "InvalidRequest",
    "JobFaulted",
    "JobState",
    "LeaseExpired",
    "LockLost",
    "LockOrderError",
    "NotHolder",
    "OperationFailed",
    "OperationNotFound",
    "OperationTimeout",
    "ReleaseResult",
    "SnapshotAgentClient",
    "StaleEpoch",
    "SuspendMode",
    "TimeSliceClient",
    "TimeSliceError",
    "Unavailable",
    "UnresizableStorage",
    "WaiterStatus",
    "WorkloadChannel",
    "WorkloadHandler",
    "register_workload",
]

__version__ = "0.1.0"
