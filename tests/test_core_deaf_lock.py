"""The pure core's rule for a lock that could not hear (``Limits.deaf_after_ms``): a waiter's liveness deadline that
is checked well after it passed was not checked on time, because nothing reached the stream meanwhile (a NATS
cluster electing its stream's leader for seconds, or no orchestrator publishing ticks), so the waiter's renewals of
that time may have failed to be stored: it gets one fresh window instead of being dropped. A waiter that really is
gone is dropped at the end of that window, by a check that comes on time."""

from __future__ import annotations

from timeslice_client.protocol import Dequeued, Granted, Renew
from timeslice_orchestrator.core import LIMITS, next_deadline

from .core_sim import G, Sim, notices

TTL = 5_000


def _waiting() -> Sim:
    sim = Sim()
    sim.hold("a")
    sim.acquire("b", "b-w", waiter_ttl_ms=TTL, timeout_ms=600_000)
    sim.acquire("c", "c-w", waiter_ttl_ms=TTL, timeout_ms=600_000)
    return sim


def test_a_wait_whose_renewals_could_not_be_stored_is_kept_through_an_election() -> None:
    """Nothing is stored for 8 s (an election: longer than the waiter TTL). The first event after it, the holder's
    renewal, finds both waits past their liveness deadline by ~3 s: they were not heard, not silent. They stay, in
    their order, and b is granted at a's release."""
    sim = _waiting()
    actions = sim.renew("a", dt=8_000)
    assert not notices(actions, Dequeued), notices(actions, Dequeued)
    assert [w.job for w in sim.rec.queue] == ["b", "c"]
    sim(Renew(group=G, job="b", request_id="b-w"), dt=400)  # the waiters' retried renewals land right after
    sim(Renew(group=G, job="c", request_id="c-w"), dt=100)
    (g,) = notices(sim.release("a", dt=100), Granted)
    assert g.job == "b"


def test_a_wait_that_is_really_gone_is_dropped_one_window_later() -> None:
    """b died during the outage: its fresh window ends at an on-time tick, and the group moves on to c."""
    sim = _waiting()
    sim.tick(dt=8_000)  # the orchestrator's tick, retried through the outage, is the first event stored after it
    assert [w.job for w in sim.rec.queue] == ["b", "c"]
    sim(Renew(group=G, job="c", request_id="c-w"), dt=300)  # c is alive; b is not
    due = next_deadline(sim.rec)
    assert due is not None
    actions = sim.tick(dt=due - sim.now)  # on time
    (d,) = notices(actions, Dequeued)
    assert d.job == "b" and d.lost
    assert [w.job for w in sim.rec.queue] == ["c"]


def test_a_check_on_time_drops_a_silent_wait_as_before() -> None:
    """The rule forgives only lateness: a tick a moment after the deadline (a healthy stream) drops the wait."""
    sim = _waiting()
    sim(Renew(group=G, job="c", request_id="c-w"), dt=TTL - 100)
    actions = sim.tick(dt=100 + LIMITS.deaf_after_ms // 2)
    assert [n.job for n in notices(actions, Dequeued)] == ["b"]


def test_only_one_fresh_window_without_a_renewal() -> None:
    """Checks that keep coming late (a lock that keeps failing to hear) give a silent waiter one fresh window, not
    one per late check: a dead waiter cannot hold up the group for more than a TTL beyond its own."""
    sim = _waiting()
    sim.renew("a", dt=8_000)
    actions = sim.renew("a", dt=TTL + LIMITS.deaf_after_ms + 1_000)  # late again, and no renewal of b or c between
    assert sorted(n.job for n in notices(actions, Dequeued)) == ["b", "c"]
    assert not sim.rec.queue
