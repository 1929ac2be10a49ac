"""The agent's two messages about one snapshot or restore, as the tests build them: ``OpStarted`` when it starts and
``OpResult`` when it ends. Both repeat the operation's identity (group, op id, node, job, kind, epoch), taken from the
core's command or from its record of the pending operation; :class:`AgentOp` holds it once so that each test says only
what the message adds (the outcome, the backend, whether it ran beside a snapshot)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from timeslice_client.protocol import OpKind, OpRecord, OpResult, OpStarted, Restore, Snapshot


def command_kind(cmd: Snapshot | Restore) -> OpKind:
    return OpKind.SNAPSHOT if isinstance(cmd, Snapshot) else OpKind.RESTORE


@dataclass(frozen=True)
class AgentOp:
    """One operation as an agent names it in its messages."""

    group: str
    op_id: str
    node: str
    job: str
    kind: OpKind
    epoch: int

    @classmethod
    def of(cls, cmd: Snapshot | Restore) -> AgentOp:
        """The operation the core's command asks for."""
        return cls(cmd.group, cmd.op_id, cmd.node, cmd.job, command_kind(cmd), cmd.epoch)

    @classmethod
    def pending(cls, group: str, op: OpRecord, epoch: int) -> AgentOp:
        """An operation the core's record waits for (the record keeps the epoch once, for all of them)."""
        return cls(group, op.op_id, op.node, op.job, op.kind, epoch)

    def started(self, *, backend: str = "noop", overlapped: bool = False) -> OpStarted:
        return OpStarted(**asdict(self), backend=backend, overlapped=overlapped)

    def result(self, ok: bool = True, **kw: Any) -> OpResult:
        """``kw``: more of OpResult's fields (``error``, ``overlapped``, what it moved, ...)."""
        return OpResult(**asdict(self), ok=ok, **kw)
