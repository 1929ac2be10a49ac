"""A ready-made handler for an in-process vLLM engine: the engine's own sleep mode, driven by the switches.

::

    from vllm import LLM
    from timeslice_client.vllm_engine import VllmEngineHandler

    llm = LLM("Qwen/Qwen3-0.6B", enable_sleep_mode=True)
    client.register_workload(VllmEngineHandler(llm))                       # mode offload: sleep level 1
    # mode discard (sleep level 2) needs the weights put back after waking:
    client.register_workload(VllmEngineHandler(llm, reload_weights=lambda: llm.collective_rpc("reload_weights")),
                             mode="discard")

What each mode does (the same levels as the HTTP backend ``app_endpoint``, ``services/agent/timeslice_agent/
_app_endpoint.py``):

* ``suspend(offload)``: ``llm.sleep(level=1)``: the weights are copied to host memory, the KV cache is dropped.
* ``suspend(discard)``: ``llm.sleep(level=2)``: both are dropped. The weights come back as allocated but empty
  memory, so the handler needs ``reload_weights`` (a callable with no arguments: ``llm.collective_rpc(
  "reload_weights")`` reloads the checkpoint the engine was started from; an RL job pushes its trainer's current
  weights instead). Without one a discard suspend is refused before the engine is touched (``NoWeightReload``; the
  job keeps running). It cannot be refused when the handler is made: the mode comes with each command (the
  registration's, or a standalone gRPC request's own).
* ``resume``: ``llm.wake_up(tags=["weights"])``, then ``reload_weights()`` after a level-2 sleep, then
  ``llm.wake_up(tags=["kv_cache"])``: the KV cache is not allocated while the weights load (vLLM's own advice for
  weight updates), so the peak is weights plus whatever the reload needs, not that plus the KV cache.
  The KV cache comes back empty (``LLM.sleep`` resets the prefix cache first): the first requests after a switch
  prefill again.

Tags: ``LLM.sleep(level)`` puts the whole engine to sleep, so a suspend takes no tags or both ``weights`` and
``kv_cache``; a part alone is refused (``HandlerError``). A resume may name one of them (``{"weights"}`` wakes and
reloads the weights only; a later ``{"kv_cache"}`` the rest).

Idempotent: a suspend while the handler has the engine asleep, or a resume while it is awake, does nothing. After
each call the handler asks the engine (``llm.llm_engine.is_sleeping()``, where it exists) and reports a call that
returned without effect as failed: vLLM's executor only logs a warning and returns when asked to sleep while
asleep, to wake while awake, or to wake a tag that is not asleep (the whole wake is then skipped).

Errors: the engine's exception becomes ``EngineCallFailed`` (a ``HandlerError``: the agent's command fails with its
message), naming the call and the engine's words (at most 200 characters). When ``sleep`` raises but the engine
reports it sleeps, the handler wakes it again (the handler contract: a failed suspend leaves the job as it was). A
failed wake leaves what it woke awake and the rest asleep, and the next resume carries on from there.

The cost is the engine's own: a level-1 sleep copies the weights to (pinned) host memory with ``cudaMemcpy`` and
unmaps every sleep-mode allocation; a wake maps them again and copies the weights back. ``bytes_moved`` is reported
as 0 (vLLM does not say how much it copied); ``device_bytes_freed`` is measured with ``device_bytes`` when given (a
callable returning the device bytes the engine holds now, e.g. from NVML), else 0, which also keeps the agent from
starting another job's restore beside this one's sleep (it needs a known size).

Thread-safety: suspend and resume run on the workload channel's thread; the handler serialises its calls with a
lock, and ``with handler.using(): llm.generate(...)`` makes a generation and a switch wait for each other (and
raises when the engine is asleep). The engine must be idle at the release: ``LLM.sleep`` aborts requests in flight
(``mode="abort"``, its default in recent vLLM) and expects none (older ones).

vLLM API facts relied on (docs.vllm.ai "Sleep Mode", https://docs.vllm.ai/en/latest/features/sleep_mode/; vLLM's
``vllm/entrypoints/llm.py``, ``vllm/v1/executor/abstract.py``, ``vllm/v1/engine/llm_engine.py``,
``vllm/device_allocator/cumem.py``): ``LLM(..., enable_sleep_mode=True)`` is required (the engine asserts it);
``LLM.sleep(level=1)`` offloads the weights to CPU memory and discards the KV cache, ``level=2`` discards both;
``LLM.wake_up(tags=None)`` reallocates everything, ``tags=["weights"]`` / ``["kv_cache"]`` one part, and all must be
woken before the engine is used; ``is_sleeping`` stays true until every tag is woken; after level 2 the weights are
reloaded in place with ``llm.collective_rpc("reload_weights")`` (or the caller's own weight update) between waking
the weights and the KV cache. This module never imports vllm: it calls those methods on the object it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from ._duck_engine import attribute, require_methods
from ._engine_sleep import DEFAULT_LOCK_TIMEOUT_S, KV_CACHE, WEIGHTS, DeviceBytes, ReloadHook, SleepHandler, Step
from ._renamed import renamed_keywords
from .errors import EngineCallFailed, EngineNotSleepable, HandlerError, MissingEngineMethod, NoWeightReload
from .protocol import SuspendMode

__all__ = [
    "VLLM_MEMORY_TAGS",
    "EngineCallFailed",
    "EngineNotSleepable",
    "MissingEngineMethod",
    "NoWeightReload",
    "VllmEngineHandler",
]

VLLM_MEMORY_TAGS: Final = (WEIGHTS, KV_CACHE)  # the tags of vLLM's sleep-mode allocator, in wake order
_HINT: Final = "a vllm.LLM made with enable_sleep_mode=True"


class VllmEngineHandler(SleepHandler):
    """Suspends an in-process ``vllm.LLM`` with its own sleep mode and wakes it again; see the module doc.

    ``reload_weights``: called with no arguments after a level-2 (``discard``) sleep, once the weights are awake
    and before the KV cache is. ``device_bytes``: the device bytes the engine holds now, to report what a switch
    frees. ``lock_timeout_s``: how long a call waits for another one (or a ``using()`` block) to end.
    """

    engine = "vLLM engine"
    _loss_cause = "mode discard (LLM.sleep(level=2))"
    _reload_hint = (
        "pass reload_weights=lambda: llm.collective_rpc('reload_weights') (or your own weight update), or "
        "register mode offload (level 1 keeps the weights in host memory)"
    )

    @renamed_keywords(lock_timeout="lock_timeout_s")
    def __init__(
        self,
        llm: object,
        *,
        reload_weights: ReloadHook | None = None,
        device_bytes: DeviceBytes | None = None,
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
    ) -> None:
        require_methods(llm, "vLLM LLM", ("sleep", "wake_up"), _HINT)
        for path in (
            "llm_engine.model_config.enable_sleep_mode",
            "llm_engine.vllm_config.model_config.enable_sleep_mode",
        ):
            if attribute(llm, path) is False:
                raise EngineNotSleepable(
                    "vLLM engine", "enable_sleep_mode=True", "make it with LLM(..., enable_sleep_mode=True)"
                )
        self.llm: Any = llm  # duck-typed: the methods called were checked above
        probe = attribute(llm, "llm_engine.is_sleeping")
        if not callable(probe):
            probe = attribute(llm, "is_sleeping")
        self._is_sleeping: Callable[[], object] | None = probe if callable(probe) else None
        super().__init__(
            VLLM_MEMORY_TAGS, reload_weights=reload_weights, device_bytes=device_bytes, lock_timeout_s=lock_timeout_s
        )

    def _suspend_tags(self, tags: frozenset[str]) -> tuple[str, ...]:
        part = self._known(tags)
        if part and part != frozenset(VLLM_MEMORY_TAGS):
            raise HandlerError(
                f"vLLM's LLM.sleep(level) puts the whole engine to sleep, so it cannot suspend "
                f"{sorted(part)} alone: register tags=() or ('weights', 'kv_cache')",
                tag=sorted(part)[0],
            )
        return VLLM_MEMORY_TAGS

    def _loses_weights(self, mode: SuspendMode, todo: tuple[str, ...]) -> bool:
        return mode is SuspendMode.DISCARD

    def _sleep_steps(self, mode: SuspendMode, todo: tuple[str, ...]) -> list[Step]:
        if self._asleep:  # a part woke alone (resume of one tag): LLM.sleep would log "already sleeping", do nothing
            raise HandlerError(
                f"the vLLM engine is partly awake ({self._state()}): resume the rest before suspending it again"
            )
        level = 2 if mode is SuspendMode.DISCARD else 1
        return [Step(f"LLM.sleep(level={level})", lambda: self.llm.sleep(level=level))]

    def _wake_step(self, tags: tuple[str, ...]) -> Step:
        return Step(f"LLM.wake_up(tags={list(tags)})", lambda: self.llm.wake_up(tags=list(tags)))

    def _probe(self) -> bool | None:
        return bool(self._is_sleeping()) if self._is_sleeping is not None else None
