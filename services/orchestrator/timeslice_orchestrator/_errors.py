"""The exception tree of ``timeslice_orchestrator`` (one root, under the client's ``TimeSliceError``)::

    TimeSliceError                     (timeslice_client.errors)
    └── OrchestratorError              the orchestrator package's errors
        ├── ServiceFailed              the orchestrator cannot go on safely and stops (logged with its cause)
        │   └── LeadershipError        leader election cannot go on safely
        │       ├── NotLeader          a fenced write refused: this instance does not hold the lease (any more)
        │       └── LeaderWaitTimeout  ``wait_leader`` gave up (also TimeoutError)
        ├── Unusable                   one group's record cannot be used (it is quarantined; the others go on)
        ├── Deposed                    another leader's term began: this instance stores nothing more
        ├── EmbeddedNatsError          the embedded nats-server could not be found or did not start
        ├── AuthError                  an auth directory or credential that cannot be used
        ├── ReplayError                the stream could not be read for a replay
        ├── InvariantViolation         a record or the stream breaks an invariant (``rule``; ``invariants`` checks)
        └── AdviseError                ``timeslice advise`` cannot predict from what it was given

Foreign errors (nats-py's, the OS's) are translated where they are met: the record store turns a write that
cannot be made into ``ServiceFailed`` or ``Unusable``, leadership a refused lease write into ``NotLeader``. Every
error carries the values that explain it and says what to do. The one signal that never leaves the orchestrator,
``service._Stopped``, stays beside the code that raises and catches it (it ends the task group of ``run()``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from timeslice_client.errors import TimeSliceError

__all__ = [
    "AdviseError",
    "AuthError",
    "Deposed",
    "EmbeddedNatsError",
    "InvariantViolation",
    "LeaderWaitTimeout",
    "LeadershipError",
    "NotLeader",
    "OrchestratorError",
    "ReplayError",
    "ServiceFailed",
    "Unusable",
]


class OrchestratorError(TimeSliceError, RuntimeError):
    """The root of the orchestrator's errors."""


class ServiceFailed(OrchestratorError):
    """The orchestrator cannot go on safely (for example another instance writes the same records, or a record
    could not be stored through every attempt): it stops, and its log says why."""


class LeadershipError(ServiceFailed):
    """Leader election cannot go on safely; the message says what to do."""


class NotLeader(LeadershipError):
    """A fenced write was refused: this instance does not hold the lease (any more)."""

    def __init__(self, instance: str, term: int | None, reason: str) -> None:
        super().__init__(
            f"instance {instance} is not the leader (term {term}): {reason}; "
            "stop publishing decisions and wait for the next election"
        )
        self.instance = instance
        self.term = term
        self.reason = reason


class LeaderWaitTimeout(LeadershipError, TimeoutError):
    """``wait_leader`` gave up."""

    def __init__(self, instance: str, timeout: float, holder: str | None) -> None:
        super().__init__(
            f"instance {instance} did not become leader within {timeout} s "
            f"(current holder: {holder or 'none'}); another instance may hold the lease"
        )
        self.instance = instance
        self.timeout = timeout
        self.holder = holder


class Unusable(OrchestratorError):
    """A group's record cannot be used: the stored value does not decode, or the record is too large to store."""

    def __init__(self, group: str, reason: str) -> None:
        self.group = group
        self.reason = reason
        super().__init__(f"group {group!r}: {reason}")


class Deposed(OrchestratorError):
    """Another leader's term began (the bucket's term marker moved): this instance may store nothing more."""

    def __init__(self, term: int, found: str) -> None:
        self.term, self.found = term, found
        super().__init__(f"term {term} is over: {found}; this orchestrator stands by again")


class EmbeddedNatsError(OrchestratorError):
    """The embedded nats-server could not be found or did not start."""


class AuthError(OrchestratorError):
    """An auth directory or credential that cannot be used; the message says what to do."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        self.path = str(path) if path is not None else None
        super().__init__(message)


class ReplayError(OrchestratorError):
    """The stream could not be read for a replay; the message says why and what to do."""


class AdviseError(OrchestratorError):
    """``timeslice advise`` cannot predict from what it was given (a job with no recorded hold, a job in several
    groups, a simulation too long); the message says which and what to do."""


class InvariantViolation(OrchestratorError):
    """An invariant does not hold (raised by ``invariants`` and ``_op_facts``). ``rule`` names it; ``values`` holds
    what shows it."""

    def __init__(
        self,
        rule: str,
        detail: str,
        *,
        group: str | None = None,
        seq: int | None = None,
        values: Mapping[str, object] | None = None,
    ) -> None:
        self.rule = rule
        self.detail = detail
        self.group = group
        self.seq = seq
        self.values: dict[str, object] = dict(values or {})
        where = ""
        if group is not None:
            where += f" in group {group!r}"
        if seq is not None:
            where += f" at stream seq {seq}"
        shown = "".join(f"\n  {k} = {v!r}" for k, v in self.values.items())
        super().__init__(f"invariant {rule!r} violated{where}: {detail}{shown}")

    def at(self, seq: int) -> InvariantViolation:
        """The same violation, located at stream sequence ``seq``."""
        return InvariantViolation(self.rule, self.detail, group=self.group, seq=seq, values=self.values)
