"""The client's error for each refusal code the orchestrator sends (``Refused.code``)."""

from __future__ import annotations

from .errors import (
    GroupFull,
    GroupQuarantined,
    InvalidRequest,
    JobFaulted,
    NotHolder,
    StaleEpoch,
    TimeSliceError,
)
from .protocol import ErrorCode, Refused

__all__ = ["refusal_error"]


def refusal_error(n: Refused, your_epoch: int | None) -> TimeSliceError:
    """``your_epoch``: the epoch this client believes it holds (None: none)."""
    if n.code is ErrorCode.NOT_HOLDER:
        return NotHolder(n.group, n.job, n.holder, n.epoch, your_epoch)
    if n.code is ErrorCode.STALE_EPOCH:
        return StaleEpoch(n.group, n.job, n.holder, n.epoch, your_epoch)
    if n.code is ErrorCode.JOB_FAULTED:
        return JobFaulted(n.group, n.job, n.message)
    if n.code is ErrorCode.QUEUE_FULL:
        return GroupFull(n.group, n.job, n.limit)
    if n.code is ErrorCode.QUARANTINED:
        return GroupQuarantined(n.group, n.message)
    return InvalidRequest(n.message, group_id=n.group, job_id=n.job)
