"""Fake inference engines with the sleep APIs of ``vllm.LLM`` and ``sglang.Engine``, over a fake device that counts
bytes and refuses what does not fit (``FakeCudaOOM``).

They keep the memory state the real engines keep (weights on the device, in host memory or dropped; KV cache and
CUDA graphs allocated or not), the weights' bytes (so a checksum shows whether they came back), and they answer
misuse as the real ones do:

* vLLM (``vllm/v1/executor/abstract.py``, ``vllm/device_allocator/cumem.py``, ``vllm/entrypoints/llm.py``): a sleep
  while asleep, a wake while awake, and a wake naming a tag that is not asleep only log a warning and return (the
  whole wake is skipped); without ``enable_sleep_mode`` both assert; a wake that runs out of memory unmaps what it
  mapped and raises, the tags staying asleep; ``LLM.sleep`` resets the prefix cache first; after level 2 the
  weights come back as allocated but empty memory; touching unmapped memory is a CUDA illegal-address error.
* SGLang (``scheduler_update_weights_mixin.py``, torch_memory_saver ``csrc/core.cpp``): a release asserts the
  engine is idle; ``tags=None`` means every type; each tag goes into ``offload_tags`` first and a resume removes each
  (``KeyError`` when absent, with the earlier ones already removed); pausing memory that is not active or resuming
  memory that is not paused exits the scheduler process (``exit(1)``), as does running out of memory on a resume;
  without ``enable_memory_saver`` release and resume free and take nothing; released weights are dropped unless
  ``enable_weights_cpu_backup``.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from types import SimpleNamespace
from typing import Any

__all__ = ["FakeCudaOOM", "FakeDevice", "FakeLLM", "FakeSglangEngine", "SchedulerExited", "checksum"]

WEIGHTS, KV, GRAPH = "weights", "kv_cache", "cuda_graph"
_EMPTY = 0xA5  # what remapped, never written memory reads as here (the real one: whatever the pages held)
_ILLEGAL = "CUDA error: an illegal memory access was encountered"


def checksum(data: bytes | bytearray | None) -> str | None:
    return None if data is None else hashlib.sha256(bytes(data)).hexdigest()[:16]


class FakeCudaOOM(RuntimeError):
    pass


class SchedulerExited(RuntimeError):
    """The SGLang scheduler process is gone (torch_memory_saver called ``exit(1)``); every later call fails."""


@dataclass
class FakeDevice:
    """A device of ``capacity`` bytes shared by engines: ``held`` maps (owner, tag) to bytes, ``peak`` the most
    ever held at once."""

    capacity: int
    held: dict[tuple[str, str], int] = field(default_factory=dict)
    peak: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def alloc(self, owner: str, tag: str, nbytes: int) -> None:
        with self.lock:
            used = sum(self.held.values())
            if used + nbytes > self.capacity:
                raise FakeCudaOOM(
                    f"CUDA out of memory. Tried to allocate {nbytes} bytes for {owner}/{tag} "
                    f"({used} of {self.capacity} bytes in use)"
                )
            self.held[(owner, tag)] = self.held.get((owner, tag), 0) + nbytes
            self.peak = max(self.peak, used + nbytes)

    def free(self, owner: str, tag: str) -> None:
        with self.lock:
            self.held.pop((owner, tag), None)

    @property
    def used(self) -> int:
        with self.lock:
            return sum(self.held.values())

    def bytes_of(self, owner: str) -> int:
        with self.lock:
            return sum(n for (o, _), n in self.held.items() if o == owner)

    def owners(self) -> set[str]:
        with self.lock:
            return {o for o, _ in self.held}


class _Knobs:
    """Test-side: ``fail(method, exc)`` makes the next call of ``method`` raise ``exc`` before doing anything (or,
    with ``after=True``, after doing its work)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.warnings: list[str] = []
        self._fail: dict[str, tuple[BaseException, bool]] = {}

    def fail(self, method: str, exc: BaseException, *, after: bool = False) -> None:
        self._fail[method] = (exc, after)

    def _enter(self, call: str) -> None:
        self.calls.append(call)
        name = call.partition("(")[0]
        if name in self._fail and not self._fail[name][1]:
            raise self._fail.pop(name)[0]

    def _leave(self, call: str) -> None:
        name = call.partition("(")[0]
        if name in self._fail and self._fail[name][1]:
            raise self._fail.pop(name)[0]


@dataclass(eq=False)
class _FakeEngine(_Knobs):
    """What both fakes are made with: ``name`` owns their bytes on ``device``, where they start awake with the
    ``weights`` and ``kv_bytes`` of KV cache allocated."""

    device: FakeDevice
    name: str
    weights: InitVar[bytes]
    _: KW_ONLY
    kv_bytes: int

    def __post_init__(self, weights: bytes) -> None:
        _Knobs.__init__(self)
        self.device.alloc(self.name, WEIGHTS, len(weights))
        self.device.alloc(self.name, KV, self.kv_bytes)
        self._weights: bytearray | None = bytearray(weights)
        self._backup: bytes | None = None  # the weights' host copy while they are off the device

    def _weights_back(self, nbytes: int) -> bytearray:
        """The weights as a wake maps them again: the host copy, else ``nbytes`` of memory never written."""
        return bytearray(self._backup) if self._backup is not None else bytearray([_EMPTY] * nbytes)

    @property
    def weights_checksum(self) -> str | None:
        """Of the weights on the device (None: not on the device)."""
        return checksum(self._weights)


