"""What the agent says about one command: ``OpStarted`` as its operation begins, and the ``OpResult`` that answers it
(its outcome, or its refusal). Each names the command by the same fields (op id, group, job, node, kind, epoch),
which the agent's rules for an operation (``_op_rules.decide``) take too: built in one place, the start, the answer
and the verdict of an operation never disagree about which command they are."""

from __future__ import annotations

from typing import TypedDict

from timeslice_client.protocol import OpKind, OpResult, OpStarted, Restore, Snapshot

from ._backend_api import Outcome
from ._untrusted import MAX_EPOCH, Refused, answerable, cap

__all__ = ["Naming", "kind_of", "naming", "op_result", "op_started", "refusal_result"]


def kind_of(cmd: Snapshot | Restore) -> OpKind:
    return OpKind.SNAPSHOT if isinstance(cmd, Snapshot) else OpKind.RESTORE


class Naming(TypedDict):
    """The fields that name an operation's command (typed, so that mypy checks each ``**naming(...)``)."""

    op_id: str
    group: str
    job: str
    node: str
    kind: OpKind
    epoch: int


def naming(cmd: Snapshot | Restore, node: str, *, epoch: int | None = None) -> Naming:
    """The fields by which the messages and rules of ``cmd``'s operation on ``node`` name it (``epoch``: in place
    of the command's own, where that one cannot be published)."""
    return Naming(
        op_id=cmd.op_id,
        group=cmd.group,
        job=cmd.job,
        node=node,
        kind=kind_of(cmd),
        epoch=cmd.epoch if epoch is None else epoch,
    )


def op_started(cmd: Snapshot | Restore, node: str, backend: str, *, overlapped: bool) -> OpStarted:
    """``overlapped``: a restore that starts beside the snapshots it follows (``Restore.after``)."""
    return OpStarted(**naming(cmd, node), backend=backend, overlapped=overlapped)


def op_result(
    cmd: Snapshot | Restore,
    node: str,
    backend: str,
    *,
    ok: bool,
    error: str | None,
    outcome: Outcome | None = None,
    elapsed_ms: float = 0.0,
    overlapped: bool = False,
) -> OpResult:
    """The answer to an operation that ran, or was answered without running (``outcome``: what its backends
    moved). Every answer says its ``error`` (None: none), cut to the wire's bound (``cap``)."""
    out = outcome or Outcome()
    return OpResult(
        **naming(cmd, node),
        ok=ok,
        error=cap(error) if error else error,
        backend=backend,
        bytes_moved=out.bytes_moved,
        device_bytes_freed=out.device_bytes_freed,
        elapsed_ms=elapsed_ms,
        began_at_release=out.began_at_release,
        work_ms=out.work_ms,
        overlapped=overlapped,
    )


def refusal_result(cmd: Snapshot | Restore, node: str, exc: Refused) -> OpResult | None:
    """The answer to a refused command, or None when it cannot be answered (see ``_untrusted.answerable``). Its
    epoch is 0 where the command's is out of bounds: the orchestrator then takes it for a late answer and drops it."""
    if not answerable(cmd):
        return None
    epoch = cmd.epoch if 0 <= cmd.epoch <= MAX_EPOCH else 0
    return OpResult(
        **naming(cmd, node, epoch=epoch), ok=False, error=cap(f"refused ({exc.code}): {exc}"), backend="none"
    )
