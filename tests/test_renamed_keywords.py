"""Keywords renamed for the unit convention (docs/architecture.md, "Names and units") keep their old names for one
release: the old name works, with a DeprecationWarning that names the new one; giving both is a TypeError."""

from __future__ import annotations

import types
import warnings

import pytest
from nats.aio.client import Client as NATS
from timeslice_client import AsyncTimeSliceClient, HandlerResult, SuspendMode, TimeSliceClient, WorkloadChannel
from timeslice_client._renamed import RenamedAttribute, renamed_keywords
from timeslice_client._workload_options import WORKLOAD_KEYS, check_options
from timeslice_client.bus import connect
from timeslice_client.sglang_engine import SglangEngineHandler
from timeslice_client.vllm_engine import VllmEngineHandler

from .workers.engine_fakes import FakeDevice, FakeLLM, FakeSglangEngine


@renamed_keywords(wait="wait_s")
def _f(*, wait_s: float = 1.0) -> float:
    return wait_s


def test_an_old_keyword_still_works_with_a_warning_that_names_the_new_one_at_the_callers_line() -> None:
    with pytest.warns(DeprecationWarning, match=r"_f\(\): wait= is deprecated, use wait_s=") as caught:
        assert _f(wait=2.5) == 2.5  # type: ignore[call-arg]
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _f(wait_s=3.0) == 3.0
        assert _f() == 1.0
    with pytest.raises(TypeError, match=r"both 'wait' .* and 'wait_s'"):
        _f(wait=1.0, wait_s=2.0)  # type: ignore[call-arg]


def test_the_engine_handlers_take_lock_timeout_as_lock_timeout_s() -> None:
    with pytest.warns(DeprecationWarning, match="VllmEngineHandler\\(\\): lock_timeout= is deprecated"):
        h = VllmEngineHandler(FakeLLM(FakeDevice(10_000), "a", b"w" * 100, kv_bytes=60), lock_timeout=7.0)  # type: ignore[call-arg]
    assert h.lock_timeout_s == 7.0
    with pytest.warns(DeprecationWarning, match="SglangEngineHandler\\(\\): lock_timeout= is deprecated"):
        s = SglangEngineHandler(
            FakeSglangEngine(FakeDevice(10_000), "b", b"w" * 100, kv_bytes=60, graph_bytes=10),
            lock_timeout=8.0,  # type: ignore[call-arg]
        )
    assert s.lock_timeout_s == 8.0


async def test_the_agent_clients_take_wait_timeout_as_wait_timeout_s() -> None:
    pytest.importorskip("grpc")
    from timeslice_client.agent_client import AsyncSnapshotAgentClient, SnapshotAgentClient

    with pytest.warns(DeprecationWarning, match=r"^SnapshotAgentClient\(\): wait_timeout= is deprecated"):
        c = SnapshotAgentClient("127.0.0.1:1", wait_timeout=12.0)  # type: ignore[call-arg]
    with c:
        assert c.wait_timeout_s == 12.0
    with pytest.warns(DeprecationWarning, match=r"^AsyncSnapshotAgentClient\(\): wait_timeout= is deprecated"):
        a = AsyncSnapshotAgentClient("127.0.0.1:1", wait_timeout=13.0)  # type: ignore[call-arg]
    async with a:
        assert a.wait_timeout_s == 13.0


def test_register_workloads_old_option_names_are_moved_to_the_new_ones() -> None:
    options: dict[str, object] = {"op_timeout": 30.0, "switch_interval": None, "tags": ("weights",)}
    with pytest.warns(DeprecationWarning) as caught:
        check_options(options, WORKLOAD_KEYS, "register_workload")
    assert options == {"op_timeout_s": 30.0, "switch_interval_s": None, "tags": ("weights",)}
    assert sorted(str(w.message) for w in caught) == [
        "register_workload(): op_timeout= is deprecated, use op_timeout_s=",
        "register_workload(): switch_interval= is deprecated, use switch_interval_s=",
    ]
    with pytest.raises(TypeError, match="unexpected keyword argument 'op_timeout_ms'"):
        check_options({"op_timeout_ms": 1}, WORKLOAD_KEYS, "register_workload")


_URL = "nats://127.0.0.1:1"  # never connected to: the constructors do not connect
_CLIENT_OPTIONS = {  # old -> (new, the value given, (the attribute that keeps it, as kept))
    "lease_seconds": ("lease_s", 7.0, ("lease_ms", 7000)),
    "acquire_timeout": ("acquire_timeout_s", 11.0, ("acquire_timeout_s", 11.0)),
    "request_timeout": ("request_timeout_s", 2.5, ("request_timeout_s", 2.5)),
    "waiter_ttl_seconds": ("waiter_ttl_s", 4.0, ("waiter_ttl_ms", 4000)),
    "confirm_seconds": ("confirm_s", 1.5, ("confirm_ms", 1500)),
    "connect_timeout": ("connect_timeout_s", 3.0, ("connect_timeout_s", 3.0)),
}


