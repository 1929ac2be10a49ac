"""A veRL PPO job's training loop with timeslice's holds in place (docs/integrations.md, "veRL").

:func:`fit` is ``RayPPOTrainer.fit`` (volcengine/verl ``verl/trainer/ppo/ray_trainer.py``), abridged to its calls on
the worker groups, in its order, with the lines that share the accelerators marked ``# timeslice``: put them at the
same places in a subclass's ``fit`` (or in veRL's file). The two-pool weight sync is the one of veRL's
``one_step_off_policy`` recipe (``recipe/one_step_off_policy/ray_trainer.py``: ``sync_rollout_weights()``, an NCCL
broadcast from the actor's workers to the rollout's). Everything else here stands in for veRL, so that the file runs
without it (and without a GPU): worker groups with veRL's method names, whose "device" state is numpy arrays that
the node's agent moves (:func:`register`; in veRL each worker registers its own, in its process).

With the stack running (``./scripts/timeslice up``), two jobs on one pool (the hybrid engine)::

    python examples/verl_timeslice.py --job ppo-a --seed 1 &
    python examples/verl_timeslice.py --job ppo-b --seed 2

or on two (actor and rollout; each pool's state registered with the agent of the node it lives on)::

    python examples/verl_timeslice.py --job ppo-a --seed 1 --actor-pool actor-pool --rollout-pool rollout-pool &
    python examples/verl_timeslice.py --job ppo-b --seed 2 --actor-pool actor-pool --rollout-pool rollout-pool

``--plain`` runs the same job without timeslice (the baseline: the same final state, bit for bit).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from timeslice_client import TimeSliceClient
from timeslice_client.integrations._counting import CountingHandler
from timeslice_client.integrations.verl import VerlHolds
from timeslice_client.numpy_offload import NumpyOffloadHandler

Array = np.ndarray[Any, Any]


class Holds(Protocol):
    """What :func:`fit` asks of its holds: :class:`VerlHolds`, or :class:`Unshared` for a run without timeslice."""

    def rollout(self, *, keep: bool = False) -> contextlib.AbstractContextManager[None]: ...
    def reward_model(self) -> contextlib.AbstractContextManager[None]: ...
    def update(self) -> contextlib.AbstractContextManager[None]: ...
    def weight_sync(self) -> contextlib.AbstractContextManager[None]: ...


# --------------------------------------------------------------------------- the loop


def fit(trainer: Trainer, holds: Holds) -> None:
    """``RayPPOTrainer.fit``: the same calls in the same order, plus the holds (``# timeslice``)."""
    if not trainer.hybrid_engine:  # one_step_off_policy: "after load checkpoint sync rollout weights"
        with holds.weight_sync():  # timeslice: both pools
            trainer.sync_rollout_weights()
    for step, batch_dict in enumerate(trainer.train_dataloader(), start=1):
        batch = DataProto.from_single_dict(batch_dict)
        gen_batch = batch.pop(["input_ids"])
        with holds.rollout(keep=trainer.use_rm):  # timeslice: the rollout pool (the one pool: hybrid engine)
            if trainer.hybrid_engine:  # the sharding manager loads the actor's weights into the engine first
                gen_batch_output = trainer.actor_rollout_wg.generate_sequences(gen_batch)
            else:
                gen_batch_output = trainer.rollout_wg.generate_sequences(gen_batch)
        batch = batch.union(gen_batch_output)
        if trainer.use_rm:
            with holds.reward_model():  # timeslice: the reward model's pool
                batch = batch.union(trainer.rm_wg.compute_rm_score(batch))
        # The reward function (rules, a sandbox, a remote judge) runs off the accelerators: no hold, so another
        # job generates or updates meanwhile, and the agent moves this job's state out and back.
        reward_tensor = compute_reward(batch, trainer.reward_fn)
        with holds.update():  # timeslice: the actor pool, from the old log-probs to the actor's update
            batch = batch.union(trainer.actor_rollout_wg.compute_log_prob(batch))
            if trainer.use_reference_policy:
                batch = batch.union(trainer.ref_policy_wg.compute_ref_log_prob(batch))
            if trainer.use_critic:
                batch = batch.union(trainer.critic_wg.compute_values(batch))
            batch.batch["token_level_scores"] = reward_tensor
            batch = compute_advantage(batch)  # on the driver: cheap, inside the hold
            if trainer.use_critic:
                trainer.critic_wg.update_critic(batch)
            trainer.actor_rollout_wg.update_actor(batch)
            if not trainer.hybrid_engine:
                with holds.weight_sync():  # timeslice: adds the rollout pool, keeping the actor pool
                    trainer.sync_rollout_weights()
        if step >= trainer.total_training_steps:
            return


class Unshared:
    """No holds: the job alone on its accelerators (``--plain``, and the baseline of the tests)."""

    def rollout(self, *, keep: bool = False) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    reward_model = update = weight_sync = rollout


# --------------------------------------------------------------------------- stand-ins of veRL

Work = Callable[[str, str], contextlib.AbstractContextManager[None]]  # on_work(pool, call) around a call's work


def _nowork(pool: str, call: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


@dataclass
class DataProto:
    """``verl.DataProto``, as much as the loop uses: named arrays, ``pop``, ``union``."""

    batch: dict[str, Array] = field(default_factory=dict)

    @classmethod
    def from_single_dict(cls, data: dict[str, Array]) -> DataProto:
        return cls(dict(data))

    def pop(self, keys: list[str]) -> DataProto:
        return DataProto({k: self.batch.pop(k) for k in keys})

    def union(self, other: DataProto) -> DataProto:
        return DataProto({**self.batch, **other.batch})


@dataclass
class Timing:
    """The time each call stands for (s)."""

    generate: float = 0.1
    log_prob: float = 0.02
    update: float = 0.08
    reward: float = 0.1  # the reward function's (CPU)
    sync: float = 0.01


class WorkerGroup:
    """A ``RayWorkerGroup``: its calls run on the workers of one pool (``pool``: actor, rollout or reward)."""

    def __init__(self, pool: str, timing: Timing, on_work: Work) -> None:
        self.pool, self.timing, self._on_work = pool, timing, on_work

    def _work(self, call: str, seconds: float) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def work() -> Iterator[None]:
            with self._on_work(self.pool, call):
                time.sleep(seconds)  # stands for the workers' compute
                yield

        return work()


class RolloutWorkerGroup(WorkerGroup):
    """The rollout's engines (vLLM, SGLang): ``generate_sequences``; two pools: ``sync_rollout_weights``."""

    def __init__(self, pool: str, timing: Timing, on_work: Work, dim: int, batch: int) -> None:
        super().__init__(pool, timing, on_work)
        self.served = np.zeros(dim)  # the engine's weights
        self.kv = np.zeros((batch, dim))  # its KV cache

    def generate_sequences(self, gen_batch: DataProto) -> DataProto:
        with self._work("generate_sequences", self.timing.generate):
            self.kv[:] = np.tanh(gen_batch.batch["input_ids"] * self.served)
            return DataProto({"responses": self.kv.copy()})

    def receive(self, weights: Array) -> None:
        with self._work("sync_rollout_weights", self.timing.sync):
            self.served[:] = weights


class ActorWorkerGroup(WorkerGroup):
    """The actor's FSDP/Megatron workers: ``compute_log_prob``, ``update_actor``; with the hybrid engine also the
    rollout (``generate_sequences``) and the reference (``compute_ref_log_prob``, ``ref_in_actor``)."""

    def __init__(
        self, pool: str, timing: Timing, on_work: Work, dim: int, seed: int, rollout: RolloutWorkerGroup | None = None
    ) -> None:
        super().__init__(pool, timing, on_work)
        self.weights = np.random.default_rng(seed).standard_normal(dim) * 0.5
        self.moment = np.zeros(dim)
        self.rollout = rollout  # the hybrid engine's, in the same workers

    def generate_sequences(self, gen_batch: DataProto) -> DataProto:
        assert self.rollout is not None, "generate_sequences on the actor needs the hybrid engine"
        with self._work("load_weights_into_engine", 0.0):  # the sharding manager, on entry
            self.rollout.served[:] = self.weights
        return self.rollout.generate_sequences(gen_batch)

    def compute_log_prob(self, batch: DataProto) -> DataProto:
        with self._work("compute_log_prob", self.timing.log_prob):
            r = batch.batch["responses"]
            return DataProto({"old_log_probs": -0.01 * ((r - self.weights) ** 2).sum(axis=1)})

    def update_actor(self, batch: DataProto) -> DataProto:
        with self._work("update_actor", self.timing.update):
            grad = (batch.batch["advantages"][:, None] * batch.batch["responses"]).mean(axis=0)
            self.moment *= 0.9
            self.moment += 0.1 * grad
            self.weights += 0.05 * self.moment
            return DataProto()

    def send_weights(self) -> Array:
        with self._work("sync_rollout_weights", self.timing.sync):
            return self.weights.copy()


class RefPolicyWorkerGroup(WorkerGroup):
    def __init__(self, pool: str, timing: Timing, on_work: Work, weights: Array) -> None:
        super().__init__(pool, timing, on_work)
        self.weights = weights.copy()  # frozen: the initial policy

    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        with self._work("compute_ref_log_prob", self.timing.log_prob):
            r = batch.batch["responses"]
            return DataProto({"ref_log_prob": -0.01 * ((r - self.weights) ** 2).sum(axis=1)})


class CriticWorkerGroup(WorkerGroup):
    def __init__(self, pool: str, timing: Timing, on_work: Work, dim: int) -> None:
        super().__init__(pool, timing, on_work)
        self.weights = np.zeros(dim)
        self.moment = np.zeros(dim)

    def compute_values(self, batch: DataProto) -> DataProto:
        with self._work("compute_values", self.timing.log_prob):
            return DataProto({"values": batch.batch["responses"] @ self.weights})

    def update_critic(self, batch: DataProto) -> DataProto:
        with self._work("update_critic", self.timing.update):
            err = batch.batch["values"] - batch.batch["returns"]
            self.moment *= 0.9
            self.moment += 0.1 * (err[:, None] * batch.batch["responses"]).mean(axis=0)
            self.weights -= 0.05 * self.moment
            return DataProto()


class RewardModelWorkerGroup(WorkerGroup):
    def __init__(self, pool: str, timing: Timing, on_work: Work, dim: int) -> None:
        super().__init__(pool, timing, on_work)
        self.weights = np.linspace(-1.0, 1.0, dim).copy()  # its own memory (the agent resizes it in place)

    def compute_rm_score(self, batch: DataProto) -> DataProto:
        with self._work("compute_rm_score", self.timing.log_prob):
            return DataProto({"rm_scores": batch.batch["responses"] @ self.weights / len(self.weights)})


def compute_reward(batch: DataProto, reward_fn: Callable[[DataProto], Array]) -> Array:
    """``verl.trainer.ppo.reward.compute_reward``: the reward function, on the driver."""
    return reward_fn(batch)


def compute_advantage(batch: DataProto) -> DataProto:
    """``compute_advantage`` (GAE-free, per sequence): on the driver."""
    b = batch.batch
    scores = b["token_level_scores"] + b.get("rm_scores", 0.0)
    kl = b["old_log_probs"] - b.get("ref_log_prob", b["old_log_probs"])
    returns = scores - 0.1 * kl
    values = b.get("values", np.zeros_like(returns))
    return batch.union(DataProto({"advantages": returns - values, "returns": returns}))


@dataclass
class Trainer:
    """The attributes of a ``RayPPOTrainer`` that :func:`fit` reads, made of the stand-ins above."""

    hybrid_engine: bool
    actor_rollout_wg: ActorWorkerGroup
    rollout_wg: RolloutWorkerGroup
    ref_policy_wg: RefPolicyWorkerGroup
    critic_wg: CriticWorkerGroup
    rm_wg: RewardModelWorkerGroup
    reward_fn: Callable[[DataProto], Array]
    total_training_steps: int
    seed: int
    batch_size: int
    dim: int
    use_rm: bool = True
    use_reference_policy: bool = True
    use_critic: bool = True

    def train_dataloader(self) -> Iterator[dict[str, Array]]:
        rng = np.random.default_rng(1000 + self.seed)
        for _ in range(self.total_training_steps):
            yield {"input_ids": rng.standard_normal((self.batch_size, self.dim))}

    def sync_rollout_weights(self) -> None:
        """one_step_off_policy's: ``actor_wg.sync_rollout_weights()``; ``ray.get(rollout_wg.sync_rollout_...)``."""
        self.rollout_wg.receive(self.actor_rollout_wg.send_weights())

    def state(self) -> dict[str, list[Array]]:
        """The device state, by pool: what the workers register with their node's agent."""
        a, r = self.actor_rollout_wg, self.rollout_wg
        return {
            "actor": [
                a.weights,
                a.moment,
                self.ref_policy_wg.weights,
                self.critic_wg.weights,
                self.critic_wg.moment,
                self.rm_wg.weights,
            ],
            "rollout": [r.served, r.kv],
        }

    def digest(self) -> str:
        h = hashlib.sha256()
        for arrays in self.state().values():
            for arr in arrays:
                h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()


def build(
    *,
    seed: int,
    steps: int,
    colocated: bool,
    timing: Timing | None = None,
    on_work: Work = _nowork,
    dim: int = 512,
    batch_size: int = 8,
) -> Trainer:
    t = timing or Timing()
    rollout = RolloutWorkerGroup("rollout", t, on_work, dim, batch_size)
    actor = ActorWorkerGroup("actor", t, on_work, dim, seed, rollout if colocated else None)

    def reward_fn(batch: DataProto) -> Array:
        time.sleep(t.reward)  # a sandbox or a judge: the other job's turn on the accelerators
        return -((batch.batch["responses"] - 0.5) ** 2).mean(axis=1)

    return Trainer(
        colocated,
        actor,
        rollout,
        RefPolicyWorkerGroup("actor", t, on_work, actor.weights),
        CriticWorkerGroup("actor", t, on_work, dim),
        RewardModelWorkerGroup("reward", t, on_work, dim),
        reward_fn,
        steps,
        seed,
        batch_size,
        dim,
    )


def register(
    client: TimeSliceClient, holds: VerlHolds, trainer: Trainer, nodes: dict[str, str | None]
) -> dict[str, CountingHandler]:
    """Register the trainer's state with the agents (``nodes``: by pool, actor and rollout), so that each switch
    of a pool moves that pool's state. One pool: one registration (an agent keeps one context per job)."""
    state = trainer.state()
    if holds.colocated:
        parts = {"actor": NumpyOffloadHandler(actor=state["actor"], rollout=state["rollout"])}
    else:
        parts = {
            "actor": NumpyOffloadHandler(actor=state["actor"]),
            "rollout": NumpyOffloadHandler(rollout=state["rollout"]),
        }
    handlers = {pool: CountingHandler(h) for pool, h in parts.items()}
    for pool, h in handlers.items():
        group = holds.actor_pool if pool == "actor" else holds.rollout_pool
        client.register_workload(h, node_id=nodes[pool], group_id=group)
    return handlers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", default="ppo-a")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--actor-pool", default="gpus-0")
    p.add_argument("--rollout-pool", default=None, help="two pools: the rollout's (default: the actor's)")
    p.add_argument("--node-id", default=os.environ.get("TIMESLICE_NODE_ID"), help="the actor pool's node")
    p.add_argument("--rollout-node-id", default=None, help="the rollout pool's node (default: --node-id)")
    p.add_argument("--reward-ms", type=float, default=100.0)
    p.add_argument("--plain", action="store_true", help="without timeslice (the baseline)")
    a = p.parse_args()
    colocated = a.rollout_pool in (None, a.actor_pool)
    trainer = build(seed=a.seed, steps=a.steps, colocated=colocated, timing=Timing(reward=a.reward_ms / 1000))
    start = time.monotonic()
    if a.plain:
        fit(trainer, Unshared())
        print(f"{a.job}: {a.steps} steps in {time.monotonic() - start:.2f} s (plain); state sha256 {trainer.digest()}")
        return
    with TimeSliceClient(a.job, a.actor_pool, bind_process=False) as client:
        holds = VerlHolds(client, actor_pool=a.actor_pool, rollout_pool=a.rollout_pool)
        handlers = register(client, holds, trainer, {"actor": a.node_id, "rollout": a.rollout_node_id or a.node_id})
        try:
            fit(trainer, holds)
        finally:
            holds.close()
        took = time.monotonic() - start
        with client.on_accelerators(groups=sorted({holds.actor_pool, holds.rollout_pool})):
            digest = trainer.digest()  # in a hold: the state may have been switched out since fit() returned
            moved = sum(h.counts.suspends for h in handlers.values())
        c = holds.counts
        print(
            f"{a.job}: {a.steps} steps in {took:.2f} s; {c.acquires} holds, waited {c.waited_ms / 1000:.2f} s; "
            f"moved out {moved}x; state sha256 {digest}"
        )


if __name__ == "__main__":
    main()