# --------------------------------------------------------------------------- vLLM


class _FakeLLMEngine:
    def __init__(self, llm: FakeLLM, enable_sleep_mode: bool) -> None:
        self._llm = llm
        self.model_config = SimpleNamespace(enable_sleep_mode=enable_sleep_mode)

    def is_sleeping(self) -> bool:
        return bool(self._llm._sleeping)


@dataclass(eq=False, kw_only=True)
class FakeLLM(_FakeEngine):
    """``vllm.LLM``'s sleep-mode surface: ``sleep``, ``wake_up``, ``collective_rpc`` (``reload_weights`` from the
    checkpoint it was made from; ``update_weights`` with ``kwargs={"update_info": {"weights": bytes}}``),
    ``reset_prefix_cache``, ``generate``, and ``llm_engine.is_sleeping()``. ``reload_staging``: a reload allocates
    a staging buffer the size of the weights while it runs (a loader reading the checkpoint)."""

    enable_sleep_mode: bool = True
    reload_staging: bool = False

    def __post_init__(self, weights: bytes) -> None:
        super().__post_init__(weights)
        self.llm_engine = _FakeLLMEngine(self, self.enable_sleep_mode)
        self._checkpoint = bytes(weights)
        self._kv: bytearray | None = bytearray(self.kv_bytes)
        self._sleeping: set[str] = set()
        self.prefix_cache_resets = 0

    # ------------------------------------------------------------------ vLLM's API

    def sleep(self, level: int = 1) -> None:
        call = f"sleep(level={level})"
        self._enter(call)
        assert self.llm_engine.model_config.enable_sleep_mode, "Sleep mode is not enabled in the model config"
        self.reset_prefix_cache()
        if self._sleeping:
            self.warnings.append("Executor is already sleeping.")
            return
        if level not in (1, 2):
            raise ValueError(f"invalid sleep level {level}")
        self._backup = bytes(self._weights or b"") if level == 1 else None
        self._weights = self._kv = None
        self.device.free(self.name, WEIGHTS)
        self.device.free(self.name, KV)
        self._sleeping = {WEIGHTS, KV}
        self._leave(call)

    def wake_up(self, tags: list[str] | None = None) -> None:
        call = f"wake_up(tags={tags})"
        self._enter(call)
        assert self.llm_engine.model_config.enable_sleep_mode, "Sleep mode is not enabled in the model config"
        if not self._sleeping:
            self.warnings.append("Executor is not sleeping.")
            return
        for tag in tags or ():
            if tag not in self._sleeping:
                self.warnings.append(f"Tag {tag} is not in sleeping tags {self._sleeping}")
                return
        todo = [t for t in (WEIGHTS, KV) if t in self._sleeping and (tags is None or t in tags)]
        mapped: list[str] = []
        try:
            for tag in todo:
                self.device.alloc(self.name, tag, len(self._checkpoint) if tag == WEIGHTS else self.kv_bytes)
                mapped.append(tag)
        except Exception:
            for tag in mapped:  # the allocator unmaps what this call mapped, then re-raises
                self.device.free(self.name, tag)
            raise
        for tag in todo:
            if tag == WEIGHTS:
                self._weights = self._weights_back(len(self._checkpoint))
                self._backup = None
            else:
                self._kv = bytearray(self.kv_bytes)
        self._sleeping.difference_update(todo)
        self._leave(call)

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        call = f"collective_rpc({method})"
        self._enter(call)
        if self._weights is None:
            raise RuntimeError(_ILLEGAL)
        if method == "reload_weights":
            if self.reload_staging:
                self.device.alloc(self.name, "staging", len(self._checkpoint))
            try:
                self._weights[:] = self._checkpoint
            finally:
                self.device.free(self.name, "staging")
        elif method == "update_weights":
            new = (kwargs or {})["update_info"]["weights"]
            assert len(new) == len(self._weights)
            self._weights[:] = new
        else:
            raise AttributeError(f"'Worker' object has no attribute {method!r}")
        self._leave(call)
        return [None]

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True

    def generate(self, prompts: str | Sequence[str]) -> list[str]:
        if self._sleeping or self._weights is None or self._kv is None:
            raise RuntimeError(_ILLEGAL)
        return [f"{checksum(self._weights)}:{p}" for p in ([prompts] if isinstance(prompts, str) else prompts)]

    # ------------------------------------------------------------------ the test's view

    def where(self) -> dict[str, str]:
        weights = "device" if self._weights is not None else "host" if self._backup is not None else "dropped"
        return {WEIGHTS: weights, KV: "device" if self._kv is not None else "dropped"}