@pytest.mark.parametrize("old", sorted(_CLIENT_OPTIONS))
def test_the_clients_old_constructor_options_still_work_with_a_warning_that_names_the_new_one(old: str) -> None:
    new, value, (attr, kept) = _CLIENT_OPTIONS[old]
    with pytest.warns(DeprecationWarning, match=rf"^AsyncTimeSliceClient\(\): {old}= is deprecated, use {new}=$") as w:
        a = AsyncTimeSliceClient("j", "g", _URL, **{old: value})  # type: ignore[arg-type]
    assert len(w) == 1 and w[0].filename == __file__
    assert getattr(a, attr) == kept
    with pytest.warns(DeprecationWarning, match=rf"^TimeSliceClient\(\): {old}= is deprecated, use {new}=$") as w:
        s = TimeSliceClient("j", "g", _URL, **{old: value})  # type: ignore[arg-type]
    try:
        assert len(w) == 1 and w[0].filename == __file__  # the inner client was given the new name
        assert getattr(s._client, attr) == kept
    finally:
        s.close()
    for cls in (AsyncTimeSliceClient, TimeSliceClient):
        with pytest.raises(TypeError, match=rf"^{cls.__name__}\(\) got both '{old}' \(deprecated\) and '{new}'$"):
            cls("j", "g", _URL, **{old: value, new: value})  # type: ignore[arg-type]


def test_the_clients_new_options_do_not_warn_and_the_lease_still_goes_fourth() -> None:
    new_options = {new: value for new, value, _ in _CLIENT_OPTIONS.values() if new != "lease_s"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = AsyncTimeSliceClient("j", "g", _URL, 9.0, **new_options)  # type: ignore[arg-type]
        s = TimeSliceClient("j", "g", _URL, 9.0, **new_options)  # type: ignore[arg-type]
        s.close()
    assert (a.lease_ms, a.acquire_timeout_s, a.request_timeout_s, a.connect_timeout_s) == (9000, 11.0, 2.5, 3.0)
    assert (a.waiter_ttl_ms, a.confirm_ms) == (4000, 1500)
    assert s._client.lease_ms == 9000 and s._client.request_timeout_s == 2.5


def test_the_clients_old_attribute_names_still_read_and_set_with_a_warning() -> None:
    a = AsyncTimeSliceClient("j", "g", _URL, acquire_timeout_s=11.0, request_timeout_s=2.5)
    for old, value in (("acquire_timeout", 11.0), ("request_timeout", 2.5), ("connect_timeout", 5.0)):
        match = rf"^AsyncTimeSliceClient\.{old} is deprecated, use {old}_s$"
        with pytest.warns(DeprecationWarning, match=match) as w:
            assert getattr(a, old) == value
        assert len(w) == 1 and w[0].filename == __file__
        with pytest.warns(DeprecationWarning, match=match):
            setattr(a, old, 42.0)
        assert getattr(a, f"{old}_s") == 42.0
    assert isinstance(AsyncTimeSliceClient.acquire_timeout, RenamedAttribute)  # on the class: the descriptor


def test_bus_connect_takes_connect_timeout_as_connect_timeout_s() -> None:
    with pytest.warns(
        DeprecationWarning, match=r"^connect\(\): connect_timeout= is deprecated, use connect_timeout_s=$"
    ):
        coro = connect(_URL, connect_timeout=1.5)  # **kwargs (nats-py's options) let a type checker pass it
    assert isinstance(coro, types.CoroutineType)  # not started: nothing connects
    args = coro.cr_frame.f_locals if coro.cr_frame is not None else {}
    assert args["connect_timeout_s"] == 1.5 and "connect_timeout" not in args
    coro.close()
    with pytest.raises(
        TypeError, match=r"^connect\(\) got both 'connect_timeout' \(deprecated\) and 'connect_timeout_s'$"
    ):
        _ = connect(_URL, connect_timeout=1.0, connect_timeout_s=1.0)


def test_workload_channel_takes_request_timeout_as_request_timeout_s() -> None:
    with pytest.warns(DeprecationWarning, match=r"^WorkloadChannel\(\): request_timeout= is deprecated"):
        ch = WorkloadChannel(NATS(), "j", "g", _NoHandler(), node_id="n", request_timeout=0.5)  # type: ignore[call-arg]
    assert ch.request_timeout_s == 0.5
    with pytest.warns(
        DeprecationWarning, match=r"^WorkloadChannel\.request_timeout is deprecated, use request_timeout_s$"
    ):
        assert ch.request_timeout == 0.5
    # Its older renamed attributes read on too, and say so alike.
    for old, new in (("op_timeout", "op_timeout_s"), ("switch_interval", "switch_interval_s")):
        with pytest.warns(DeprecationWarning, match=rf"^WorkloadChannel\.{old} is deprecated, use {new}$"):
            assert getattr(ch, old) == getattr(ch, new)


class _NoHandler:
    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        raise AssertionError("not called")

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        raise AssertionError("not called")
