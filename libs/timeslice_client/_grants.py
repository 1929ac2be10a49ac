"""What the client keeps of a hold: the grant and release results it returns, its own record of a hold, and
the claim a release leaves behind (see ``AsyncTimeSliceClient.acquire``)."""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass

from nats.js import JetStreamContext

from .protocol import STREAM

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
    # With the group's predictive restore on (``timeslice set-policy --predict``): the job expected to ask next,
    # whose context the orchestrator brings back while the group is idle (None: none expected).
    ahead: str | None = None


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
    """This job's hold of its group, as this client knows it.

    ``valid_until`` (monotonic seconds) is how long the client can prove its lease: the orchestrator counts a
    lease from a renewal's stream time, which comes after its send, so the send time of the last renewal the stream
    stored, plus the lease, is never later than the orchestrator's own deadline (a grant's first window, the
    confirmation window, is counted from the grant's arrival, less a margin for its way here). Past it, the hold is
    lost on this side too (``alive``), before anyone else can be granted: a client cut off from the bus cannot hear
    the ``Revoked`` that ends it."""

    epoch: int
    request_id: str
    lease_ms: int
    next_renew: float  # monotonic seconds
    valid_until: float
    lost: str | None = None
    renew_ids: collections.deque[str] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=8))
    # Until when (monotonic s) a release of this hold keeps the group for this job (its minimum hold,
    # ``Granted.min_hold_ms``, less a margin for the grant's way here): no early suspend before then.
    kept_until: float = 0.0

    @classmethod
    def granted(cls, epoch: int, request_id: str, *, lease_ms: int, confirm_ms: int, now: float) -> _Hold:
        window = min(confirm_ms, lease_ms) / 1000
        return cls(
            epoch=epoch,
            request_id=request_id,
            lease_ms=lease_ms,
            next_renew=now + window / 3,
            valid_until=now + _less_margin(window),
        )

    def renewal_stored(self, sent: float) -> None:
        """A renewal sent at ``sent`` (monotonic) was stored: the lease runs from then."""
        self.valid_until = max(self.valid_until, sent + _less_margin(self.lease_ms / 1000))

    def alive(self, now: float | None = None) -> bool:
        """Not lost; once past ``valid_until``, lost."""
        if self.lost is None and (time.monotonic() if now is None else now) >= self.valid_until:
            self.lost = (
                f"no renewal of its lease was stored for {self.lease_ms / 1000:g} s (the bus was "
                "unreachable or the process stalled)"
            )
        return self.lost is None


def _less_margin(window_s: float) -> float:
    """A lease window, less what a clock or a delivery may cost (a tenth, at most 250 ms)."""
    return window_s - min(0.25, window_s / 10)


async def _checks_claims(js: JetStreamContext) -> bool:
    """Whether the stream checks a claim exactly: a single-replica stream does. A replicated one (a NATS cluster)
    checks ``Nats-Expected-Last-Subject-Sequence`` against a wildcard filter without the writes of other subjects
    still in flight, so it can store a claim right after another job's acquire (seen in bench/chaos.py): the client
    would hold from a PubAck while the orchestrator refuses its claim. There a re-acquire goes through the
    orchestrator (docs/nats.md)."""
    try:
        info = await js.stream_info(STREAM)
    except Exception:  # no stream yet (no orchestrator ran), or it is not readable: no claims, nothing is lost
        return False
    return (info.config.num_replicas or 1) == 1
