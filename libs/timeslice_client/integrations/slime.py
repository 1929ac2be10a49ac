"""slime (THUDM/slime) on shared pools of accelerators: a phase callback that holds the job's groups at the driver's
phase boundaries, with our native client. Imports no slime: it has slime's ``PhaseCallback`` methods.

slime's driver (``train.py``; ``train_async.py`` pipelines the next rollout with training) runs everything on the
accelerators through Ray actors: the rollout manager's SGLang engines (``rollout_manager.generate/eval/offload/
onload_weights/onload_kv``, the *sampler* pool) and the Megatron actor (``actor_model.async_train/save_model/
update_weights``, the *trainer* pool). The phase-callback protocol (``slime/utils/phase_callback.py``, with
``--phase-callback-path``, in the fork the reference project integrates with: aishukamal/slime@feat/phase-callbacks,
``train.py``, ``train_async.py``) brackets each of them with ``on_phase_begin(phase, role, context)`` /
``on_phase_end(phase, role, context)`` and calls ``close()`` after the loop. The roles say which pool a phase uses:

===============  =======  ==============================================================================
phase            role     the driver's calls inside it
===============  =======  ==============================================================================
``init``         both     create the placement groups, the rollout manager and the actor; the first
                          ``update_weights`` (trainer to sampler, NCCL)
``generate``     sampler  ``rollout_manager.generate(rollout_id)`` (rollouts and their rewards)
``offload``      sampler  ``rollout_manager.offload()`` (``--offload-rollout``)
``create``       trainer  ``actor_model.create()`` (``--release-train``)
``train``        trainer  ``actor_model.async_train``, ``save_model``, ``clear_memory``
``onload``       sampler  ``rollout_manager.onload_weights()`` / ``onload_kv()`` (``--offload-rollout``)
``weight_sync``  both     ``actor_model.update_weights()``: the trainer broadcasts to the engines (NCCL)
``eval``         sampler  ``rollout_manager.eval(rollout_id)``
===============  =======  ==============================================================================

:class:`TimeSliceCallback` maps the roles onto groups (two pools: ``trainer`` and ``sampler`` are two groups, and
``both`` takes the two at once; one pool, slime's ``--colocate``: every role is the one group) and holds them with
:class:`~timeslice_client.integrations._phase_holds.PhaseHolds`: a phase's begin takes what it needs, its end gives
back what no open phase needs. So each pool is held exactly while the driver works on it, and another job uses it
in between: job B generates on the sampler pool while job A trains on the trainer pool. Several groups at once are
taken in the client's one global order (docs/multi-pool.md), so jobs never deadlock on the two pools. Two
refinements: the trainer pool is kept from ``train`` into the ``weight_sync`` that follows it in the synchronous
driver (when the trainer's group sorts first, so that the sync only adds the sampler's); and with one pool the group
is kept from phase to phase and changes hands once a rollout (``turn="rollout"``), since one pool has nothing to
overlap and each handoff moves the whole state.

Use it as slime's callback (the whole change to a slime job)::

    python train.py ... --phase-callback-path timeslice_client.integrations.slime.TimeSliceCallback
    # TIMESLICE_JOB_ID=job-a TIMESLICE_TRAINER_GROUP=a-trainer TIMESLICE_SAMPLER_GROUP=b-sampler (two pools:
    # name them so that the trainer's sorts first), or TIMESLICE_GROUP=gpus-0 (one pool); TIMESLICE_NATS_URL as
    # for any client

or with a client of your own (``TimeSliceCallback(client, trainer_group=..., sampler_group=...)``; the client's own
group is the default for both), calling ``on_phase_begin``/``on_phase_end`` or ``with callback.phase("train",
"trainer", rollout_id):`` where the driver's loop has no callbacks (THUDM/slime's ``train.py`` before the protocol).

What moves on a switch is registered by the processes that hold it, with their node's agent: each Megatron actor
its model and optimizer (``TorchOffloadHandler``), each SGLang engine its weights and KV cache (the in-process
handler of :mod:`timeslice_client.sglang_engine`), through a client of the job in the actor's process that never
acquires (``TimeSliceClient(job_id, group_id, bind_process=False).register_workload(handler, node_id=...)``);
:meth:`TimeSliceCallback.register` does it for state living in the driver's process. slime's own
``--offload-train``/``--offload-rollout`` do the same moves at every step, whether or not another job waits: leave
them off (the reference project found they conflict with whole-process checkpoints).

The reference project (llm-d-incubation/llm-d-rl-time-slicing) integrates through the same protocol with its
``timeslice_slime`` package (``pkg/integrations/slime/timeslice_slime/callback.py`` and ``locks.py``): one gRPC
client per role, ``Acquire(job_id, group_id)`` at a phase's begin, ``Yield(job_id, group_id)`` at its end, trainer
before sampler. That package runs unchanged against our gRPC API (``tests/test_slime_adapter.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from .._renamed import renamed_keywords
from .._sync_client import TimeSliceClient
from ..errors import InvalidRequest
from ..handlers import WorkloadHandler
from ..workload import WorkloadChannel
from ._phase_holds import PhaseAdapter, PhaseCounts, PhaseHolds

__all__ = ["ENV", "ROLES", "TURNS", "PhaseCounts", "TimeSliceCallback"]

log = logging.getLogger("timeslice.integrations.slime")

ROLES = ("trainer", "sampler", "both")
TURNS = ("phase", "rollout")
ENV = {
    "job": "TIMESLICE_JOB_ID",  # the job's id (required)
    "trainer": "TIMESLICE_TRAINER_GROUP",  # two pools: the trainer's group ...
    "sampler": "TIMESLICE_SAMPLER_GROUP",  # ... and the sampler's
    "group": "TIMESLICE_GROUP",  # one pool (slime's --colocate): every role's group
    "timeout": "TIMESLICE_ACQUIRE_TIMEOUT",  # seconds a phase waits for its groups (default: the client's, 600)
}


class TimeSliceCallback(PhaseAdapter):
    """slime's ``PhaseCallback``, holding the job's groups phase by phase (see the module doc).

    ``TimeSliceCallback()`` (what slime's ``--phase-callback-path`` makes) reads the environment (:data:`ENV`) and
    makes its own client, closed by :meth:`close` (or at exit). ``TimeSliceCallback(client, trainer_group=...,
    sampler_group=...)`` uses ``client`` (its group is the default of both; the caller closes it).
    ``acquire_timeout_s``: the bound of each phase's wait for its groups (default: the client's). ``turn``: how long a
    job keeps a pool once it has it: ``"phase"`` (two pools' default) gives each group back at the end of every
    phase that used it, so the other job's phase on that pool runs while this job works on the other pool;
    ``"rollout"`` (one pool's default) keeps it from phase to phase and gives it back when a phase of the next
    rollout begins (``context["rollout_id"]`` changes), so that the one pool changes hands once a rollout, not at
    every phase (with one pool there is nothing to overlap, and every handoff moves the whole state)."""

    @renamed_keywords(acquire_timeout="acquire_timeout_s")
    def __init__(
        self,
        client: TimeSliceClient | None = None,
        *,
        trainer_group: str | None = None,
        sampler_group: str | None = None,
        acquire_timeout_s: float | None = None,
        turn: str | None = None,
    ) -> None:
        self._own = client is None
        if client is None:
            client, trainer_group, sampler_group, acquire_timeout_s = _from_env(os.environ, acquire_timeout_s)
        trainer = trainer_group or client.group_id
        sampler = sampler_group or trainer
        self.client = client
        self.trainer_group, self.sampler_group = trainer, sampler
        self.groups: dict[str, tuple[str, ...]] = {
            "trainer": (trainer,),
            "sampler": (sampler,),
            "both": tuple(sorted({trainer, sampler})),
        }
        self.turn = turn or ("rollout" if trainer == sampler else "phase")
        if self.turn not in TURNS:
            raise InvalidRequest(
                f"turn={self.turn!r}: a job's turn on a pool is one of {list(TURNS)}", job_id=client.job_id
            )
        self.holds = PhaseHolds(client, acquire_timeout_s=acquire_timeout_s)
        self._rollout: object = None  # the rollout_id of the latest phase (turn="rollout")
        self._closed = False
        if self._own:
            atexit.register(self.close)  # a driver that dies in its loop never calls close(): give the pools back
        log.info(
            "slime phases of job %s on %s",
            client.job_id,
            f"one pool {trainer!r}" if trainer == sampler else f"trainer {trainer!r}, sampler {sampler!r}",
        )
        if sampler < trainer:
            log.warning(
                "job %s: the sampler's group %r sorts before the trainer's %r, so each weight sync gives the trainer "
                "pool back and takes both again in order, and another job may train in between; name the pools so "
                "that the trainer's sorts first (e.g. 'a-trainer', 'b-sampler') to keep it (docs/integrations.md)",
                client.job_id,
                sampler,
                trainer,
            )

    @property
    def colocated(self) -> bool:
        """One pool for every role (slime's ``--colocate``)."""
        return self.trainer_group == self.sampler_group

    def groups_of(self, role: str) -> tuple[str, ...]:
        """The groups a phase of ``role`` holds."""
        return self._lookup(
            self.groups,
            role,
            f"slime named role {role!r}; the phase-callback roles are {list(ROLES)} (a newer slime? map it "
            "with callback.groups[role] = (group, ...))",
        )

    # ------------------------------------------------------------------ slime's PhaseCallback

    def on_phase_begin(self, phase: str, role: str, context: Mapping[str, Any] | None = None) -> None:
        """Before the phase's work: take the role's groups (waits while another job holds them)."""
        self._check_open(phase)
        groups = self.groups_of(role)
        if self.turn == "rollout" and context is not None and "rollout_id" in context:
            if context["rollout_id"] != self._rollout:  # a new rollout: this turn is over
                self.holds.end_turn()
            self._rollout = context["rollout_id"]
        self.holds.begin(phase, groups)

    def on_phase_end(self, phase: str, role: str, context: Mapping[str, Any] | None = None) -> None:
        """After the phase's work: give back the groups no open phase needs (``turn="phase"``), or keep them for
        the rollout's next phase (``turn="rollout"``)."""
        self.holds.end(phase, keep=self._keeps(phase))

    def _keeps(self, phase: str) -> bool:
        """Whether the groups of ``phase`` stay held after it (see ``turn``)."""
        if self.turn == "rollout":
            return True
        # The synchronous driver's weight sync follows its training at once: the trainer pool is kept into it
        # (the sync adds the sampler pool, in order when the trainer's group sorts first). With a generation open
        # (the asynchronous driver) or the other order it would only be held idle: given back now.
        return phase == "train" and self.holds.open_phases == (phase,) and self.trainer_group < self.sampler_group

    def close(self) -> None:
        """After the loop (slime calls it): give every group back; close the client if this callback made it.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.holds.close()
        finally:
            if self._own:
                atexit.unregister(self.close)
                self.client.close()

    # ------------------------------------------------------------------ for loops of one's own

    @contextlib.contextmanager
    def phase(self, phase: str, role: str, rollout_id: int | None = None) -> Iterator[None]:
        """``with callback.phase("train", "trainer", rollout_id):`` around a phase's work: begin on entry, end on
        exit. ``rollout_id`` is the context slime's driver passes (``turn="rollout"`` needs it)."""
        context = None if rollout_id is None else {"rollout_id": rollout_id}
        self.on_phase_begin(phase, role, context)
        try:
            yield
        finally:
            self.on_phase_end(phase, role, context)

    def register(
        self, role: str, handler: WorkloadHandler, *, node_id: str | None = None, **options: Any
    ) -> WorkloadChannel:
        """Register ``handler`` (state living in this process) with the agent of ``node_id`` in the group of
        ``role`` (``trainer`` or ``sampler``), so that a switch of that pool moves it; ``options`` as
        :meth:`TimeSliceClient.register_workload`'s. State in slime's Ray actors is registered by the actors."""
        if role not in ("trainer", "sampler"):
            raise InvalidRequest(
                f"register state by pool: role 'trainer' or 'sampler', not {role!r}", job_id=self.client.job_id
            )
        (group,) = self.groups_of(role)
        return self.client.register_workload(handler, node_id=node_id, group_id=group, **options)

    def _check_open(self, phase: str) -> None:
        if self._closed:
            raise InvalidRequest(
                f"phase {phase!r} began after close(): make a new callback for a new run", job_id=self.client.job_id
            )


def _from_env(
    env: Mapping[str, str],
    timeout: float | None,
) -> tuple[TimeSliceClient, str, str, float | None]:
    """The client and groups ``TimeSliceCallback()`` takes from the environment."""
    job = env.get(ENV["job"], "").strip()
    if not job:
        raise InvalidRequest(
            f"TimeSliceCallback() reads the job from ${ENV['job']}, which is not set: set it (and "
            f"${ENV['trainer']} + ${ENV['sampler']} for two pools, or ${ENV['group']} for one), or drop "
            "--phase-callback-path to run without timeslice"
        )
    one = env.get(ENV["group"], "").strip()
    trainer = env.get(ENV["trainer"], "").strip() or one
    sampler = env.get(ENV["sampler"], "").strip() or one
    if not trainer or not sampler:
        raise InvalidRequest(
            f"job {job!r}: set ${ENV['trainer']} and ${ENV['sampler']} (two pools) or ${ENV['group']} (one pool) "
            f"for TimeSliceCallback() (trainer {trainer or 'unset'}, sampler {sampler or 'unset'})",
            job_id=job,
        )
    if timeout is None and (raw := env.get(ENV["timeout"], "").strip()):
        try:
            timeout = float(raw)
        except ValueError:
            raise InvalidRequest(f"${ENV['timeout']}={raw!r} is not a number of seconds", job_id=job) from None
    # The driver holds no device state of its own (the actors do): it is not bound to an agent.
    client = TimeSliceClient(job, trainer, env.get("TIMESLICE_NATS_URL") or None, bind_process=False)
    return client, trainer, sampler, timeout
