"""What the in-process engine handlers (``vllm_engine``, ``sglang_engine``) share: the engine's own sleep and wake
driven as a :class:`~timeslice_client.handlers.WorkloadHandler`, their errors, and the state they keep.

The engines free and take back their own device memory; the handler decides which of their calls to make, in which
order, and keeps track of what it put to sleep, so that a repeated suspend or resume does nothing (an SGLang scheduler
that is asked to pause memory it already paused exits the process: torch_memory_saver's ``pause`` calls ``exit(1)``
on an allocation that is not active). Resuming wakes the weights first, runs the weight-reload hook when the weights'
contents were dropped, and only then wakes the rest (KV cache, CUDA graphs): the order vLLM's sleep-mode docs give
for RLHF weight updates, so the KV cache is not allocated while the weights are being loaded.

Engine errors are translated at this boundary: the engine's exception becomes an :class:`EngineCallFailed` (a
``HandlerError``) naming the call, the engine's own words (at most ``MESSAGE_CHARS``) and the state the engine is in
now. That is the handler protocol's failure (``HandlerResult`` has no failure field): the workload channel answers
the agent's command with ``ok=False`` and that message. No exception of the engine's own leaves a handler.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final

from .errors import EngineCallFailed, HandlerError, NoWeightReload
from .handlers import HandlerResult
from .protocol import DEFAULT_OP_TIMEOUT_MS, SuspendMode

__all__ = [
    "DEFAULT_LOCK_TIMEOUT_S",
    "KV_CACHE",
    "MESSAGE_CHARS",
    "WEIGHTS",
    "DeviceBytes",
    "ReloadHook",
    "SleepHandler",
    "Step",
]

WEIGHTS: Final = "weights"
KV_CACHE: Final = "kv_cache"
MESSAGE_CHARS: Final = 200  # the engine's own words kept in an error (a fault reason on the wire keeps 256)
DEFAULT_LOCK_TIMEOUT_S: Final = DEFAULT_OP_TIMEOUT_MS / 1000

ReloadHook = Callable[[], object]
DeviceBytes = Callable[[], int]


def describe(exc: BaseException) -> str:
    """An engine's exception in at most ``MESSAGE_CHARS`` characters."""
    text = f"{exc.__class__.__name__}: {exc}".strip()
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1] + "…"


@dataclass(frozen=True, slots=True)
class Step:
    """One engine call: ``call`` as the error names it, ``run`` makes it."""

    call: str
    run: Callable[[], object]


# --------------------------------------------------------------------------- the handler


