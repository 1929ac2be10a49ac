"""What the orchestrator's gRPC shim answers, apart from how it serves: a group's record as the API's
``GroupStatus``, the agents' states of the group's jobs, and the status code a client error becomes.

Pure translations between the bus's facts (``GroupRecord``, KV ``jobs``, ``timeslice_client.errors``) and the
published proto, kept out of ``grpc_shim`` so that the shim reads as the calls it serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import msgspec
from google.protobuf.timestamp_pb2 import Timestamp
from nats.js.kv import KeyValue
from timeslice_client._grpc import timeslice_orchestrator_pb2 as pb
from timeslice_client.errors import (
    AcquireCancelled,
    AcquireTimeout,
    InvalidId,
    InvalidRequest,
    JobFaulted,
    LockLost,
    TimeSliceError,
    Unavailable,
)
from timeslice_client.protocol import GroupRecord, GroupState, JobContext, JobState

__all__ = ["agent_states", "group_status", "status_code"]

_GROUP_STATES = {
    GroupState.IDLE: pb.GroupStatus.STATE_IDLE,
    GroupState.IDLE_YIELDED: pb.GroupStatus.STATE_IDLE_YIELDED,
    GroupState.LOCKED: pb.GroupStatus.STATE_LOCKED,
    GroupState.SWITCHING: pb.GroupStatus.STATE_SWITCHING,
}
_JOB_STATES = {
    JobState.IDLE: pb.SnapshotAgentJobState.STATE_IDLE,
    JobState.RUNNING: pb.SnapshotAgentJobState.STATE_RUNNING,
    JobState.TRANSITIONING: pb.SnapshotAgentJobState.STATE_TRANSITIONING,
    JobState.SAVED: pb.SnapshotAgentJobState.STATE_SAVED,
    JobState.FAULTED: pb.SnapshotAgentJobState.STATE_FAULTED,
}
_ctx_decoder = msgspec.json.Decoder(JobContext)


def group_status(rec: GroupRecord) -> pb.GroupStatus:
    """The API's view of a group's record."""
    loaded = set(rec.loaded.values())
    waiting = len(rec.queue) + (1 if rec.switch is not None and rec.switch.to is not None else 0)
    status = pb.GroupStatus(
        group_id=rec.group,
        group_state=_GROUP_STATES.get(rec.state, pb.GroupStatus.STATE_UNKNOWN),
        locking_job=rec.holder.job if rec.holder else "",
        active_job=rec.active_job or "",
        waiter_queue_depth=waiting,
        loaded_job=loaded.pop() if len(loaded) == 1 else "",
    )
    if rec.since_ms:
        status.state_timestamp.CopyFrom(Timestamp(seconds=rec.since_ms // 1000, nanos=rec.since_ms % 1000 * 1_000_000))
    return status


async def agent_states(rec: GroupRecord, jobs_kv: Callable[[], Awaitable[KeyValue]]) -> list[pb.SnapshotAgentJobState]:
    """The agents' states of the jobs placed or loaded in ``rec`` (KV ``jobs``, opened by ``jobs_kv`` when there are
    any); a job unregistered meanwhile is left out."""
    keys = sorted(
        {(node, job) for job, nodes in rec.placements.items() for node in nodes}
        | {(node, job) for node, job in rec.loaded.items()}
    )
    if not keys:
        return []
    kv = await jobs_kv()

    async def one(node: str, job: str) -> pb.SnapshotAgentJobState | None:
        try:
            entry = await kv.get(f"{node}.{job}")
        except Exception:  # gone (unregistered) meanwhile
            return None
        if not entry.value:
            return None
        ctx = _ctx_decoder.decode(entry.value)
        return pb.SnapshotAgentJobState(agent=node, job_state=_JOB_STATES[ctx.state], job_id=job)

    found = await asyncio.gather(*(one(n, j) for n, j in keys))
    return [s for s in found if s is not None]


def status_code(exc: TimeSliceError) -> grpc.StatusCode:
    """The gRPC status a client error becomes (INTERNAL: one the API has no code for)."""
    code = grpc.StatusCode.INTERNAL
    if isinstance(exc, InvalidId | InvalidRequest):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(exc, Unavailable):
        code = grpc.StatusCode.UNAVAILABLE
    elif isinstance(exc, AcquireTimeout):
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    elif isinstance(exc, AcquireCancelled):
        code = grpc.StatusCode.ABORTED
    elif isinstance(exc, JobFaulted):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, LockLost):
        code = grpc.StatusCode.PERMISSION_DENIED
    return code
