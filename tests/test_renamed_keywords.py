"""Keywords renamed for the unit convention (docs/architecture.md, "Names and units") keep their old names for one
release: the old name works, with a DeprecationWarning that names the new one; giving both is a TypeError."""

from __future__ import annotations

import warnings

import pytest
from timeslice_client._renamed import renamed_keywords
from timeslice_client._workload_options import WORKLOAD_KEYS, check_options
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
