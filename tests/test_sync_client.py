"""The blocking facade, against the orchestrator running as a real process."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable

import pytest
from timeslice_client import AsyncTimeSliceClient, TimeSliceClient
from timeslice_client._channel_thread import Responder

from .helpers import eventually_sync, group_record_sync
from .tcp_proxy import TcpProxy

pytestmark = pytest.mark.usefixtures("orchestrator_process")


def test_sync_client_round_trip(nats_url: str) -> None:
    with TimeSliceClient("a", "g10", nats_url) as a, TimeSliceClient("b", "g10", nats_url) as b:
        calls: list[int] = []

        @a.on_accelerators(timeout=10)
        def step(i: int) -> None:
            assert a.holding
            calls.append(i)

        step(1)
        step(2)
        assert calls == [1, 2]
        with b.on_accelerators(timeout=10) as g:
            assert g.epoch == 3
            eventually_sync(lambda: (h := group_record_sync(a).holder) is not None and h.job == "b")
        eventually_sync(lambda: group_record_sync(b).active_job == "b" and group_record_sync(b).holder is None)
        assert "g10" in a.list_groups()


def test_sync_client_says_when_another_job_waits(nats_url: str) -> None:
    """``contended``: the orchestrator's word that another job waits (and the cue for an early suspend)."""
    with TimeSliceClient("a", "g11", nats_url) as a, TimeSliceClient("b", "g11", nats_url) as b:
        a.acquire(timeout=10)
        assert a.holding and not a.contended
        got: list[int] = []
        waiter = threading.Thread(target=lambda: got.append(b.acquire(timeout=20).epoch))
        waiter.start()
        eventually_sync(lambda: a.contended, what="a is told that b waits")
        a.release()
        assert not a.contended
        waiter.join(20)
        assert got == [2] and not b.contended
        b.release()


def test_sync_client_spells_out_the_async_clients_options() -> None:
    """Every option of AsyncTimeSliceClient (but ``nc``, a connection of another loop) with the same default, no
    ``**kwargs``; and a docstring on every public method and property."""
    sync = inspect.signature(TimeSliceClient.__init__).parameters
    want = {k: p for k, p in inspect.signature(AsyncTimeSliceClient.__init__).parameters.items() if k != "nc"}
    assert [(k, p.kind, p.default) for k, p in sync.items()] == [(k, p.kind, p.default) for k, p in want.items()]
    sync_reg = inspect.signature(TimeSliceClient.register_workload).parameters
    async_reg = inspect.signature(AsyncTimeSliceClient.register_workload).parameters
    assert [(k, p.default) for k, p in sync_reg.items()] == [(k, p.default) for k, p in async_reg.items()]
    public = [(n, v) for n, v in vars(TimeSliceClient).items() if not n.startswith("_")]
    assert public and not [n for n, v in public if not inspect.getdoc(v)], "public members without a docstring"


def test_calls_from_another_thread_run_while_one_waits(nats_url: str) -> None:
    """One thread blocked in acquire() runs the client's loop; another thread's calls on the same client are
    served meanwhile (on that loop), and a release from a third client grants the waiter."""
    with TimeSliceClient("a", "g12", nats_url) as a, TimeSliceClient("b", "g12", nats_url) as b:
        a.acquire(timeout=10)
        got: list[int] = []
        waiter = threading.Thread(target=lambda: got.append(b.acquire(timeout=20).epoch))
        waiter.start()
        eventually_sync(lambda: [w.job for w in group_record_sync(b).queue] == ["b"], what="b waits (asked through b)")
        assert b.list_groups() and not b.holding
        a.release()
        waiter.join(20)
        assert got == [2] and b.holding
        b.release()


def _lease_renewed(obs: TimeSliceClient, group: str, *, past_ms: int, what: str) -> None:
    """Wait (10 s at most) until the record of ``group``, read through ``obs``, shows its holder's lease deadline at
    ``past_ms`` or later: renewed on the client's own thread, no call made on it."""
    eventually_sync(
        lambda: (h := group_record_sync(obs, group).holder) is not None and h.lease_deadline_ms >= past_ms,
        timeout=10,
        what=f"{what}, renewed in the background",
    )


def test_the_hold_is_renewed_between_calls(nats_url: str) -> None:
    """Between calls (the job trains) the client's own thread renews the lease: held for several leases without a
    call on the client, the group stays this job's."""
    with (
        TimeSliceClient("a", "g13", nats_url, lease_s=1.0) as a,
        TimeSliceClient("observer", "observer", nats_url) as obs,
    ):
        g = a.acquire(timeout=10)
        # the record is stored a moment after the grant goes out
        first = eventually_sync(
            lambda: group_record_sync(obs, "g13").holder, timeout=10, what="the record names the holder"
        )
        assert first.job == "a"
        _lease_renewed(obs, "g13", past_ms=first.lease_deadline_ms + 3000, what="three more seconds of lease")
        assert a.holding and a.epoch == g.epoch
        a.release()


def test_a_connection_cut_between_calls_is_mended_by_the_clients_thread(nats_url: str) -> None:
    """Cut off while it trains (no call on it), the client reconnects and renews its hold on its own thread."""
    proxy_loop = Responder("proxy", fast=False)
    proxy_loop.start()

    def on_proxy_loop(fn: Callable[[], None]) -> None:
        async def call() -> None:
            fn()

        proxy_loop.submit(call()).result(10)

    proxy = proxy_loop.submit(TcpProxy(nats_url).start()).result(10)
    try:
        with (
            TimeSliceClient("a", "g14", proxy.url, lease_s=4.0) as a,
            TimeSliceClient("observer", "observer", nats_url) as obs,
        ):
            g = a.acquire(timeout=10)
            nc = a._client._nc
            assert nc is not None
            on_proxy_loop(proxy.cut)
            eventually_sync(lambda: not nc.is_connected, what="a's connection is cut")
            on_proxy_loop(proxy.restore)
            eventually_sync(lambda: nc.is_connected, timeout=15, what="a reconnected without a call made on it")
            h0 = group_record_sync(obs, "g14").holder
            assert h0 is not None and h0.job == "a"
            _lease_renewed(obs, "g14", past_ms=h0.lease_deadline_ms + 1000, what="a's lease after the reconnect")
            assert a.holding and a.epoch == g.epoch
            a.release()
            assert a.acquire(timeout=10).epoch == g.epoch + 1
            a.release()
    finally:
        proxy_loop.submit(proxy.close()).result(10)
        proxy_loop.stop_blocking(10)
