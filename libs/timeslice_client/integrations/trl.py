"""TRL's ``GRPOTrainer`` on a shared group of accelerators: the lines to add to a job, and what they do.

::

    from timeslice_client import TimeSliceClient
    from timeslice_client.integrations.trl import attach

    with TimeSliceClient(job_id="grpo-a", group_id="gpus-0") as client:
        trainer = GRPOTrainer(model=model, reward_funcs=[score], args=args, train_dataset=dataset)
        attach(trainer, client)          # holds, the offload handler, the reward phase off the accelerators
        trainer.train()
        with client.on_accelerators():   # after train() the state may be off the device: read it in a hold
            trainer.save_model("out")

:func:`attach` adds a :class:`TimeSliceCallback` to the trainer and wraps its Python reward functions with
:meth:`TimeSliceCallback.off_accelerators` (reward *models*, ``nn.Module`` s, run on the accelerators and stay
held). Or do both yourself: ``cb = TimeSliceCallback(client)``, then
``GRPOTrainer(..., reward_funcs=[cb.off_accelerators(score)], callbacks=[cb])``.

The job's timeline, as the callback shapes it (TRL's extension points: the trainer's callback events and the reward
functions it calls)::

    on_train_begin   register model + optimizer with a TorchOffloadHandler (the optimizer exists only now: the
                     trainer creates it in train()), then acquire
    generation       held (on_step_begin makes sure); TRL samples completions, computes old/ref log-probs
    reward function  released while each wrapped reward function runs: another job's generation or training step
                     uses the accelerators meanwhile, and the agent moves this job's state off and back
    training         held again before the reward function returns: loss, backward, the optimizer step (held,
                     on_pre_optimizer_step makes sure), logging, saving, the next step's generation
    on_train_end     released

So the group changes hands only at reward scoring, once per generation batch. What moves on a switch: the model's
parameters, gradients and buffers (tag ``weights``), the optimizer's state (``optimizer``) and the modules given as
``modules=`` (e.g. ``{"ref": trainer.ref_model}``, which :func:`attach` adds when TRL made one). What stays on the
device: the batch in flight (prompt/completion ids, log-probs, advantages: a few MB) and the trainer's running loss.

The hold is the integration's: do not call ``trainer.train()`` inside ``client.on_accelerators()`` (refused:
:class:`~timeslice_client.errors.InvalidRequest`); after ``train()`` returns, or raises, read or save the model
inside ``client.on_accelerators()``. A ``train()`` that raises leaves the group held until ``client.release()`` or
``client.close()``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from .._sync_client import TimeSliceClient
from ..errors import InvalidRequest, TimeSliceError
from ..workload import WorkloadChannel
from ._counting import CountingHandler, OffloadCounts

try:
    import torch
    import trl  # noqa: F401 - the trainer this integrates with: without it, the extra is missing
    from transformers import TrainerCallback
except ModuleNotFoundError as exc:
    if (exc.name or "").split(".")[0] not in ("torch", "trl", "transformers", "accelerate", "datasets"):
        raise
    raise ModuleNotFoundError(
        f"timeslice_client.integrations.trl needs TRL, which is not installed ({exc}): "
        "pip install 'timeslice-client[trl]'",
        name=exc.name,
    ) from exc

from .._renamed import renamed_keywords
from ..torch_offload import TorchOffloadHandler

__all__ = ["HoldCounts", "OffloadCounts", "TimeSliceCallback", "attach"]

log = logging.getLogger("timeslice.integrations.trl")

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_OP_TIMEOUT_S = 30.0  # one suspend or resume of the job's state; unanswered after this, the job is gone


@dataclass(frozen=True, slots=True)
class HoldCounts:
    """What the callback did so far: the holds it took (``acquires``, with their total wait), the holds it gave
    back (``releases``: at reward scoring and at the end of training), and what the offload handler moved."""

    acquires: int
    releases: int
    waited_ms: float
    offload: OffloadCounts


def _is_async(fn: Callable[..., Any]) -> bool:
    """TRL's own test (``trl.trainer.utils.is_async_callable``): partials unwrapped, async ``__call__`` counts."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _plain_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` (which reads its ``state`` from it)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class TimeSliceCallback(TrainerCallback):  # type: ignore[misc]  # transformers is not type-checked here
    """Holds the client's group while the trainer works on the accelerators and gives it back while wrapped reward
    functions run; registers the trainer's model and optimizer with the node's agent. See the module doc.

    ``modules``: more modules whose state moves with the model's, by tag (e.g. ``{"ref": ref_model}``).
    ``node_id``, ``op_timeout_s``: as :meth:`TimeSliceClient.register_workload`. ``device``: as
    :class:`TorchOffloadHandler` (default: CUDA when available, else CPU tensors stand in for the device).
    ``acquire_timeout_s``: each acquire's bound (default: the client's)."""

    @renamed_keywords(acquire_timeout="acquire_timeout_s", op_timeout="op_timeout_s")
    def __init__(
        self,
        client: TimeSliceClient,
        *,
        modules: Mapping[str, Any] | None = None,
        node_id: str | None = None,
        op_timeout_s: float = DEFAULT_OP_TIMEOUT_S,
        device: str | None = None,
        acquire_timeout_s: float | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(client, TimeSliceClient):
            raise InvalidRequest(
                f"TimeSliceCallback needs a TimeSliceClient, not {type(client).__name__} (the "
                "trainer's callbacks are called on its own thread, without an event loop)"
            )
        self.client = client
        self.modules = dict(modules or {})
        for tag in self.modules.keys() & {"weights", "optimizer"}:
            raise InvalidRequest(
                f"modules= tag {tag!r} is the integration's own (the model, the optimizer): name it otherwise",
                job_id=client.job_id,
            )
        self.node_id = node_id
        self.op_timeout_s = op_timeout_s
        self.device = device
        self.acquire_timeout_s = acquire_timeout_s
        self.handler = CountingHandler()  # what the agent's switches call; forwards to the TorchOffloadHandler
        self.channel: WorkloadChannel | None = None
        self._moved: tuple[int, ...] = ()  # ids of the objects the current TorchOffloadHandler moves
        self._lock = threading.Lock()  # the fields below: the trainer's thread and async reward functions' threads
        self._ours = False  # training is on: the callback keeps the group held, except at reward scoring
        self._away = 0  # wrapped reward functions running now
        self._owed = False  # the callback released for them and takes the group back when the last one returns
        self._figures = threading.Lock()  # the counters below (read without waiting for a hold being taken)
        self._acquires = 0
        self._releases = 0
        self._waited_ms = 0.0

    # ------------------------------------------------------------------ figures

    @property
    def counts(self) -> HoldCounts:
        with self._figures:
            return HoldCounts(self._acquires, self._releases, self._waited_ms, self.handler.counts)

    # ------------------------------------------------------------------ the reward functions

    def off_accelerators(self, fn: F) -> F:
        """``fn`` (a TRL reward function, plain or async) runs with the group released while training is on; the
        group is held again before the call returns. Reward functions running at once share one release."""
        if isinstance(fn, torch.nn.Module):
            raise InvalidRequest(
                f"{type(fn).__name__} is a reward model: it runs on the accelerators, so it stays "
                "inside the hold (pass it to the trainer unwrapped)"
            )
        if _is_async(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                await asyncio.to_thread(self._leave)
                try:
                    result = await fn(*args, **kwargs)
                except BaseException:
                    await asyncio.to_thread(self._come_back, failed=True)
                    raise
                await asyncio.to_thread(self._come_back, failed=False)
                return result

            return cast(F, run_async)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            self._leave()
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                self._come_back(failed=True)
                raise
            self._come_back(failed=False)
            return result

        return cast(F, run)

    def _leave(self) -> None:
        with self._lock:
            self._away += 1
            if self._away == 1 and self._ours and self.client.holding:
                self._release()
                self._owed = True

    def _come_back(self, *, failed: bool) -> None:
        with self._lock:
            self._away -= 1
            if self._away > 0 or not self._owed:
                return
            self._owed = False
            try:
                self._take()
            except TimeSliceError:
                if not failed:
                    raise
                log.warning("taking the group back after a failed reward function did not succeed", exc_info=True)

    # ------------------------------------------------------------------ the hold

    def _take(self) -> None:
        """Acquire (the caller holds ``_lock`` or is the trainer's thread with no reward function running)."""
        grant = self.client.acquire(self.acquire_timeout_s)
        with self._figures:
            self._acquires += 1
            self._waited_ms += grant.waited_ms

    def _release(self) -> None:
        self.client.release()
        with self._figures:
            self._releases += 1

    def _ensure_held(self) -> None:
        with self._lock:
            if self._ours and not self.client.holding:  # e.g. code of the job's own released it
                self._take()

    # ------------------------------------------------------------------ the trainer's events

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            raise InvalidRequest(
                "on_train_begin came without the trainer's model or optimizer: add the callback to "
                "a transformers Trainer (TRL's GRPOTrainer)",
                job_id=self.client.job_id,
            )
        if self.client.holding:
            raise InvalidRequest(
                f"job {self.client.job_id!r} already holds group {self.client.group_id!r} as training begins: the "
                "TRL integration takes and gives back the hold itself, so call trainer.train() outside "
                "client.on_accelerators() (and after client.release())",
                group_id=self.client.group_id,
                job_id=self.client.job_id,
            )
        optimizer = _plain_optimizer(optimizer)
        moved = (id(model), id(optimizer), *(id(m) for m in self.modules.values()))
        with self._lock:
            if self.channel is None:  # first train(): register before the first hold, so every switch moves us
                self.handler.replace(self._offload(model, optimizer))
                self._moved = moved
                self.channel = self.client.register_workload(
                    self.handler, node_id=self.node_id, op_timeout_s=self.op_timeout_s
                )
            self._take()
            self._ours = True
            if moved != self._moved:  # a later train() with new objects: swapped while their state is here
                self.handler.replace(self._offload(model, optimizer))
                self._moved = moved

    def _offload(self, model: Any, optimizer: Any) -> TorchOffloadHandler:
        return TorchOffloadHandler(
            modules={"weights": model, **self.modules}, optimizers={"optimizer": optimizer}, device=self.device
        )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ensure_held()  # generation (in the step's first training_step) runs in the hold

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ensure_held()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self._lock:
            self._ours = False
            if self.client.holding:
                self._release()


def attach(trainer: Any, client: TimeSliceClient, **options: Any) -> TimeSliceCallback:
    """Add a :class:`TimeSliceCallback` (``options`` are its keyword arguments) to ``trainer`` (a TRL
    ``GRPOTrainer``), wrap its Python reward functions with :meth:`~TimeSliceCallback.off_accelerators`, and move
    its reference model with the weights when it has one (tag ``ref``). Call it before ``trainer.train()``."""
    reward_funcs = getattr(trainer, "reward_funcs", None)
    if not isinstance(reward_funcs, list):
        raise InvalidRequest(
            f"{type(trainer).__name__} has no list of reward functions: attach() is for TRL's "
            "GRPOTrainer (for another Trainer, add a TimeSliceCallback yourself)"
        )
    handler = getattr(trainer, "callback_handler", None)
    if any(isinstance(cb, TimeSliceCallback) for cb in getattr(handler, "callbacks", ())):
        raise InvalidRequest(
            "this trainer has a TimeSliceCallback already: attach() once per trainer",
            group_id=client.group_id,
            job_id=client.job_id,
        )
    modules = dict(options.pop("modules", None) or {})
    ref = getattr(trainer, "ref_model", None)
    if isinstance(ref, torch.nn.Module) and "ref" not in modules:
        modules["ref"] = ref
    callback = TimeSliceCallback(client, modules=modules, **options)
    trainer.reward_funcs[:] = [
        f if isinstance(f, torch.nn.Module) else callback.off_accelerators(f) for f in reward_funcs
    ]  # TRL named them at init: the names stay
    trainer.add_callback(callback)
    return callback
