"""The in-process vLLM and SGLang handlers (``timeslice_client.vllm_engine``, ``sglang_engine``) against fake engines
with the real ones' sleep APIs and misuse answers (``tests/workers/engine_fakes.py``): every mode and tag mapping,
the wake order, idempotence, errors and rollback, the lock; and two jobs handing a group back and forth through the
real orchestrator and agent, one engine awake at a time, each coming back with its own weights."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest
from timeslice_agent import Agent, AgentConfig
from timeslice_client import AsyncTimeSliceClient, HandlerError, SuspendMode
from timeslice_client.sglang_engine import SGLANG_MEMORY_TAGS, SglangEngineHandler
from timeslice_client.vllm_engine import (
    EngineCallFailed,
    EngineNotSleepable,
    MissingEngineMethod,
    NoWeightReload,
    VllmEngineHandler,
)
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .helpers import eventually, group_record, running
from .workers.engine_fakes import FakeCudaOOM, FakeDevice, FakeLLM, FakeSglangEngine, SchedulerExited, checksum

OFFLOAD, DISCARD = SuspendMode.OFFLOAD, SuspendMode.DISCARD
ALL: frozenset[str] = frozenset()
W, KV = 1000, 600  # weights and KV cache bytes of the fake engines
NODE = "node-1"


def _weights(seed: int, n: int = W) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(n))


def _llm(device: FakeDevice | None = None, **kw: object) -> FakeLLM:
    return FakeLLM(device or FakeDevice(10 * W), "a", _weights(1), kv_bytes=KV, **kw)  # type: ignore[arg-type]


def _sgl(device: FakeDevice | None = None, **kw: object) -> FakeSglangEngine:
    return FakeSglangEngine(device or FakeDevice(10 * W), "b", _weights(2), kv_bytes=KV, graph_bytes=100, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- vLLM


def test_vllm_offload_sleeps_level_1_and_wakes_the_weights_before_the_kv_cache() -> None:
    llm = _llm()
    h = VllmEngineHandler(llm, device_bytes=lambda: llm.device.bytes_of("a"))
    before = llm.weights_checksum
    r = h.suspend(OFFLOAD, ALL)
    assert llm.calls == ["sleep(level=1)"] and llm.prefix_cache_resets == 1
    assert llm.where() == {"weights": "host", "kv_cache": "dropped"} and llm.device.bytes_of("a") == 0
    assert (r.bytes_moved, r.device_bytes_freed) == (0, W + KV)
    assert h.asleep_tags == {"weights", "kv_cache"} and not h.awake
    with pytest.raises(RuntimeError, match="illegal memory access"):
        llm.generate("hi")
    r = h.resume(OFFLOAD, ALL)
    assert llm.calls[1:] == ["wake_up(tags=['weights'])", "wake_up(tags=['kv_cache'])"]
    assert r.device_bytes_freed == W + KV and h.awake and not llm.llm_engine.is_sleeping()
    assert llm.weights_checksum == before and llm.generate("hi") == [f"{before}:hi"]
    assert llm.warnings == []


def test_vllm_discard_sleeps_level_2_and_reloads_between_waking_the_weights_and_the_kv_cache() -> None:
    llm = _llm()
    llm.collective_rpc("update_weights", kwargs={"update_info": {"weights": _weights(7)}})
    llm.calls.clear()
    h = VllmEngineHandler(llm, reload_weights=lambda: llm.collective_rpc("reload_weights"))
    h.suspend(DISCARD, frozenset({"weights", "kv_cache"}))
    assert llm.calls == ["sleep(level=2)"] and llm.where() == {"weights": "dropped", "kv_cache": "dropped"}
    h.resume(DISCARD, ALL)
    assert llm.calls[1:] == [
        "wake_up(tags=['weights'])",
        "collective_rpc(reload_weights)",
        "wake_up(tags=['kv_cache'])",
    ]
    assert llm.weights_checksum == checksum(_weights(1)), "reloaded from the checkpoint it was made from"
    assert h.awake and not llm.llm_engine.is_sleeping()


def test_the_wake_order_keeps_the_kv_cache_out_of_the_weight_reloads_peak() -> None:
    # Room for the weights and either the reload's staging buffer or the KV cache, not all three.
    device = FakeDevice(2 * W + 10)
    naive = FakeLLM(device, "naive", _weights(3), kv_bytes=W, reload_staging=True)
    naive.sleep(level=2)
    naive.wake_up()  # everything at once, then the reload: what vLLM's docs warn against
    with pytest.raises(FakeCudaOOM):
        naive.collective_rpc("reload_weights")
    naive.sleep(level=2)
    llm = FakeLLM(device, "a", _weights(3), kv_bytes=W, reload_staging=True)
    h = VllmEngineHandler(llm, reload_weights=lambda: llm.collective_rpc("reload_weights"))
    h.suspend(DISCARD, ALL)
    device.peak = 0
    h.resume(DISCARD, ALL)
    assert device.peak == 2 * W and llm.weights_checksum == checksum(_weights(3))


def test_vllm_discard_without_a_reload_hook_is_refused_before_the_engine_is_touched() -> None:
    llm = _llm()
    h = VllmEngineHandler(llm)
    with pytest.raises(NoWeightReload, match="reload_weights") as err:
        h.suspend(DISCARD, ALL)
    assert isinstance(err.value, HandlerError) and err.value.tag == "weights"
    assert llm.calls == [] and h.awake and llm.generate("x")
    h.suspend(OFFLOAD, ALL)  # offload needs none
    assert llm.calls == ["sleep(level=1)"]


def test_vllm_repeated_suspends_and_resumes_do_nothing() -> None:
    llm = _llm()
    h = VllmEngineHandler(llm)
    assert h.resume(OFFLOAD, ALL).device_bytes_freed == 0 and llm.calls == []  # awake already
    h.suspend(OFFLOAD, ALL)
    assert h.suspend(OFFLOAD, ALL).device_bytes_freed == 0 and h.suspend(DISCARD, ALL).device_bytes_freed == 0
    h.resume(OFFLOAD, ALL)
    h.resume(OFFLOAD, ALL)
    assert llm.calls == ["sleep(level=1)", "wake_up(tags=['weights'])", "wake_up(tags=['kv_cache'])"]
    assert llm.warnings == [] and h.awake


def test_vllm_takes_the_whole_engine_or_nothing_and_names_unknown_tags() -> None:
    llm = _llm()
    h = VllmEngineHandler(llm)
    with pytest.raises(HandlerError, match=r"whole engine.*\['kv_cache'\]"):
        h.suspend(OFFLOAD, frozenset({"kv_cache"}))
    with pytest.raises(HandlerError, match=r"unknown tags \['optimizer'\]") as err:
        h.suspend(OFFLOAD, frozenset({"optimizer", "weights"}))
    assert err.value.tag == "optimizer"
    with pytest.raises(HandlerError, match="unknown suspend mode 'hibernate'"):
        h.suspend("hibernate", ALL)  # type: ignore[arg-type]
    assert llm.calls == []
    h.suspend("offload", ALL)  # type: ignore[arg-type]  # a plain string works too
    with pytest.raises(HandlerError, match="unknown tags"):
        h.resume(OFFLOAD, frozenset({"kv"}))
    assert h.asleep_tags == {"weights", "kv_cache"}


def test_a_resume_of_one_tag_wakes_it_alone_and_the_rest_later() -> None:
    llm = _llm()
    h = VllmEngineHandler(llm, reload_weights=lambda: llm.collective_rpc("reload_weights"))
    h.suspend(DISCARD, ALL)
    h.resume(DISCARD, frozenset({"weights"}))  # e.g. an RLHF weight update before the KV cache comes back
    assert llm.calls[1:] == ["wake_up(tags=['weights'])", "collective_rpc(reload_weights)"]
    assert h.asleep_tags == {"kv_cache"} and llm.llm_engine.is_sleeping()
    with pytest.raises(HandlerError, match="partly awake"):
        h.suspend(OFFLOAD, ALL)  # LLM.sleep would be "already sleeping" and leave the weights on the device
    h.resume(DISCARD, frozenset({"kv_cache"}))
    assert llm.calls[3:] == ["wake_up(tags=['kv_cache'])"] and h.awake
    assert llm.weights_checksum == checksum(_weights(1))


def test_an_object_that_is_not_a_sleepable_engine_is_refused_when_the_handler_is_made() -> None:
    with pytest.raises(MissingEngineMethod, match=r"'object' object given as a vLLM LLM has no callable sleep\(\)"):
        VllmEngineHandler(object())

    class HalfLLM:
        def sleep(self, level: int = 1) -> None: ...

    with pytest.raises(MissingEngineMethod, match=r"wake_up\(\)") as err:
        VllmEngineHandler(HalfLLM())
    assert isinstance(err.value, TypeError) and err.value.method == "wake_up"
    with pytest.raises(EngineNotSleepable, match="enable_sleep_mode=True"):
        VllmEngineHandler(_llm(enable_sleep_mode=False))
    with pytest.raises(TypeError, match="reload_weights must be callable"):
        VllmEngineHandler(_llm(), reload_weights="reload")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lock_timeout"):
        VllmEngineHandler(_llm(), lock_timeout_s=0)


def test_an_engine_error_fails_the_suspend_with_its_words_bounded_and_the_engine_left_awake() -> None:
    llm = _llm()
    h = VllmEngineHandler(llm)
    llm.fail("sleep", RuntimeError("NCCL error: " + "x" * 5000))
    with pytest.raises(EngineCallFailed) as err:
        h.suspend(OFFLOAD, ALL)
    e = err.value
    assert isinstance(e, HandlerError) and isinstance(e.__cause__, RuntimeError)
    assert e.call == "LLM.sleep(level=1)" and e.reason.startswith("RuntimeError: NCCL error: xxx")
    assert len(e.reason) <= 200 and len(str(e)) < 400 and e.rolled_back
    assert "reports it is awake; nothing changed" in str(e)
    assert h.awake and llm.generate("x"), "the job runs on"
    h.suspend(OFFLOAD, ALL)  # and the next switch works
    assert h.asleep_tags == {"weights", "kv_cache"}


def test_a_sleep_that_raised_after_the_engine_went_to_sleep_is_woken_again() -> None:
    llm = _llm()
    before = llm.weights_checksum
    h = VllmEngineHandler(llm)
    llm.fail("sleep", RuntimeError("worker 1 timed out"), after=True)
    with pytest.raises(EngineCallFailed, match="went to sleep anyway; woke it again") as err:
        h.suspend(OFFLOAD, ALL)
    assert err.value.rolled_back and h.awake and not llm.llm_engine.is_sleeping()
    assert llm.calls == ["sleep(level=1)", "wake_up(tags=['weights'])", "wake_up(tags=['kv_cache'])"]
    assert llm.weights_checksum == before


def test_a_sleep_call_the_engine_ignored_is_reported_and_nothing_changes() -> None:
    class IgnoresSleep(FakeLLM):  # e.g. a platform whose worker only logs "sleep mode is not supported"
        def sleep(self, level: int = 1) -> None:
            self.calls.append(f"sleep(level={level})")

    llm = IgnoresSleep(FakeDevice(10 * W), "a", _weights(1), kv_bytes=KV)
    h = VllmEngineHandler(llm)
    with pytest.raises(EngineCallFailed, match="reports it is not sleeping") as err:
        h.suspend(OFFLOAD, ALL)
    assert err.value.rolled_back and h.awake


def test_a_failed_wake_stays_asleep_and_the_next_resume_finishes_it() -> None:
    device = FakeDevice(W + KV)
    llm = FakeLLM(device, "a", _weights(4), kv_bytes=KV)
    h = VllmEngineHandler(llm)
    h.suspend(OFFLOAD, ALL)
    device.alloc("other", "x", W + KV - 10)  # another job still holds the device
    with pytest.raises(EngineCallFailed, match=r"LLM\.wake_up\(tags=\['weights'\]\) failed: FakeCudaOOM") as err:
        h.resume(OFFLOAD, ALL)
    assert not err.value.rolled_back and "nothing was woken" in str(err.value)
    assert h.asleep_tags == {"weights", "kv_cache"} and device.bytes_of("a") == 0
    device.free("other", "x")
    device.alloc("other", "x", KV - 10)  # now the weights fit, the KV cache does not
    with pytest.raises(EngineCallFailed, match=r"kv_cache.*still asleep"):
        h.resume(OFFLOAD, ALL)
    assert h.asleep_tags == {"kv_cache"}
    device.free("other", "x")
    h.resume(OFFLOAD, ALL)
    assert h.awake and llm.weights_checksum == checksum(_weights(4))
    assert llm.calls.count("wake_up(tags=['weights'])") == 2, "the weights were not woken a second time"


def test_a_failed_reload_is_retried_by_the_next_resume_and_blocks_a_suspend_meanwhile() -> None:
    llm = _llm()
    tries: list[int] = []

    def reload() -> None:
        tries.append(1)
        if len(tries) == 1:
            raise OSError("checkpoint shard 3 not found")
        llm.collective_rpc("reload_weights")

    h = VllmEngineHandler(llm, reload_weights=reload)
    h.suspend(DISCARD, ALL)
    with pytest.raises(EngineCallFailed, match=r"reload_weights\(\) failed: OSError: checkpoint shard 3"):
        h.resume(DISCARD, ALL)
    assert h.reload_due and h.asleep_tags == {"kv_cache"}
    with pytest.raises(HandlerError, match="last resume did not finish"):
        h.suspend(OFFLOAD, ALL)
    h.resume(DISCARD, ALL)
    assert len(tries) == 2 and h.awake and llm.weights_checksum == checksum(_weights(1))
    assert llm.calls.count("wake_up(tags=['weights'])") == 1


# --------------------------------------------------------------------------- SGLang


def test_sglang_releases_every_memory_type_by_name_and_resumes_the_weights_first() -> None:
    sgl = _sgl(enable_weights_cpu_backup=True)
    before = sgl.weights_checksum
    h = SglangEngineHandler(sgl, device_bytes=lambda: sgl.device.bytes_of("b"))
    assert h.weights_backed_up and h.memory_tags == SGLANG_MEMORY_TAGS
    r = h.suspend(OFFLOAD, ALL)
    assert sgl.calls == ["flush_cache()", "release_memory_occupation(tags=['weights', 'kv_cache', 'cuda_graph'])"]
    assert sgl.where() == {"weights": "host", "kv_cache": "dropped", "cuda_graph": "dropped"}
    assert r.device_bytes_freed == W + KV + 100 and sgl.offload_tags == set(SGLANG_MEMORY_TAGS)
    r = h.resume(OFFLOAD, ALL)
    assert sgl.calls[2:] == [
        "resume_memory_occupation(tags=['weights'])",
        "resume_memory_occupation(tags=['kv_cache', 'cuda_graph'])",
    ]
    assert r.device_bytes_freed == W + KV + 100 and sgl.offload_tags == set() and h.awake
    assert sgl.weights_checksum == before and sgl.generate("q")["text"] == f"{before}:q"


def test_sglang_weights_without_a_cpu_backup_are_reloaded_before_the_rest_is_resumed() -> None:
    sgl = _sgl()  # enable_weights_cpu_backup=False: a release drops the weights
    latest = _weights(9)
    sgl.update_weights_from_tensor(named_tensors=[("w", latest)])
    sgl.calls.clear()
    h = SglangEngineHandler(sgl, reload_weights=lambda: sgl.update_weights_from_tensor(named_tensors=[("w", latest)]))
    for mode in (OFFLOAD, DISCARD):  # one release on SGLang: the same calls either way
        sgl.calls.clear()
        h.suspend(mode, ALL)
        assert sgl.where()["weights"] == "dropped"
        h.resume(mode, ALL)
        assert sgl.calls[2:] == [
            "resume_memory_occupation(tags=['weights'])",
            "update_weights_from_tensor()",
            "resume_memory_occupation(tags=['kv_cache', 'cuda_graph'])",
        ]
        assert sgl.weights_checksum == checksum(latest)


def test_sglang_without_backup_or_hook_refuses_to_release_the_weights_but_not_the_rest() -> None:
    sgl = _sgl()
    h = SglangEngineHandler(sgl)
    for mode in (OFFLOAD, DISCARD):
        with pytest.raises(NoWeightReload, match="enable_weights_cpu_backup"):
            h.suspend(mode, ALL)
    assert sgl.calls == [] and h.awake
    h.suspend(OFFLOAD, frozenset({"kv_cache", "cuda_graph"}))
    assert sgl.calls == ["flush_cache()", "release_memory_occupation(tags=['kv_cache', 'cuda_graph'])"]
    assert SglangEngineHandler(_sgl(), weights_backed_up=True).weights_backed_up, "the caller's word wins"


def test_sglang_repeats_never_reach_the_engine_whose_double_pause_would_exit_the_process() -> None:
    raw = _sgl(enable_weights_cpu_backup=True)
    raw.release_memory_occupation(tags=["kv_cache"])
    with pytest.raises(SchedulerExited, match="Cannot pause allocation that is not active"):
        raw.release_memory_occupation(tags=["kv_cache"])  # what a second release does to the real one
    with pytest.raises(KeyError):
        _sgl().resume_memory_occupation(tags=["weights"])  # and a resume of what it never released

    sgl = _sgl(enable_weights_cpu_backup=True)
    h = SglangEngineHandler(sgl)
    h.resume(OFFLOAD, ALL)
    h.suspend(OFFLOAD, frozenset({"kv_cache"}))
    h.suspend(OFFLOAD, frozenset({"kv_cache"}))
    h.suspend(OFFLOAD, ALL)  # releases only what is still held
    h.suspend(OFFLOAD, ALL)
    h.resume(OFFLOAD, ALL)
    h.resume(OFFLOAD, ALL)
    assert sgl.calls == [
        "flush_cache()",
        "release_memory_occupation(tags=['kv_cache'])",
        "release_memory_occupation(tags=['weights', 'cuda_graph'])",
        "resume_memory_occupation(tags=['weights'])",
        "resume_memory_occupation(tags=['kv_cache', 'cuda_graph'])",
    ]
    assert sgl.exited is None and h.awake and sgl.generate("q")


def test_a_busy_sglang_engine_is_refused_before_anything_is_released() -> None:
    sgl = _sgl(enable_weights_cpu_backup=True)
    sgl.inflight = 2
    h = SglangEngineHandler(sgl)
    with pytest.raises(EngineCallFailed, match=r"Engine\.flush_cache\(\) failed.*success=False") as err:
        h.suspend(OFFLOAD, ALL)
    assert err.value.rolled_back and "taken as still holding its memory" in str(err.value)
    assert sgl.paused == set() and h.awake and sgl.calls == ["flush_cache()"]

    class NoFlush(FakeSglangEngine):  # an engine without flush_cache: SGLang's own assertion answers
        flush_cache = None  # type: ignore[assignment]

    busy = NoFlush(FakeDevice(10 * W), "c", _weights(5), kv_bytes=KV, graph_bytes=1, enable_weights_cpu_backup=True)
    busy.inflight = 1
    with pytest.raises(
        EngineCallFailed, match="AssertionError: release_memory_occupation should be called only when server is idle"
    ):
        SglangEngineHandler(busy).suspend(OFFLOAD, ALL)
    assert busy.paused == set()


def test_a_failed_sglang_resume_is_reported_with_the_state_it_left() -> None:
    device = FakeDevice(W + KV + 100)
    sgl = FakeSglangEngine(device, "b", _weights(6), kv_bytes=KV, graph_bytes=100, enable_weights_cpu_backup=True)
    h = SglangEngineHandler(sgl)
    h.suspend(OFFLOAD, ALL)
    device.alloc("other", "x", KV)  # the weights fit, the rest does not: SGLang's scheduler exits
    with pytest.raises(
        EngineCallFailed,
        match=r"resume_memory_occupation\(tags=\['kv_cache', 'cuda_graph'\]\) "
        r"failed: SchedulerExited.*out of memory",
    ) as err:
        h.resume(OFFLOAD, ALL)
    assert "asleep: kv_cache, cuda_graph" in str(err.value) and h.asleep_tags == {"kv_cache", "cuda_graph"}


def test_sglang_engines_that_cannot_release_are_refused_when_the_handler_is_made() -> None:
    with pytest.raises(MissingEngineMethod, match=r"release_memory_occupation\(\)"):
        SglangEngineHandler(_llm())
    with pytest.raises(EngineNotSleepable, match="enable_memory_saver=True"):
        SglangEngineHandler(_sgl(enable_memory_saver=False))
    with pytest.raises(ValueError, match="memory_tags"):
        SglangEngineHandler(_sgl(), memory_tags=())
    with pytest.raises(ValueError, match="memory_tags"):
        SglangEngineHandler(_sgl(), memory_tags=("weights", "weights"))
    with pytest.raises(HandlerError, match=r"unknown tags \['optimizer'\]"):
        SglangEngineHandler(_sgl(enable_weights_cpu_backup=True)).suspend(OFFLOAD, frozenset({"optimizer"}))


def test_the_handlers_import_no_engine_and_no_torch() -> None:
    code = (
        "import sys, timeslice_client.vllm_engine, timeslice_client.sglang_engine; "
        "sys.exit(sorted({m.partition('.')[0] for m in sys.modules} & {'vllm', 'sglang', 'torch'}) or 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, timeout=60, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- the lock


def test_a_block_using_the_engine_holds_a_suspend_off_and_an_asleep_engine_cannot_be_used() -> None:
    llm = _llm()
    h = VllmEngineHandler(llm, lock_timeout_s=0.05)
    inside, leave = threading.Event(), threading.Event()

    def generate() -> None:
        with h.using():
            llm.generate("long")
            inside.set()
            assert leave.wait(10)

    t = threading.Thread(target=generate)
    t.start()
    try:
        assert inside.wait(10)
        with pytest.raises(HandlerError, match=r"another call has held this vLLM engine handler for over 0\.05 s"):
            h.suspend(OFFLOAD, ALL)
        assert llm.calls == [], "the engine was not put to sleep under the generation"
    finally:
        leave.set()
        t.join(10)
    h.suspend(OFFLOAD, ALL)
    with pytest.raises(HandlerError, match=r"asleep .*use it only inside a hold"), h.using():
        pass


# --------------------------------------------------------------------------- through the real stack


async def test_two_jobs_hand_a_group_back_and_forth_with_one_engine_awake_at_a_time(nats_url: str) -> None:
    """Job a serves a vLLM engine (mode offload), job b an SGLang engine without a CPU copy of its weights (its
    reload hook pushes the trainer's latest). The device holds one engine, not both: a restore before the other's
    snapshot runs out of memory. Each hold updates the holder's weights (an RL step) and checks the engine serves
    exactly those."""
    device = FakeDevice(W + KV + 100 + 50)
    latest = {"a": _weights(10), "b": _weights(20)}
    engines: dict[str, FakeLLM | FakeSglangEngine] = {}
    handlers: dict[str, VllmEngineHandler | SglangEngineHandler] = {}

    def serves(job: str) -> str:
        eng = engines[job]
        out = eng.generate("p")[0] if isinstance(eng, FakeLLM) else eng.generate("p")["text"]
        return str(out)

    def step(job: str, round_: int) -> None:  # the holder's RL step: new weights into its engine
        assert device.owners() == {job}, f"only {job}'s engine is on the device: {device.held}"
        assert serves(job) == f"{checksum(latest[job])}:p", "it came back with its own, latest weights"
        latest[job] = _weights(100 * round_ + ord(job))
        eng = engines[job]
        if isinstance(eng, FakeLLM):
            eng.collective_rpc("update_weights", kwargs={"update_info": {"weights": latest[job]}})
        else:
            eng.update_weights_from_tensor(named_tensors=[("w", latest[job])])
        assert serves(job) == f"{checksum(latest[job])}:p"

    async def hand_over(frm: AsyncTimeSliceClient, to: AsyncTimeSliceClient) -> None:
        task = asyncio.create_task(to.acquire(timeout=30))

        async def waits() -> bool:
            return to.job_id in [w.job for w in (await group_record(frm)).queue]

        await eventually(waits, what=f"{to.job_id} waits")
        await frm.release()
        grant = await task
        if frm.job_id in handlers:
            assert handlers[frm.job_id].asleep_tags, f"{frm.job_id}'s engine sleeps once {to.job_id} holds"
        assert to.job_id not in handlers or grant.context_restored

    async with (
        running(Orchestrator(OrchestratorConfig(nats_url=nats_url))),
        running(Agent(AgentConfig(node_id=NODE, nats_url=nats_url))),
        AsyncTimeSliceClient("a", "g-eng", nats_url, bind_process=False) as a,
        AsyncTimeSliceClient("b", "g-eng", nats_url, bind_process=False) as b,
    ):
        await a.acquire(timeout=10)  # each job loads its engine inside its first hold
        llm = engines["a"] = FakeLLM(device, "a", latest["a"], kv_bytes=KV)
        handlers["a"] = VllmEngineHandler(llm)
        await a.register_workload(handlers["a"], node_id=NODE)
        step("a", 1)
        await hand_over(a, b)
        sgl = engines["b"] = FakeSglangEngine(device, "b", latest["b"], kv_bytes=KV, graph_bytes=100)
        handlers["b"] = SglangEngineHandler(
            sgl, reload_weights=lambda: sgl.update_weights_from_tensor(named_tensors=[("w", latest["b"])])
        )
        await b.register_workload(handlers["b"], node_id=NODE)
        holder, other = b, a
        for round_ in range(2, 8):
            step(holder.job_id, round_)
            await hand_over(holder, other)
            holder, other = other, holder
        step(holder.job_id, 8)
        assert device.peak <= device.capacity
        assert (
            llm.calls.count("sleep(level=1)") == 4
            and sgl.calls.count("release_memory_occupation(tags=['weights', 'kv_cache', 'cuda_graph'])") == 3
        )
        assert llm.warnings == [] and sgl.exited is None
        await holder.release()


async def test_an_engine_that_fails_to_sleep_faults_its_job_with_the_engines_words_and_keeps_it_awake(
    nats_url: str,
) -> None:
    device = FakeDevice(10 * W)
    async with (
        running(Orchestrator(OrchestratorConfig(nats_url=nats_url))),
        running(Agent(AgentConfig(node_id=NODE, nats_url=nats_url))),
        AsyncTimeSliceClient("a", "g-fail", nats_url, bind_process=False) as a,
        AsyncTimeSliceClient("b", "g-fail", nats_url, bind_process=False) as b,
    ):
        llm = FakeLLM(device, "a", _weights(1), kv_bytes=KV)
        h = VllmEngineHandler(llm)
        await a.register_workload(h, node_id=NODE)
        await a.acquire(timeout=10)
        llm.fail("sleep", RuntimeError("CUDA error: unspecified launch failure " + "x" * 2000))
        tb = asyncio.create_task(b.acquire(timeout=30))

        async def b_waits() -> bool:
            return [w.job for w in (await group_record(a)).queue] == ["b"]

        await eventually(b_waits, what="b waits for the group")
        await a.release()
        await tb  # b still gets the group: a's failed snapshot faults a alone

        async def faulted() -> str | None:
            return (await group_record(b)).faulted.get("a")

        reason = await eventually(faulted, what="a is faulted in the group")
        assert "LLM.sleep(level=1) failed: RuntimeError: CUDA error: unspecified launch failure" in reason, reason
        assert h.awake and llm.generate("x"), "rolled back: a's engine is as it was"
        await b.release()
