"""The job context an operation runs with: a standalone one's (``Agent.run_standalone``: the gRPC
``SnapshotAgentService``, for services that schedule themselves without an orchestrator), and the settings one
request gives for itself alone (``OpSettings``: its suspend mode and tags, never stored as the job's)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from timeslice_client.protocol import JobContext, JobState, OpKind, SuspendMode

from ._errors import OperationInProgress

__all__ = ["OpSettings", "OperationInProgress", "check_idle", "run_context", "settled", "standalone_context"]


def standalone_context(
    current: JobContext | None,
    node: str,
    job: str,
    kind: OpKind,
    *,
    group: str | None,
    backends: tuple[str, ...] | None,
    pids: tuple[int, ...],
    endpoints: tuple[str, ...],
) -> JobContext:
    """The context to store for the call: ``current`` itself when the call changes nothing, else a new one.

    A registered job keeps its configuration except the backends, processes and endpoints the call gives (the
    restore after a snapshot must find the state where that snapshot put it). A job the agent does not know is
    taken on for a snapshot when ``backends`` and ``pids`` (or ``endpoints``) say where its state is, with the default
    mode and no tags.
    The call's mode and tags are its own (``OpSettings``). Raises ``LookupError`` (unknown job, nothing to
    restore) and ``ValueError`` (the job is registered in another group).
    """
    if current is None:
        # A job the agent does not know is taken on when the call names where its state is: its processes, or the
        # serving engines' endpoints (app_endpoint: the reference guide's standalone vLLM call).
        if kind is OpKind.RESTORE or not backends or not (pids or endpoints):
            what = "nothing was saved for it here" if kind is OpKind.RESTORE else "name its processes or endpoints"
            raise LookupError(
                f"job {job!r} is not registered with the agent on node {node!r} ({what}); register "
                "it through the workload channel, or give a backend with explicit process ids or "
                "an app_endpoint config with its endpoints"
            )
        return JobContext(
            node=node,
            job=job,
            group=group or "standalone",
            state=JobState.RUNNING,
            backends=backends,
            pids=pids,
            endpoints=endpoints,
        )
    if group and group != current.group:
        raise ValueError(f"job {job!r} is registered in group {current.group!r} on node {node!r}, not {group!r}")
    changes: dict[str, Any] = {}
    if backends and backends != current.backends:
        changes["backends"] = backends
    if pids and pids != current.pids:
        changes["pids"] = pids
    if endpoints and endpoints != current.endpoints:
        changes["endpoints"] = endpoints
    return msgspec.structs.replace(current, **changes) if changes else current


@dataclass(frozen=True)
class OpSettings:
    """What one request says about its own operation alone: how to suspend (None: as the job says)."""

    mode: SuspendMode | None = None
    tags: tuple[str, ...] | None = None


def run_context(ctx: JobContext, kind: OpKind, asked: OpSettings | None) -> JobContext:
    """The context an operation runs with (never stored): the request's mode and tags where it gives them, else,
    for a restore, those the saved state was suspended with, else the job's registered ones."""
    mode, tags = ctx.mode, ctx.tags
    if kind is OpKind.RESTORE and ctx.saved_mode is not None:
        mode, tags = ctx.saved_mode, ctx.saved_tags if ctx.saved_tags is not None else ctx.tags
    if asked is not None:
        mode = asked.mode if asked.mode is not None else mode
        tags = asked.tags if asked.tags is not None else tags
    return ctx if (mode, tags) == (ctx.mode, ctx.tags) else msgspec.structs.replace(ctx, mode=mode, tags=tags)


def settled(ran: JobContext, stored: JobContext, state: JobState) -> dict[str, Any]:
    """What the job's stored context keeps of the settings an operation ran with, once it ended in ``state``: a
    state saved by other settings than the registered ones remembers them for its restore; a restored or rolled
    back one forgets them."""
    if state is JobState.SAVED and (ran.mode, ran.tags) != (stored.mode, stored.tags):
        return {"saved_mode": ran.mode, "saved_tags": ran.tags}
    if state in (JobState.SAVED, JobState.RUNNING):
        return {"saved_mode": None, "saved_tags": None}
    return {}  # faulted: what was saved, and how, is kept for the restore once the fault is cleared


def check_idle(job: str, lock_users: int, standalone: Mapping[str, tuple[str, float]]) -> None:
    """Raises OperationInProgress when an operation on ``job`` runs or waits: a standalone one of this agent's
    (``standalone``: op id -> job, start), or anything that holds or awaits the job's lock (``lock_users``)."""
    running = next((op_id for op_id, (j, _) in standalone.items() if j == job), None)
    if running is not None or lock_users > 0:
        raise OperationInProgress(job, running)
