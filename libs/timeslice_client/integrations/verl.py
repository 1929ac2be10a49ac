"""veRL (volcengine/verl) on shared pools of accelerators: the phases of ``RayPPOTrainer.fit`` as holds, on one pool
(the hybrid engine: actor, rollout and reference colocated) or two (the actor's and the rollout's, as veRL's
``one_step_off_policy`` recipe places them). Imports no veRL: the trainer's loop calls these around its worker
groups' calls. ``examples/verl_timeslice.py`` is the loop with the calls in place.

What ``RayPPOTrainer.fit`` runs each step (volcengine/verl ``verl/trainer/ppo/ray_trainer.py``; the disaggregated
weight sync from ``recipe/one_step_off_policy/ray_trainer.py``), and where each runs:

==================  ====================================================================  ==================
phase               the trainer's calls                                                   held
==================  ====================================================================  ==================
rollout             ``actor_rollout_wg.generate_sequences(gen_batch)`` (hybrid: the       :meth:`rollout`
                    sharding manager loads the actor's weights into the engine first), or
                    ``rollout_wg`` / ``async_rollout_manager.generate_sequences``
reward model        ``rm_wg.compute_rm_score(batch)``                                     :meth:`reward_model`
reward              ``compute_reward(batch, reward_fn)``: rules, a sandbox, a judge        nothing: another
                    (on the driver or a Ray task, not the accelerators)                   job's turn
old / ref log-prob  ``actor_rollout_wg.compute_log_prob``, ``ref_policy_wg.               :meth:`update`
                    compute_ref_log_prob`` (or the actor's), ``critic_wg.compute_values``
advantage           ``compute_advantage`` on the driver (cheap; inside the update's hold)
update              ``critic_wg.update_critic``, ``actor_rollout_wg.update_actor``
weight sync         two pools: ``sync_rollout_weights()`` (``actor_wg.sync_rollout_       :meth:`weight_sync`
                    weights()`` + ``rollout_wg.sync_rollout_weights()``, an NCCL          (inside update)
                    broadcast from the actor pool to the rollout pool)
validate, save      ``_validate()`` (generation), ``_save_checkpoint()`` (the workers)    :meth:`validate`,
                                                                                          :meth:`save`
==================  ====================================================================  ==================

Each phase takes its pool when it begins and gives it back when it ends, unless an open phase still needs it
(:class:`~timeslice_client.integrations._phase_holds.PhaseHolds`): so the group changes hands at the reward (one
pool), and with two pools another job generates on the rollout pool while this one updates on the actor pool.
:meth:`weight_sync` opened inside :meth:`update` keeps the actor pool and adds the rollout pool, in the client's
one global order (docs/multi-pool.md): when the rollout pool's id sorts first, the actor pool is given back and
both are taken again in order (``counts.reorders``), so name the pools so that the actor's sorts first (veRL's
``actor_pool`` and ``rollout_pool`` do).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .._renamed import renamed_keywords
from .._sync_client import TimeSliceClient
from ._phase_holds import PhaseAdapter, PhaseCounts, PhaseHolds

__all__ = ["PHASES", "PhaseCounts", "VerlHolds"]

PHASES = ("rollout", "reward_model", "update", "weight_sync", "validate", "save")


class VerlHolds(PhaseAdapter):
    """The holds of ``RayPPOTrainer.fit``'s phases (see the module doc), through ``client`` (a
    :class:`TimeSliceClient`; its group is the default of every pool).

    ``actor_pool``: the group of the actor, critic and reference workers (update, log-probs, checkpoints).
    ``rollout_pool``: the rollout engines' (default: the actor pool: one pool, the hybrid engine).
    ``reward_pool``: the reward model's (default: the actor pool, veRL's default placement).
    ``acquire_timeout_s``: the bound of each phase's wait for its groups (default: the client's)."""

    @renamed_keywords(acquire_timeout="acquire_timeout_s")
    def __init__(
        self,
        client: TimeSliceClient,
        *,
        actor_pool: str | None = None,
        rollout_pool: str | None = None,
        reward_pool: str | None = None,
        acquire_timeout_s: float | None = None,
    ) -> None:
        self.client = client
        self.actor_pool = actor_pool or client.group_id
        self.rollout_pool = rollout_pool or self.actor_pool
        self.reward_pool = reward_pool or self.actor_pool
        self.holds = PhaseHolds(client, acquire_timeout_s=acquire_timeout_s)

    @property
    def colocated(self) -> bool:
        """One pool for the actor and the rollout (veRL's hybrid engine)."""
        return self.actor_pool == self.rollout_pool

    def pools(self, phase: str) -> tuple[str, ...]:
        """The groups ``phase`` holds."""
        by_phase = {
            "rollout": (self.rollout_pool,),
            "validate": (self.rollout_pool,),
            "reward_model": (self.reward_pool,),
            "update": (self.actor_pool,),
            "save": (self.actor_pool,),
            "weight_sync": tuple(sorted({self.actor_pool, self.rollout_pool})),
        }
        return self._lookup(by_phase, phase, f"veRL phase {phase!r}: the phases are {list(PHASES)}")

    @contextlib.contextmanager
    def phase(self, phase: str, *, keep: bool = False) -> Iterator[None]:
        """``with holds.phase("update"):``: the phase's pools held while the block runs. ``keep``: the next phase
        follows at once: its pools stay held into it when it needs them (given back when it begins if not)."""
        with self.holds.phase(phase, self.pools(phase), keep=keep):
            yield

    def rollout(self, *, keep: bool = False) -> contextlib.AbstractContextManager[None]:
        """Around ``generate_sequences`` (the hybrid engine's weight load into the engine happens in it). ``keep``:
        a reward model scores next (``use_rm``): with one pool the group stays held for it, instead of changing
        hands for the moment between the two."""
        return self.phase("rollout", keep=keep)

    def reward_model(self) -> contextlib.AbstractContextManager[None]:
        """Around ``rm_wg.compute_rm_score`` (a rule-based or remote reward needs no hold: call it outside)."""
        return self.phase("reward_model")

    def update(self) -> contextlib.AbstractContextManager[None]:
        """Around the old/ref log-probs, the values, the advantage and the critic's and actor's updates."""
        return self.phase("update")

    def weight_sync(self) -> contextlib.AbstractContextManager[None]:
        """Around ``sync_rollout_weights()`` (two pools); open it inside :meth:`update` to keep the actor pool."""
        return self.phase("weight_sync")

    def validate(self) -> contextlib.AbstractContextManager[None]:
        """Around ``_validate()``."""
        return self.phase("validate")

    def save(self) -> contextlib.AbstractContextManager[None]:
        """Around ``_save_checkpoint()``."""
        return self.phase("save")

    def close(self) -> None:
        """Give back everything held through these phases (after ``fit()``, or when it raised)."""
        self.holds.close()
