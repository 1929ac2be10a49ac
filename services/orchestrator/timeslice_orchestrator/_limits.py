"""The core's bounds on what inputs can put into a record, and its timings (``Limits``; ``LIMITS``, the defaults the
orchestrator runs with). Private to the core: ``core`` exports them."""

from __future__ import annotations

import msgspec

__all__ = ["LIMITS", "Limits"]


class Limits(msgspec.Struct, frozen=True):
    """Bounds on what inputs can put into a record. Requests with durations outside them are refused as INVALID;
    an acquire past ``max_queue`` waiters is refused as QUEUE_FULL; registrations past ``max_placements``
    (job, node) pairs are not recorded. With the wire types' own bounds on every field (``protocol``), a record at
    every one of these limits at once stays far below NATS's 1 MiB payload limit (``tests/test_input_bounds.py``
    builds that record): a record the orchestrator cannot store would stop its group."""

    min_lease_ms: int = 1_000
    max_lease_ms: int = 24 * 3600 * 1000
    min_ttl_ms: int = 300
    max_ttl_ms: int = 600_000
    max_timeout_ms: int = 7 * 24 * 3600 * 1000
    max_queue: int = 512
    max_placements: int = 256  # (job, node) pairs a group records, and so at most this many faulted jobs
    max_lost_nodes: int = 64
    max_reason: int = 256  # characters of a fault reason kept in the record
    resend_ms: int = 3_000  # an agent command still unanswered goes out again this often (see OpRecord)
    max_grant_resends: int = 3  # an unconfirmed grant is sent again (and kept up) on this many wait renewals at most
    # A wait's liveness deadline checked more than this long after it passed was not checked on time: nothing reached
    # the stream meanwhile (an election of its leader, no orchestrator to publish ticks), so its renewals may have
    # been lost with everything else. It gets one fresh window rather than being dropped (``WaiterRecord.forgiven``).
    deaf_after_ms: int = 1_000
    # A waiter's priority class rises by one for each this long it has waited (``_next_waiter``): a waiter of class 0
    # overtakes newer ones of class 9 after 9 of these.
    priority_ageing_ms: int = 60_000
    max_cycles: int = 64  # jobs whose recent cycle a group keeps for the predictive restore (``_predict``)
    # Fair share (``_fair_share``): a job's recent held time halves every this long (in eighths of it), and a group
    # keeps it for this many jobs at most (past that, the one with the least is forgotten: it counts as none).
    usage_half_life_ms: int = 600_000
    max_usage_jobs: int = 128


LIMITS = Limits()
