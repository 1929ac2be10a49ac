"""What the client keeps of a hold: the grant and release results it returns, its own record of a hold, and
the claim a release leaves behind (see ``AsyncTimeSliceClient.acquire``)."""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

__all__ = ["Grant", "ReleaseResult"]


@dataclass(frozen=True, slots=True)
class Grant:
    """The group is yours until you release it (or your lease lapses)."""

    group_id: str
    job_id: str
    epoch: int
    waited_ms: int
    context_restored: bool


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    group_id: str
    job_id: str
    epoch: int
    pending_waiters: int
    snapshot_deferred: bool


@dataclass(frozen=True, slots=True)
class _Claim:
    """This job's release was answered with nobody waiting: its next acquire may be a claim (see ``acquire``)."""

    after_seq: int  # the release's stream sequence
    epoch: int  # the epoch the claim takes: the release's + 1


class _WaitLost(Exception):
    """The orchestrator dropped a wait because no renewal of it reached it in time (``Dequeued.lost``)."""


class _Superseded(Exception):
    """The stream refused a claim: another job input for the group came after the release."""


@dataclass(slots=True)
class _Hold:
    epoch: int
    request_id: str
    lease_ms: int
    next_renew: float  # monotonic seconds
    lost: str | None = None
    renew_ids: collections.deque[str] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=8))
