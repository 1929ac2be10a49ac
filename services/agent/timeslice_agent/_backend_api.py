"""What every backend is and returns: the :class:`Backend` protocol, :class:`Outcome`, :class:`OpContext`
and the errors. Kept apart from the registry (``backends``) so backend modules can import it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from timeslice_client.protocol import JobContext

from ._errors import BackendError, BackendUnavailable

__all__ = ["Backend", "BackendError", "BackendUnavailable", "OpContext", "Outcome"]


@dataclass(frozen=True, slots=True)
class OpContext:
    op_id: str
    epoch: int
    deadline: float  # monotonic seconds
    # Whether the backend may act on a process it found for the job (a descendant of its pids, a member of its
    # group): the agent's rules (``_ownership.ProcessGuard.may_act``). None: no process beyond the job's own.
    may_act: Callable[[int], bool] | None = None

    def remaining(self) -> float:
        return max(0.001, self.deadline - time.monotonic())


@dataclass(frozen=True, slots=True)
class Outcome:
    bytes_moved: int = 0
    device_bytes_freed: int = 0
    work_ms: float | None = None  # the backend's own time, where it reports one (app_channel: the handler's call)
    began_at_release: bool = False  # that work began before the operation (a workload's early suspend)

    def __add__(self, other: Outcome) -> Outcome:
        work = None if self.work_ms is None and other.work_ms is None else (self.work_ms or 0) + (other.work_ms or 0)
        return Outcome(
            self.bytes_moved + other.bytes_moved,
            self.device_bytes_freed + other.device_bytes_freed,
            work,
            self.began_at_release or other.began_at_release,
        )


class Backend(Protocol):
    name: str

    async def snapshot(self, ctx: JobContext, op: OpContext) -> Outcome: ...

    async def restore(self, ctx: JobContext, op: OpContext) -> Outcome: ...
