"""The codes the wire carries: group states, refusal codes, operation kinds, job states, suspend modes (re-exported
by :mod:`timeslice_client.protocol`, where the messages that carry them are described). Decisions are keyed on
these, never on message text."""

from __future__ import annotations

import enum

__all__ = ["ErrorCode", "GroupState", "JobState", "OpKind", "SuspendMode"]


class GroupState(enum.StrEnum):
    IDLE = "IDLE"
    IDLE_YIELDED = "IDLE_YIELDED"
    LOCKED = "LOCKED"
    SWITCHING = "SWITCHING"


class ErrorCode(enum.StrEnum):
    """Stable refusal codes, shared by orchestrator and clients."""

    NOT_HOLDER = "NOT_HOLDER"
    STALE_EPOCH = "STALE_EPOCH"
    JOB_FAULTED = "JOB_FAULTED"
    INVALID = "INVALID"
    QUEUE_FULL = "QUEUE_FULL"  # the group has ``Limits.max_queue`` waiters already
    QUARANTINED = "QUARANTINED"  # the group's record is unusable; the orchestrator serves every other group


class OpKind(enum.StrEnum):
    SNAPSHOT = "snapshot"
    RESTORE = "restore"


class JobState(enum.StrEnum):
    """A job's context on one node (the agent's state machine)."""

    IDLE = "IDLE"  # registered, never granted
    RUNNING = "RUNNING"
    TRANSITIONING = "TRANSITIONING"
    SAVED = "SAVED"
    FAULTED = "FAULTED"


class SuspendMode(enum.StrEnum):
    OFFLOAD = "offload"  # keep the state in host memory
    DISCARD = "discard"  # drop it; the workload rebuilds it
