"""The pure core's rules for grant notices that may be lost (notices are at most once): what a grantee's renewals of
its wait keep up, and for how long (``Limits.max_grant_resends``)."""

from __future__ import annotations

from timeslice_client.protocol import Granted, Renew
from timeslice_orchestrator.core import LIMITS

from .core_sim import G, Sim, notices


def test_an_unconfirmed_grant_kept_up_by_wait_renewals_passes_on_after_a_few_resends() -> None:
    """A grantee that keeps renewing its wait but never confirms its grant (it can publish but does not hear: a
    one-way network fault, a client whose notice subscription is gone) is sent its grant again a few times
    (``Limits.max_grant_resends``), each renewal keeping the grant alive; after that its renewals no longer do, and
    the grant passes on at its deadline: the group does not wait for the grantee's acquire timeout."""
    sim = Sim()
    sim.hold("a")
    sim.acquire("b", "b-w", waiter_ttl_ms=5_000, confirm_ms=3_000, timeout_ms=600_000)
    sim.acquire("c", "c-w", waiter_ttl_ms=600_000, timeout_ms=600_000)
    (g,) = notices(sim.release("a"), Granted)
    assert g.job == "b"
    resent, granted_c, t = 0, None, 0
    while granted_c is None and t < 60_000:
        t += 1_500  # b renews its wait every 1.5 s (a third of its waiter TTL, as the client does), and hears nothing
        actions = sim(Renew(group=G, job="b", request_id="b-w"), dt=1_500)
        resent += sum(n.job == "b" for n in notices(actions, Granted))
        granted_c = next((n for n in notices(actions, Granted) if n.job == "c"), None)
    assert granted_c is not None, f"c never granted in {t} ms of b's renewals ({resent} grants re-sent to b)"
    assert 1 <= resent <= LIMITS.max_grant_resends
    assert t <= (LIMITS.max_grant_resends + 1) * 1_500 + 5_000, t  # the resends, then one waiter TTL at most
