"""The timing of the orchestrator lease (``Leadership``): its TTL, how often it is renewed, the safety margin and the
timeout of each write or read of the key. Checked together where they are made, because they only work together: a
renewal period that does not fit in the validity window lets the lease lapse between renewals."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import LeadershipError

__all__ = ["LeaseTiming"]


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """``ttl_s``: the key's per-message TTL (the server takes whole seconds); ``renew_s``: the period of renewals;
    ``margin_s``: how long before the TTL runs out this instance stops counting itself the leader; ``op_timeout_s``:
    one write or read of the key."""

    ttl_s: int = 1
    renew_s: float = 0.25
    margin_s: float = 0.2
    op_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        ttl_s, renew_s, margin_s = self.ttl_s, self.renew_s, self.margin_s
        if int(ttl_s) != ttl_s or ttl_s < 1:
            raise LeadershipError(f"ttl_s={ttl_s}: the server takes whole seconds, at least 1; pass 1, 2, ...")
        if not 0 < margin_s < ttl_s:
            raise LeadershipError(f"margin_s={margin_s} must be in (0, ttl_s={ttl_s})")
        if not 0 < renew_s < ttl_s - margin_s:
            raise LeadershipError(
                f"renew_s={renew_s} must be in (0, ttl_s - margin_s = {ttl_s - margin_s}): "
                "the lease would lapse between renewals"
            )
        object.__setattr__(self, "ttl_s", int(ttl_s))  # (a whole float such as 2.0 is taken as 2)

    def valid_until(self, sent: float) -> float:
        """The end of the validity window of a write sent at ``sent`` (``clock``): the server stores it no earlier
        than it was sent and expires it ``ttl_s`` after, so nobody else can win before then, less the margin."""
        return sent + self.ttl_s - self.margin_s
