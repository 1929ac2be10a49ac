"""A stand-in for the reference project's slime package (llm-d-incubation/llm-d-rl-time-slicing,
``pkg/integrations/slime/timeslice_slime``: ``callback.TimesliceCallback`` and ``locks.RoleLocks``), for when it is
not installed. Written from what it does (not copied), so that the test makes the very calls it makes:

* configured from ``TIMESLICE_JOB_ID``, ``TIMESLICE_ORCH_ADDR``, ``TIMESLICE_TRAINER_GROUP``,
  ``TIMESLICE_SAMPLER_GROUP`` (the two groups must differ); made by slime with no arguments;
* one ``timeslice.TimeSliceOrchestratorClient(target=addr, job_id=job, group_id=group)`` per role, made up front;
* ``on_phase_begin(phase, role)``: role ``trainer`` or ``both`` acquires the trainer's group, then role ``sampler``
  or ``both`` the sampler's: ``client.acquire(group_id=group, timeout_sec=600)``, skipped when already held, and
  asking the trainer's while holding only the sampler's is refused (its global order: trainer first);
* ``on_phase_end(phase, role)``: the sampler's group released, then the trainer's (``client.release(group_id=
  group)``), each only if held; release errors are logged, never raised;
* ``close()``: release what is held (sampler first), close the clients;
* a line on stdout for each: ``[timeslice] job=J ACQUIRE role=R group=G waited=Nms context_restored=B`` and
  ``[timeslice] job=J RELEASE role=R group=G pending_waiters=N snapshot_deferred=B``.

:func:`install` puts it in ``sys.modules`` as ``timeslice_slime``, ``timeslice_slime.callback`` and
``timeslice_slime.locks``, subclassing whatever ``slime.utils.phase_callback.PhaseCallback`` is importable then.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

TRAINER, SAMPLER = "trainer", "sampler"
ACQUIRE_TIMEOUT_S = 600


def _say(msg: str) -> None:
    print(f"[timeslice] {msg}", flush=True)


class RoleLocks:
    def __init__(
        self, job_id: str | None, orch_addr: str | None, trainer_group: str | None, sampler_group: str | None
    ) -> None:
        self.job_id = job_id
        self.groups = {TRAINER: trainer_group, SAMPLER: sampler_group}
        self.enabled = bool(job_id and orch_addr and trainer_group and sampler_group)
        self._held: set[str] = set()
        self._clients: dict[str, Any] = {}
        if not self.enabled:
            _say("time-slicing off: a variable is missing")
            return
        if trainer_group == sampler_group:
            raise ValueError(f"the trainer's and the sampler's groups must differ (both {trainer_group!r})")
        from timeslice import TimeSliceOrchestratorClient

        for role, group in self.groups.items():
            self._clients[role] = TimeSliceOrchestratorClient(target=orch_addr, job_id=job_id, group_id=group)

    @classmethod
    def from_env(cls) -> RoleLocks:
        e = os.environ.get
        return cls(
            e("TIMESLICE_JOB_ID"), e("TIMESLICE_ORCH_ADDR"), e("TIMESLICE_TRAINER_GROUP"), e("TIMESLICE_SAMPLER_GROUP")
        )

    def held(self, role: str) -> bool:
        return role in self._held

    def acquire(self, role: str) -> None:
        if role == TRAINER and SAMPLER in self._held and TRAINER not in self._held:
            raise RuntimeError("lock order: the trainer's group is asked for while the sampler's is held")
        if not self.enabled or role in self._held:
            return
        r = self._clients[role].acquire(group_id=self.groups[role], timeout_sec=ACQUIRE_TIMEOUT_S)
        self._held.add(role)
        _say(
            f"job={self.job_id} ACQUIRE role={role} group={self.groups[role]} waited={r.waited_ms}ms "
            f"context_restored={r.context_restored}"
        )

    def release(self, role: str) -> None:
        if not self.enabled or role not in self._held:
            return
        try:
            r = self._clients[role].release(group_id=self.groups[role])
            _say(
                f"job={self.job_id} RELEASE role={role} group={self.groups[role]} "
                f"pending_waiters={r.pending_waiters} snapshot_deferred={r.snapshot_deferred}"
            )
        except Exception as exc:  # as the package: a failed release never stops the job
            _say(f"job={self.job_id} RELEASE role={role} FAILED: {exc}")
        finally:
            self._held.discard(role)

    def close(self) -> None:
        for role in (SAMPLER, TRAINER):
            self.release(role)
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def install() -> None:
    """``timeslice_slime`` (and its two modules) in ``sys.modules``."""
    from slime.utils.phase_callback import PhaseCallback

    class TimesliceCallback(PhaseCallback):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            self.locks = RoleLocks.from_env()

        def on_phase_begin(self, phase: str, role: str, context: dict[str, Any] | None = None) -> None:
            if role in (TRAINER, "both"):
                self.locks.acquire(TRAINER)
            if role in (SAMPLER, "both"):
                self.locks.acquire(SAMPLER)

        def on_phase_end(self, phase: str, role: str, context: dict[str, Any] | None = None) -> None:
            if role in (SAMPLER, "both"):
                self.locks.release(SAMPLER)
            if role in (TRAINER, "both"):
                self.locks.release(TRAINER)

        def close(self) -> None:
            self.locks.close()

    pkg = types.ModuleType("timeslice_slime")
    pkg.__path__ = []  # a package
    locks = types.ModuleType("timeslice_slime.locks")
    callback = types.ModuleType("timeslice_slime.callback")
    for name, value in (("RoleLocks", RoleLocks), ("TRAINER", TRAINER), ("SAMPLER", SAMPLER)):
        setattr(locks, name, value)
    callback.TimesliceCallback = TimesliceCallback  # type: ignore[attr-defined]
    pkg.TimesliceCallback = TimesliceCallback  # type: ignore[attr-defined]
    pkg.callback, pkg.locks = callback, locks  # type: ignore[attr-defined]
    sys.modules.update({"timeslice_slime": pkg, "timeslice_slime.locks": locks, "timeslice_slime.callback": callback})