class SleepHandler(abc.ABC):
    """The shared state machine; subclasses say which engine calls a suspend and a wake make (see the module doc).

    Thread-safe: every call (and :meth:`using`) holds one lock, waited for at most ``lock_timeout_s`` seconds.
    Idempotent: a suspend of tags the handler already put to sleep, and a resume of tags that are awake, do nothing
    and report no bytes.
    """

    engine: ClassVar[str] = "engine"  # the engine's name in messages
    # The words of the error that asks for a reload hook (``NoWeightReload``): what drops the weights' contents, and
    # how to give the reload hook this engine needs.
    _loss_cause: ClassVar[str]
    _reload_hint: ClassVar[str]
    # What a sleep call that raised is taken to have left, when the engine cannot say whether it sleeps.
    _unprobed_failure: ClassVar[str] = "the engine cannot say whether it sleeps; taken as awake"

    def __init__(
        self,
        memory_tags: Sequence[str],
        *,
        reload_weights: ReloadHook | None,
        device_bytes: DeviceBytes | None,
        lock_timeout_s: float,
    ) -> None:
        if reload_weights is not None and not callable(reload_weights):
            raise TypeError(
                f"reload_weights must be callable (it is called with no arguments), not "
                f"{type(reload_weights).__name__!r}"
            )
        if device_bytes is not None and not callable(device_bytes):
            raise TypeError(
                f"device_bytes must be callable (returning the bytes the engine holds on the device), "
                f"not {type(device_bytes).__name__!r}"
            )
        if not lock_timeout_s > 0:
            raise ValueError(f"lock_timeout_s must be positive seconds, not {lock_timeout_s}")
        self.memory_tags = tuple(memory_tags)  # the engine's tags; a wake goes weights first, then this order
        self.reload_weights = reload_weights
        self.device_bytes = device_bytes
        self.lock_timeout_s = lock_timeout_s
        self._lock = threading.RLock()
        self._asleep: set[str] = set()  # tags this handler put to sleep and has not woken
        self._weights_lost = False  # the sleeping weights' contents are gone: reload them once they are awake
        self._reload_due = False  # the weights are awake again but the reload has not succeeded yet

    # ------------------------------------------------------------------ queries

    @property
    def asleep_tags(self) -> frozenset[str]:
        """The engine's memory tags this handler put to sleep and has not woken."""
        with self._locked("read the state"):
            return frozenset(self._asleep)

    @property
    def awake(self) -> bool:
        """Whether the engine is fully usable: nothing asleep, no weight reload due."""
        with self._locked("read the state"):
            return not self._asleep and not self._reload_due

    @property
    def reload_due(self) -> bool:
        """The weights were woken but the reload hook has not succeeded yet (a resume retries it)."""
        with self._locked("read the state"):
            return self._reload_due

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        """Hold the engine awake for a block (``with handler.using(): llm.generate(...)``): raises ``HandlerError``
        when it is asleep (instead of the engine's garbage or crash), and a suspend waits for the block to end (at
        most ``lock_timeout_s``). Optional: a job that generates only inside its holds needs none."""
        with self._locked("use the engine"):
            if self._asleep or self._reload_due:
                raise HandlerError(
                    f"the {self.engine} is asleep ({self._state()}): use it only inside a hold, after "
                    "the acquire that resumes it"
                )
            yield

    # ------------------------------------------------------------------ the handler interface

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        mode = self._mode(mode)
        with self._locked("suspend"):
            if self._reload_due:
                raise HandlerError(
                    f"the {self.engine}'s last resume did not finish ({self._state()}): resume it "
                    "again before suspending it",
                    tag=WEIGHTS,
                )
            wanted = self._suspend_tags(frozenset(tags))
            todo = tuple(t for t in wanted if t not in self._asleep)
            if not todo:
                return HandlerResult()
            loses = self._loses_weights(mode, todo)
            if loses and self.reload_weights is None:
                raise NoWeightReload(self.engine, self._loss_cause, self._reload_hint)
            steps = self._sleep_steps(mode, todo)
            before = self._measure()
            for step in steps:
                try:
                    step.run()
                except Exception as exc:
                    raise self._failed_sleep(step, exc, todo, loses) from exc
            if self._asks() is False:  # it returned, yet says it is awake: nothing was freed
                raise EngineCallFailed(
                    self.engine,
                    steps[-1].call,
                    "it returned, but the engine reports it is not sleeping",
                    "the engine is awake, nothing changed",
                    rolled_back=True,
                )
            self._asleep.update(todo)
            self._weights_lost = self._weights_lost or loses
            return HandlerResult(device_bytes_freed=self._delta(before, self._measure()))

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        """Wake the selected tags (all when empty) that this handler put to sleep; what comes back follows how they
        were suspended (weights whose contents were dropped are reloaded by the hook)."""
        self._mode(mode)
        with self._locked("resume"):
            wanted = self._known(frozenset(tags)) or frozenset(self.memory_tags)
            before = self._measure()
            woke = self._wake(wanted)
            if woke and not self._asleep and not self._reload_due and self._asks() is True:
                raise EngineCallFailed(
                    self.engine,
                    "wake-up",
                    "every memory tag was woken, but the engine still reports it is sleeping",
                    "its memory is back but it is not usable (paused scheduling?); restart the job",
                    rolled_back=False,
                )
            return HandlerResult(device_bytes_freed=self._delta(self._measure(), before))

    # ------------------------------------------------------------------ the engine's side (subclasses)

    def _suspend_tags(self, tags: frozenset[str]) -> tuple[str, ...]:
        """The engine tags a suspend of ``tags`` puts to sleep, in ``memory_tags`` order (refuse what cannot be)."""
        wanted = self._known(tags) or frozenset(self.memory_tags)
        return tuple(t for t in self.memory_tags if t in wanted)

    @abc.abstractmethod
    def _loses_weights(self, mode: SuspendMode, todo: tuple[str, ...]) -> bool:
        """Whether suspending ``todo`` in ``mode`` drops the weights' contents (a reload is then due)."""

    @abc.abstractmethod
    def _sleep_steps(self, mode: SuspendMode, todo: tuple[str, ...]) -> list[Step]:
        """The engine calls that put ``todo`` to sleep in ``mode``, in order."""

    @abc.abstractmethod
    def _wake_step(self, tags: tuple[str, ...]) -> Step:
        """The engine call that wakes ``tags``."""

    def _probe(self) -> bool | None:
        """Whether the engine says it is sleeping (any part of it); None: it cannot say."""
        return None

    # ------------------------------------------------------------------ inside

    def _wake(self, wanted: frozenset[str]) -> bool:
        """Wake ``wanted``: the weights, their reload, then the rest. Returns whether anything was done."""
        woke = False
        if WEIGHTS in wanted and WEIGHTS in self._asleep:
            self._call(self._wake_step((WEIGHTS,)), "nothing was woken")
            self._asleep.discard(WEIGHTS)
            self._reload_due, self._weights_lost = self._weights_lost, False
            woke = True
        if WEIGHTS in wanted and self._reload_due:
            assert self.reload_weights is not None  # _weights_lost is set only with a hook
            self._call(
                Step("reload_weights()", self.reload_weights),
                "the weights are awake but not reloaded; a resume again retries the reload",
            )
            self._reload_due = False
            woke = True
        rest = tuple(t for t in self.memory_tags if t != WEIGHTS and t in wanted and t in self._asleep)
        if rest:
            self._call(self._wake_step(rest), "these are still asleep; a resume again retries")
            self._asleep.difference_update(rest)
            woke = True
        return woke

    def _call(self, step: Step, state: str) -> None:
        try:
            step.run()
        except Exception as exc:
            raise EngineCallFailed(
                self.engine, step.call, describe(exc), f"{state} ({self._state()})", rolled_back=False
            ) from exc

    def _failed_sleep(self, step: Step, exc: Exception, todo: tuple[str, ...], loses: bool) -> EngineCallFailed:
        """A sleep call raised: find out whether the engine is asleep, and if so wake it again (the contract: a failed
        suspend leaves the job as it was)."""
        reason = describe(exc)
        asleep = self._asks()
        if not asleep:
            how = "the engine reports it is awake" if asleep is False else self._unprobed_failure
            return EngineCallFailed(self.engine, step.call, reason, f"{how}; nothing changed", rolled_back=True)
        self._asleep.update(todo)
        self._weights_lost = self._weights_lost or loses
        try:
            self._wake(frozenset(todo))
        except EngineCallFailed as again:
            return EngineCallFailed(
                self.engine,
                step.call,
                reason,
                f"it went to sleep anyway and waking it again failed ({again}); restart the job",
                rolled_back=False,
            )
        return EngineCallFailed(
            self.engine, step.call, reason, "it went to sleep anyway; woke it again", rolled_back=True
        )

    def _asks(self) -> bool | None:
        """``_probe()``, None when it raises (the answer is then unknown, never an error of its own)."""
        try:
            return self._probe()
        except Exception:
            return None

    def _known(self, tags: frozenset[str]) -> frozenset[str]:
        unknown = sorted(t for t in tags if t not in self.memory_tags)
        if unknown:
            raise HandlerError(
                f"unknown tags {unknown[:8]}: this {self.engine} handler has {list(self.memory_tags)}",
                tag=str(unknown[0])[:64],
            )
        return tags

    def _state(self) -> str:
        asleep = [t for t in self.memory_tags if t in self._asleep]
        parts = [f"asleep: {', '.join(asleep)}" if asleep else "nothing asleep"]
        if self._reload_due:
            parts.append("weights not reloaded")
        return "; ".join(parts)

    def _mode(self, mode: SuspendMode | str) -> SuspendMode:
        try:
            return SuspendMode(mode)
        except ValueError:
            raise HandlerError(f"unknown suspend mode {str(mode)[:32]!r}: use 'offload' or 'discard'") from None

    def _measure(self) -> int | None:
        """The engine's device bytes now; None when not measured (no ``device_bytes``, or it failed: a failed
        measurement never fails a move)."""
        if self.device_bytes is None:
            return None
        try:
            return int(self.device_bytes())
        except Exception:
            return None

    @staticmethod
    def _delta(high: int | None, low: int | None) -> int:
        return max(0, high - low) if high is not None and low is not None else 0

    @contextlib.contextmanager
    def _locked(self, what: str) -> Iterator[None]:
        if not self._lock.acquire(timeout=self.lock_timeout_s):
            raise HandlerError(
                f"could not {what}: another call has held this {self.engine} handler for over "
                f"{self.lock_timeout_s:g} s (a block inside using(), or a suspend or resume still "
                "running)"
            )
        try:
            yield
        finally:
            self._lock.release()
