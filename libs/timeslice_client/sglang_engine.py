"""A ready-made handler for an in-process SGLang engine: its own memory release and resume, driven by the switches.

::

    import sglang
    from timeslice_client.sglang_engine import SglangEngineHandler

    engine = sglang.Engine(model_path="Qwen/Qwen3-0.6B", enable_memory_saver=True, enable_weights_cpu_backup=True)
    client.register_workload(SglangEngineHandler(engine))
    # without enable_weights_cpu_backup the released weights are dropped, so give them back after waking:
    client.register_workload(SglangEngineHandler(engine, reload_weights=lambda: engine.update_weights_from_tensor(
        named_tensors=list(trainer_model.named_parameters()))))

What it does (the calls of the HTTP backend ``app_endpoint``'s ``/release_memory_occupation`` and
``/resume_memory_occupation``, in-process):

* ``suspend``: ``engine.flush_cache()`` (when the KV cache is released; an answer ``success=False`` means requests
  are in flight and the release is refused before anything moves), then ``engine.release_memory_occupation(
  tags=[...])`` with the selected tags, named explicitly: all of ``memory_tags`` (``weights``, ``kv_cache``,
  ``cuda_graph``: SGLang's memory types) when the registration has none.
* ``resume``: ``engine.resume_memory_occupation(tags=["weights"])``, then ``reload_weights()`` when the weights were
  dropped, then ``resume_memory_occupation`` of the rest: the KV cache and CUDA graphs are not allocated while the
  weights load. The KV cache comes back empty (the release flushed it).
* Modes: SGLang has one release, so ``offload`` and ``discard`` make the same call. Whether the weights survive is
  the engine's ``enable_weights_cpu_backup`` (read from ``engine.server_args`` unless ``weights_backed_up`` is
  given; SGLang before 0.5.3 has no such setting and drops them). When they do not survive, a suspend that releases
  them needs ``reload_weights`` (a callable with no arguments, e.g. the trainer's ``update_weights_from_tensor``, or
  ``update_weights_from_disk``), or it is refused before the engine is touched (``NoWeightReload``; the job keeps
  running).

Idempotent, and it has to be: SGLang exits the process when asked to pause memory that is already paused, or to
resume memory that is not (torch_memory_saver's ``pause``/``resume`` call ``exit(1)``), and raises ``KeyError`` on
resuming a tag it has not released. The handler releases only what it has not released and resumes only what it
released. A suspend or resume of a subset of ``memory_tags`` works on that subset alone.

Errors: the engine's exception becomes ``EngineCallFailed`` (a ``HandlerError``: the agent's command fails with its
message), naming the call and the engine's words (at most 200 characters). SGLang cannot be asked whether it has
released memory; it asserts that it is idle before it releases anything, so a failed release is taken as having
changed nothing. A failed resume leaves what it woke awake and the rest released, and the next resume carries on.

The cost is the engine's own: releasing unmaps its memory (copying the weights to pinned host memory first when
they are backed up); resuming maps it again and copies them back. ``bytes_moved`` is reported as 0 (SGLang does not
say how much it copied); ``device_bytes_freed`` is measured with ``device_bytes`` when given, else 0 (which also keeps
the agent from starting another job's restore beside this one's release: it needs a known size).

Thread-safety: suspend and resume run on the workload channel's thread; the handler serialises its calls with a
lock, and ``with handler.using(): engine.generate(...)`` makes a generation and a switch wait for each other (and
raises when the engine is released). The engine must be idle at the release (SGLang asserts it).

SGLang API facts relied on (``python/sglang/srt/entrypoints/engine.py``, ``python/sglang/srt/managers/
scheduler_update_weights_mixin.py``, ``python/sglang/srt/torch_memory_saver_adapter.py``, torch_memory_saver's
``csrc/core.cpp``): ``Engine.release_memory_occupation(tags=None)`` and ``Engine.resume_memory_occupation(tags=None)``
take a list of tags, None or ``[]`` meaning every memory type (``kv_cache``, ``weights``, ``cuda_graph`` in current
versions; an unknown tag is recorded and nothing of it is paused); they act only with ``enable_memory_saver=True``
(otherwise its adapter is a no-op and nothing is freed: refused when the handler is made); the scheduler's release
asserts it is idle, flushes the cache with the KV cache and stashes the model's buffers with the weights; the resume
removes each tag from its released set (``KeyError`` when absent) and wakes CUDA graphs, then weights, then the KV
cache; weights are backed up to host memory only with ``enable_weights_cpu_backup=True``;
``Engine.flush_cache()`` flushes only when no request is queued or running and answers ``success``. This module
never imports sglang: it calls those methods on the object it is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from ._duck_engine import attribute, require_methods
from ._engine_sleep import DEFAULT_LOCK_TIMEOUT_S, KV_CACHE, WEIGHTS, DeviceBytes, ReloadHook, SleepHandler, Step
from ._renamed import renamed_keywords
from .errors import EngineCallFailed, EngineNotSleepable, MissingEngineMethod, NoWeightReload
from .protocol import SuspendMode

__all__ = [
    "SGLANG_MEMORY_TAGS",
    "EngineCallFailed",
    "EngineNotSleepable",
    "MissingEngineMethod",
    "NoWeightReload",
    "SglangEngineHandler",
]

SGLANG_MEMORY_TAGS: Final = (WEIGHTS, KV_CACHE, "cuda_graph")  # SGLang's GPU memory types
_HINT: Final = "an sglang.Engine made with enable_memory_saver=True"
_MAX_TAGS: Final = 8
_MAX_TAG_CHARS: Final = 64


class CacheNotFlushed(Exception):
    """``flush_cache()`` answered that it did not flush (requests in flight)."""


class SglangEngineHandler(SleepHandler):
    """Releases an in-process ``sglang.Engine``'s device memory and resumes it; see the module doc.

    ``reload_weights``: called with no arguments when the released weights were dropped (no CPU backup), once they
    are allocated again and before the rest is. ``weights_backed_up``: whether the engine keeps a host copy of the
    weights across a release (default: its ``server_args.enable_weights_cpu_backup``, else False).
    ``memory_tags``: what "everything" is, in the order the rest is woken after the weights. ``device_bytes``: the
    device bytes the engine holds now, to report what a switch frees. ``lock_timeout_s``: how long a call waits for
    another one (or a ``using()`` block) to end.
    """

    engine = "SGLang engine"
    _loss_cause = "releasing the weights of an engine without enable_weights_cpu_backup"
    _reload_hint = (
        "pass reload_weights= (e.g. a call of engine.update_weights_from_tensor with the trainer's weights), "
        "start the engine with enable_weights_cpu_backup=True, or register tags that leave out 'weights'"
    )
    _unprobed_failure = (
        "SGLang checks that it is idle before it releases anything, so it is taken as still holding its memory"
    )

    @renamed_keywords(lock_timeout="lock_timeout_s")
    def __init__(
        self,
        engine: object,
        *,
        reload_weights: ReloadHook | None = None,
        weights_backed_up: bool | None = None,
        memory_tags: Iterable[str] = SGLANG_MEMORY_TAGS,
        device_bytes: DeviceBytes | None = None,
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
    ) -> None:
        require_methods(engine, "SGLang Engine", ("release_memory_occupation", "resume_memory_occupation"), _HINT)
        if attribute(engine, "server_args.enable_memory_saver") is False:
            raise EngineNotSleepable(
                "SGLang engine",
                "enable_memory_saver=True",
                "make it with sglang.Engine(..., enable_memory_saver=True) (--enable-memory-saver for a server)",
            )
        if weights_backed_up is None:
            weights_backed_up = attribute(engine, "server_args.enable_weights_cpu_backup") is True
        self.sgl: Any = engine  # duck-typed: the methods called were checked above
        self.weights_backed_up = weights_backed_up
        flush = getattr(engine, "flush_cache", None)
        self._flush = flush if callable(flush) else None
        super().__init__(
            _checked(memory_tags),
            reload_weights=reload_weights,
            device_bytes=device_bytes,
            lock_timeout_s=lock_timeout_s,
        )

    def _loses_weights(self, mode: SuspendMode, todo: tuple[str, ...]) -> bool:
        return WEIGHTS in todo and not self.weights_backed_up

    def _sleep_steps(self, mode: SuspendMode, todo: tuple[str, ...]) -> list[Step]:
        steps = []
        if KV_CACHE in todo and self._flush is not None:
            steps.append(Step("Engine.flush_cache()", self._flush_or_refuse))
        steps.append(
            Step(
                f"Engine.release_memory_occupation(tags={list(todo)})",
                lambda: self.sgl.release_memory_occupation(tags=list(todo)),
            )
        )
        return steps

    def _flush_or_refuse(self) -> None:
        assert self._flush is not None
        out = self._flush()
        if getattr(out, "success", out) is False:
            raise CacheNotFlushed(
                "it answered success=False: requests are queued or running; finish or abort "
                "generation before releasing the group"
            )

    def _wake_step(self, tags: tuple[str, ...]) -> Step:
        return Step(
            f"Engine.resume_memory_occupation(tags={list(tags)})",
            lambda: self.sgl.resume_memory_occupation(tags=list(tags)),
        )


def _checked(tags: Iterable[str]) -> tuple[str, ...]:
    out = tuple(tags)
    if not 1 <= len(out) <= _MAX_TAGS or len(set(out)) != len(out):
        raise ValueError(f"memory_tags must be 1 to {_MAX_TAGS} distinct tags, not {list(out)[: _MAX_TAGS + 1]}")
    for tag in out:
        if not isinstance(tag, str) or not 0 < len(tag) <= _MAX_TAG_CHARS:
            raise ValueError(
                f"memory_tags: each tag is a string of 1 to {_MAX_TAG_CHARS} characters, not "
                f"{str(tag)[: _MAX_TAG_CHARS + 1]!r}"
            )
    return out
