"""Why a wait ended and why a hold was taken back are codes (``DequeueCode``, ``RevokeCode``), set by the core on
every notice; the client and the metrics decide on them, never on the words, which a job's own Cancel chooses
(issue 29: a Cancel whose reason read "timeout" was counted as a timeout). Likewise foreign errors are told by
type, not by class name, and the core's limits are the ones ``apply`` is given."""

from __future__ import annotations

import msgspec
import pytest
from timeslice_client.protocol import Cancel, DequeueCode, Dequeued, RevokeCode, Revoked
from timeslice_orchestrator.metrics import OrchestratorMetrics

from .core_sim import Sim, notices


def _dequeued(sim: Sim, actions: list) -> Dequeued:  # type: ignore[type-arg]
    (d,) = notices(actions, Dequeued)
    return d  # type: ignore[no-any-return]


def test_every_way_a_wait_ends_has_its_code() -> None:
    sim = Sim()
    sim.hold("a")
    sim.acquire("b", "b-1", timeout_ms=1000)
    d = _dequeued(sim, sim(Cancel(group=sim.group, job="b", request_id="b-1", reason="timeout")))
    assert (d.code, d.reason) == (DequeueCode.CANCELLED, "timeout")  # the job's words, not a timeout
    sim.acquire("b", "b-2", timeout_ms=1000)
    d = _dequeued(sim, sim.tick(dt=1500))
    assert d.code is DequeueCode.TIMEOUT and not d.lost
    sim.acquire("c", "c-1", timeout_ms=60_000, waiter_ttl_ms=2000)
    lost = [n for n in notices(sim.tick(dt=2100), Dequeued)]  # no renewal within its 2 s, heard on time
    assert [(n.code, n.lost) for n in lost] == [(DequeueCode.LOST, True)]


def test_a_lapsed_hold_says_whether_it_expired_or_was_never_confirmed() -> None:
    sim = Sim()
    sim.acquire("a", "a-1", lease_ms=2000, confirm_ms=1000)
    (r,) = notices(sim.tick(dt=1500), Revoked)
    assert r.code is RevokeCode.GRANT_UNCONFIRMED
    sim.hold("b")
    (r,) = notices(sim.tick(dt=60_000), Revoked)
    assert r.code is RevokeCode.LEASE_EXPIRED


def test_the_metrics_count_dequeues_by_code() -> None:
    m = OrchestratorMetrics()
    sim = Sim()
    sim.hold("a")
    sim.acquire("b", "b-1")
    old = sim.rec
    actions = sim(Cancel(group=sim.group, job="b", request_id="b-1", reason="timeout"))
    m.applied(Cancel(group=sim.group, job="b", request_id="b-1", reason="timeout"), old, sim.rec, actions, sim.now, 0.0)
    counts = m._groups[sim.group].dequeued
    assert counts["cancelled"] == 1 and counts["timeout"] == 0, counts


def test_transient_bus_errors_are_told_by_type_not_by_name() -> None:
    import nats.errors
    import nats.js.errors
    from timeslice_client._publish_rules import transient

    for exc in (
        nats.errors.NoRespondersError(),
        nats.js.errors.NoStreamResponseError(),
        nats.errors.TimeoutError(),
        nats.errors.ConnectionClosedError(),
        ConnectionResetError(),
        TimeoutError(),
    ):
        assert transient(exc), exc

    class NoRespondersError(Exception):  # a job's own error that happens to share the name
        pass

    assert not transient(NoRespondersError()) and not transient(ValueError("no"))


def test_the_cores_limits_are_injected_not_global() -> None:
    """``apply(..., limits=...)`` holds the record to the limits it is given (issue 29: handlers read the global)."""
    from timeslice_client.protocol import Acquire, ErrorCode, Refused
    from timeslice_orchestrator.core import LIMITS, Limits, apply, new_record

    tight = Limits(max_queue=1)
    rec = new_record("g")
    outcomes = []
    for seq, job in enumerate(("a", "b", "c"), start=1):
        rec, actions = apply(rec, Acquire(group="g", job=job, request_id=f"{job}-1"), 1_000 + seq, seq, tight)
        outcomes.append([n.code for n in notices(actions, Refused)])
    assert outcomes == [[], [], [ErrorCode.QUEUE_FULL]]  # a holds, b waits, c finds the queue of one full
    assert len(rec.queue) == 1 and LIMITS.max_queue > 1  # the defaults are untouched
    short = Acquire(group="g", job="a", request_id="a-1", lease_ms=500)
    _, actions = apply(new_record("g"), short, 1, 1)  # the defaults: a lease of at least 1 s
    assert [n.code for n in notices(actions, Refused)] == [ErrorCode.INVALID]
    _, actions = apply(new_record("g"), short, 1, 1, Limits(min_lease_ms=100))
    assert not notices(actions, Refused)


@pytest.mark.parametrize("kind", ["dequeued", "revoked"])
def test_a_notice_with_a_code_this_client_does_not_know_is_read_without_it(kind: str) -> None:
    """A newer orchestrator may add a code: today's client reads that notice as one without a code (None, as
    from an orchestrator older than the codes) instead of refusing the whole notice and missing the dequeue."""
    from timeslice_client.protocol import Dequeued, Revoked, decode_notice

    fields = {"dequeued": '"request_id":"r","reason":"a reason"', "revoked": '"epoch":3,"reason":"a reason"'}[kind]
    data = f'{{"type":"{kind}","group":"g","job":"j",{fields},"code":"added_later"}}'.encode()
    n = decode_notice(data)
    assert isinstance(n, Dequeued if kind == "dequeued" else Revoked) and n.code is None and n.reason == "a reason"
    with pytest.raises(msgspec.ValidationError):  # anything else wrong still refuses it
        decode_notice(data.replace(b'"group":"g"', b'"group":7'))
