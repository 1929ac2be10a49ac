"""The codes the wire carries: group states, refusal codes, operation kinds, job states, suspend modes (re-exported
by :mod:`timeslice_client.protocol`, where the messages that carry them are described). Decisions are keyed on
these, never on message text."""

from __future__ import annotations

import enum

__all__ = ["DequeueCode", "ErrorCode", "GroupState", "JobState", "OpKind", "RevokeCode", "SuspendMode"]


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


class DequeueCode(enum.StrEnum):
    """Why a wait ended without a grant (``Dequeued.code``); ``Dequeued.reason`` says it in words."""

    CANCELLED = "cancelled"  # the job withdrew it (Cancel; its own words in the reason)
    TIMEOUT = "timeout"  # the acquire's deadline passed
    LOST = "lost"  # no renewal reached the orchestrator in time: the waiter died, or the bus was away
    FAULTED = "faulted"  # the job was faulted while it waited
    RELEASED_BEFORE_GRANT = "released_before_grant"  # the job released the group it was about to be granted
    NOT_WAITING = "not_waiting"  # a renewal or release of a wait the orchestrator does not know: ask again


class RevokeCode(enum.StrEnum):
    """Why a hold was taken back (``Revoked.code``); ``Revoked.reason`` says it in words."""

    LEASE_EXPIRED = "lease_expired"  # the holder's renewals stopped
    GRANT_UNCONFIRMED = "grant_unconfirmed"  # the grantee never confirmed its grant in time
    CLAIM_REFUSED = "claim_refused"  # a claimed re-acquire the core could not honour