# --------------------------------------------------------------------------- SGLang


@dataclass(frozen=True)
class FlushCacheReqOutput:
    success: bool


@dataclass(eq=False, kw_only=True)
class FakeSglangEngine(_FakeEngine):
    """``sglang.Engine``'s memory surface: ``release_memory_occupation``, ``resume_memory_occupation``,
    ``flush_cache``, ``update_weights_from_tensor``, ``generate``, and ``server_args``. ``inflight`` (test-side):
    requests queued or running."""

    ALL = (KV, WEIGHTS, GRAPH)  # GPU_MEMORY_ALL_TYPES

    graph_bytes: int
    enable_memory_saver: bool = True
    enable_weights_cpu_backup: bool = False

    def __post_init__(self, weights: bytes) -> None:
        super().__post_init__(weights)
        self.server_args = SimpleNamespace(
            enable_memory_saver=self.enable_memory_saver, enable_weights_cpu_backup=self.enable_weights_cpu_backup
        )
        self.sizes = {WEIGHTS: len(weights), KV: self.kv_bytes, GRAPH: self.graph_bytes}
        self.device.alloc(self.name, GRAPH, self.graph_bytes)
        self.paused: set[str] = set()
        self.offload_tags: set[str] = set()
        self.cache_entries = 1  # the radix cache holds something until flushed
        self.inflight = 0
        self.exited: str | None = None

    # ------------------------------------------------------------------ SGLang's API

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._alive(call := f"release_memory_occupation(tags={tags})")
        assert self.inflight == 0, "release_memory_occupation should be called only when server is idle."
        tags = list(tags) if tags else list(self.ALL)
        self.offload_tags.update(tags)
        if not self.server_args.enable_memory_saver:
            return  # the memory saver adapter is a no-op
        for tag in self.ALL:  # kv_cache, weights, cuda_graph
            if tag in tags:
                self._pause(tag)
                if tag == KV:
                    self.cache_entries = 0
        self._leave(call)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._alive(call := f"resume_memory_occupation(tags={tags})")
        tags = list(tags) if tags else list(self.ALL)
        for tag in tags:
            self.offload_tags.remove(tag)  # KeyError: this tag was not released
        if not self.server_args.enable_memory_saver:
            return
        for tag in (GRAPH, WEIGHTS, KV):
            if tag in tags:
                self._resume(tag)
        self._leave(call)

    def flush_cache(self) -> FlushCacheReqOutput:
        self._alive("flush_cache()")
        if self.inflight:
            return FlushCacheReqOutput(success=False)
        self.cache_entries = 0
        return FlushCacheReqOutput(success=True)

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, bytes]], **kwargs: Any) -> tuple[bool, str]:
        self._alive("update_weights_from_tensor()")
        if WEIGHTS in self.paused or self._weights is None:
            raise RuntimeError(_ILLEGAL)
        ((_, new),) = named_tensors
        assert len(new) == len(self._weights)
        self._weights[:] = new
        return True, "Succeeded to update parameter online."

    def generate(self, prompt: str, sampling_params: dict[str, Any] | None = None) -> dict[str, Any]:
        self._alive("generate()")
        if self.paused or self._weights is None:
            raise RuntimeError(_ILLEGAL)
        self.cache_entries += 1
        return {"text": f"{checksum(self._weights)}:{prompt}"}

    # ------------------------------------------------------------------ inside

    def _alive(self, call: str) -> None:
        if self.exited:
            raise SchedulerExited(f"the scheduler process exited earlier ({self.exited})")
        self._enter(call)

    def _exit(self, why: str) -> None:
        self.exited = why
        raise SchedulerExited(f"[torch_memory_saver.cpp] {why} (the scheduler process called exit(1))")

    def _pause(self, tag: str) -> None:
        if tag in self.paused:
            self._exit(f"Cannot pause allocation that is not active. tag={tag}")
        if tag == WEIGHTS:
            self._backup = bytes(self._weights or b"") if self.server_args.enable_weights_cpu_backup else None
            self._weights = None
        self.device.free(self.name, tag)
        self.paused.add(tag)

    def _resume(self, tag: str) -> None:
        if tag not in self.paused:
            self._exit(f"Cannot resume allocation that is not paused. tag={tag}")
        try:
            self.device.alloc(self.name, tag, self.sizes[tag])
        except FakeCudaOOM as exc:
            self._exit(f"cudaError error: 2 (out of memory) [{exc}]")
        if tag == WEIGHTS:
            self._weights = self._weights_back(self.sizes[WEIGHTS])
        self.paused.discard(tag)

    # ------------------------------------------------------------------ the test's view

    def where(self) -> dict[str, str]:
        weights = "device" if WEIGHTS not in self.paused else "host" if self._backup is not None else "dropped"
        return {
            WEIGHTS: weights,
            KV: "dropped" if KV in self.paused else "device",
            GRAPH: "dropped" if GRAPH in self.paused else "device",
        }
