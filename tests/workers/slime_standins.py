"""Stand-ins of slime's driver and of the Ray actors it drives, for tests without slime, Ray or a GPU.

The drivers follow slime's own, call for call and phase for phase: :func:`train` is ``train.py`` and
:func:`train_async` is ``train_async.py`` of aishukamal/slime@feat/phase-callbacks (the fork with the phase-callback
protocol the reference project integrates with; THUDM/slime ``train.py`` is the same loop without the callbacks),
with ``ray.get`` as :func:`ray_get` and ``rollout_manager.generate.remote`` as :meth:`RolloutManager.generate_remote`
(a future of the rollout manager's own thread, so generation runs beside training as the asynchronous driver
expects). The actors keep their "device" state in numpy arrays (a ``NumpyOffloadHandler`` each, registered with the
node's agent when they are made, as the real actors would register theirs), so a phase that runs while its pool's
state is switched out fails, and a probe (``on_work``) sees which pool each call works on.

The arithmetic is deterministic: a run's final state depends only on its seed and steps, not on timing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
from timeslice_client.integrations._counting import CountingHandler
from timeslice_client.numpy_offload import NumpyOffloadHandler

T = TypeVar("T")
RAY_GET_TIMEOUT_S = 60.0  # a generation the driver waits for (the stand-in's own thread)
Work = Callable[[str, str], Any]  # on_work(pool, call) -> a context manager around the call's work


class PhaseCallback(Protocol):
    def on_phase_begin(self, phase: str, role: str, context: dict[str, Any] | None = None) -> None: ...
    def on_phase_end(self, phase: str, role: str, context: dict[str, Any] | None = None) -> None: ...
    def close(self) -> None: ...


@dataclass
class Args:
    """The slime arguments the drivers read (``slime/utils/arguments.py``'s names)."""

    num_rollout: int = 4
    start_rollout_id: int = 0
    eval_interval: int | None = None
    skip_eval_before_train: bool = True
    save_interval: int | None = None
    offload_rollout: bool = False
    offload_train: bool = False
    release_train: bool = False
    use_critic: bool = False
    num_critic_only_steps: int = 0
    update_weights_interval: int = 1
    check_weight_update_equal: bool = False
    colocate: bool = False
    # the stand-ins' own: the size of the state and the time each call stands for
    size: int = 4096
    gen_s: float = 0.05
    train_s: float = 0.05
    sync_s: float = 0.01
    seed: int = 0


def ray_get(value: T | concurrent.futures.Future[T]) -> T:
    """``ray.get``: the value of a remote call (a future of the rollout manager's thread, or the value itself)."""
    if isinstance(value, concurrent.futures.Future):
        return value.result(RAY_GET_TIMEOUT_S)
    return value


def _nowork(pool: str, call: str) -> Any:
    return contextlib.nullcontext()


@dataclass
class Actors:
    """What slime's ``create_rollout_manager`` and ``create_training_models`` make, and where their state lives."""

    args: Args
    on_work: Work = _nowork
    register: Callable[[str, CountingHandler], None] | None = None  # (role, handler): the agent of that pool
    rollout_manager: RolloutManager | None = None
    actor_model: ActorModel | None = None
    handlers: dict[str, CountingHandler] = field(default_factory=dict)

    def create(self) -> tuple[RolloutManager, ActorModel]:
        a = self.args
        rng = np.random.default_rng(a.seed)
        actor = ActorModel(self, rng.standard_normal(a.size), np.zeros(a.size))
        rollout = RolloutManager(self, np.zeros(a.size), np.zeros(a.size))
        if a.colocate:  # one pool: one registration of the job's on the one node
            self.handlers["trainer"] = CountingHandler(
                NumpyOffloadHandler(
                    weights=[actor.weights], optimizer=[actor.moment], engine=[rollout.served, rollout.kv]
                )
            )
        else:
            self.handlers["trainer"] = CountingHandler(
                NumpyOffloadHandler(weights=[actor.weights], optimizer=[actor.moment])
            )
            self.handlers["sampler"] = CountingHandler(NumpyOffloadHandler(engine=[rollout.served, rollout.kv]))
        if self.register is not None:
            for role, handler in self.handlers.items():
                self.register(role, handler)
        self.rollout_manager, self.actor_model = rollout, actor
        return rollout, actor

    def digest(self) -> str:
        assert self.actor_model is not None and self.rollout_manager is not None
        h = hashlib.sha256()
        for a in (self.actor_model.weights, self.actor_model.moment, self.rollout_manager.served):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()


class RolloutManager:
    """slime's ``RolloutManager`` Ray actor (``slime/ray/rollout.py``): its SGLang engines, on the sampler pool."""

    def __init__(self, actors: Actors, served: np.ndarray[Any, Any], kv: np.ndarray[Any, Any]) -> None:
        self._actors = actors
        self.served = served  # the engines' weights
        self.kv = kv  # their KV cache
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-manager")
        self.calls: list[str] = []

    def _work(self, call: str) -> Any:
        self.calls.append(call)
        return self._actors.on_work("sampler", call)

    def generate(self, rollout_id: int) -> np.ndarray[Any, Any]:
        with self._work("generate"):
            time.sleep(self._actors.args.gen_s)  # stands for the engines' generation
            self.kv[:] = np.tanh(self.served * 0.5 + 0.01 * (rollout_id + 1))
            return self.kv.copy()  # the rollout data (lives in Ray's object store, not on the device)

    def generate_remote(self, rollout_id: int) -> concurrent.futures.Future[np.ndarray[Any, Any]]:
        """``rollout_manager.generate.remote(rollout_id)``."""
        return self._thread.submit(self.generate, rollout_id)

    def eval(self, rollout_id: int) -> float:
        with self._work("eval"):
            return float(np.abs(self.served).mean())

    def offload(self) -> None:
        with self._work("offload"):
            pass

    def onload_weights(self) -> None:
        with self._work("onload_weights"):
            pass

    def onload_kv(self) -> None:
        with self._work("onload_kv"):
            pass

    def save(self, rollout_id: int) -> None:
        self.calls.append("save")

    def dispose(self) -> None:
        self.calls.append("dispose")
        self._thread.shutdown(wait=True)


class ActorModel:
    """slime's ``RayTrainGroup`` of Megatron actors (``slime/ray/actor_group.py``), on the trainer pool."""

    def __init__(self, actors: Actors, weights: np.ndarray[Any, Any], moment: np.ndarray[Any, Any]) -> None:
        self._actors = actors
        self.weights = weights
        self.moment = moment
        self.calls: list[str] = []

    def _work(self, pool: str, call: str) -> Any:
        self.calls.append(call)
        return self._actors.on_work(pool, call)

    def async_train(self, rollout_id: int, rollout_data_ref: np.ndarray[Any, Any]) -> list[None]:
        with self._work("trainer", "async_train"):
            time.sleep(self._actors.args.train_s)  # stands for forward, backward and the optimizer step
            grad = self.weights - rollout_data_ref
            self.moment *= 0.9
            self.moment += 0.1 * grad
            self.weights -= 0.05 * self.moment
            return [None]  # the actors' refs; the driver ray.get()s them

    def update_weights(self) -> None:
        """The trainer broadcasts its weights to the engines (NCCL): both pools at once."""
        with self._work("trainer", "update_weights"), self._work("sampler", "update_weights"):
            time.sleep(self._actors.args.sync_s)
            assert self._actors.rollout_manager is not None
            self._actors.rollout_manager.served[:] = self.weights

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        with self._work("trainer", "save_model"):
            float(self.weights.sum())

    def clear_memory(self) -> None:
        with self._work("trainer", "clear_memory"):
            pass

    def offload(self) -> None:
        with self._work("trainer", "offload"):
            pass

    def create(self) -> None:
        with self._work("trainer", "create"):
            pass


def should_run_periodic_action(
    rollout_id: int, interval: int | None, num_rollout_per_epoch: int | None, num_rollout: int | None = None
) -> bool:
    """``slime.utils.misc.should_run_periodic_action``."""
    if interval is None:
        return False
    last = num_rollout is not None and rollout_id == num_rollout - 1
    epoch_end = num_rollout_per_epoch is not None and (rollout_id + 1) % num_rollout_per_epoch == 0
    return (rollout_id + 1) % interval == 0 or epoch_end or last


def train(args: Args, actors: Actors, phase_cb: PhaseCallback | None) -> None:
    """aishukamal/slime ``train.py`` (the synchronous driver), phase for phase."""
    release_train = args.release_train
    if phase_cb:
        phase_cb.on_phase_begin("init", "both")
    rollout_manager, actor_model = actors.create()  # create_placement_groups, _rollout_manager, _training_models
    num_rollout_per_epoch = None
    if args.offload_rollout and not release_train:
        ray_get(rollout_manager.onload_weights())
    actor_model.update_weights()  # always update weight first so that sglang has the loaded weights from training
    if args.offload_rollout:
        ray_get(rollout_manager.onload_kv())
    if phase_cb:
        phase_cb.on_phase_end("init", "both")

    for rollout_id in range(args.start_rollout_id, args.num_rollout):
        ctx = {"rollout_id": rollout_id}
        if args.eval_interval is not None and rollout_id == 0 and not args.skip_eval_before_train:
            _phase(phase_cb, "eval", "sampler", ctx, rollout_manager.eval, rollout_id)
        if phase_cb:
            phase_cb.on_phase_begin("generate", "sampler", ctx)
        rollout_data_ref = ray_get(rollout_manager.generate_remote(rollout_id))
        if phase_cb:
            phase_cb.on_phase_end("generate", "sampler", ctx)
        if args.offload_rollout:
            _phase(phase_cb, "offload", "sampler", ctx, rollout_manager.offload)
        if release_train:
            _phase(phase_cb, "create", "trainer", ctx, actor_model.create)
        if phase_cb:
            phase_cb.on_phase_begin("train", "trainer", ctx)
        ray_get(actor_model.async_train(rollout_id, rollout_data_ref))
        if release_train or should_run_periodic_action(
            rollout_id, args.save_interval, num_rollout_per_epoch, args.num_rollout
        ):
            actor_model.save_model(rollout_id, force_sync=release_train or rollout_id == args.num_rollout - 1)
        if not args.offload_train:
            actor_model.clear_memory()
        if phase_cb:
            phase_cb.on_phase_end("train", "trainer", ctx)
        if args.offload_rollout and not release_train:
            _phase(phase_cb, "onload", "sampler", ctx, rollout_manager.onload_weights)
        if phase_cb:
            phase_cb.on_phase_begin("weight_sync", "both", ctx)
        actor_model.update_weights()
        if phase_cb:
            phase_cb.on_phase_end("weight_sync", "both", ctx)
        if args.offload_rollout:
            _phase(phase_cb, "onload", "sampler", ctx, rollout_manager.onload_kv)
        if should_run_periodic_action(rollout_id, args.eval_interval, num_rollout_per_epoch):
            _phase(phase_cb, "eval", "sampler", ctx, rollout_manager.eval, rollout_id)

    if phase_cb:
        phase_cb.close()
    ray_get(rollout_manager.dispose())


def train_async(args: Args, actors: Actors, phase_cb: PhaseCallback | None) -> None:
    """aishukamal/slime ``train_async.py`` (the next generation runs beside training), phase for phase."""
    assert not args.colocate, "Colocation is not supported for async training."
    release_train = args.release_train
    if phase_cb:
        phase_cb.on_phase_begin("init", "both")
    rollout_manager, actor_model = actors.create()
    num_rollout_per_epoch = None
    actor_model.update_weights()
    if phase_cb:
        phase_cb.on_phase_end("init", "both")

    if phase_cb:
        phase_cb.on_phase_begin("generate", "sampler", {"rollout_id": args.start_rollout_id})
    rollout_data_next_future: concurrent.futures.Future[np.ndarray[Any, Any]] | None = rollout_manager.generate_remote(
        args.start_rollout_id
    )
    rollout_data_curr_ref: np.ndarray[Any, Any] | None = None
    for rollout_id in range(args.start_rollout_id, args.num_rollout):
        ctx = {"rollout_id": rollout_id}
        if rollout_data_next_future is not None:  # collect the pending generation (its sampler hold began)
            rollout_data_curr_ref = ray_get(rollout_data_next_future)
            rollout_data_next_future = None
            if phase_cb:
                phase_cb.on_phase_end("generate", "sampler", ctx)
        if release_train:
            _phase(phase_cb, "create", "trainer", ctx, actor_model.create)
        if phase_cb:
            phase_cb.on_phase_begin("train", "trainer", ctx)
        if rollout_id + 1 < args.num_rollout:  # dispatch the next generation while training
            if phase_cb:
                phase_cb.on_phase_begin("generate", "sampler", {"rollout_id": rollout_id + 1})
            rollout_data_next_future = rollout_manager.generate_remote(rollout_id + 1)
        assert rollout_data_curr_ref is not None
        ray_get(actor_model.async_train(rollout_id, rollout_data_curr_ref))
        if release_train or should_run_periodic_action(
            rollout_id, args.save_interval, num_rollout_per_epoch, args.num_rollout
        ):
            actor_model.save_model(rollout_id, force_sync=release_train or rollout_id == args.num_rollout - 1)
        if phase_cb:
            phase_cb.on_phase_end("train", "trainer", ctx)
        if release_train or (rollout_id + 1) % args.update_weights_interval == 0:
            if rollout_data_next_future is not None:  # collect the pending generation before the weight sync
                rollout_data_curr_ref = ray_get(rollout_data_next_future)
                rollout_data_next_future = None
                if phase_cb:
                    phase_cb.on_phase_end("generate", "sampler", ctx)
            if phase_cb:
                phase_cb.on_phase_begin("weight_sync", "both", ctx)
            actor_model.update_weights()
            if phase_cb:
                phase_cb.on_phase_end("weight_sync", "both", ctx)
        if should_run_periodic_action(rollout_id, args.eval_interval, num_rollout_per_epoch):
            _phase(phase_cb, "eval", "sampler", ctx, rollout_manager.eval, rollout_id)

    if phase_cb:
        phase_cb.close()
    ray_get(rollout_manager.dispose())


def _phase(
    phase_cb: PhaseCallback | None, phase: str, role: str, ctx: dict[str, Any], call: Callable[..., object], *args: Any
) -> None:
    """``if phase_cb: phase_cb.on_phase_begin(...)``, the call, ``if phase_cb: phase_cb.on_phase_end(...)``."""
    if phase_cb:
        phase_cb.on_phase_begin(phase, role, ctx)
    ray_get(call(*args))
    if phase_cb:
        phase_cb.on_phase_end(phase, role, ctx)
