"""The job context a standalone operation runs with (``Agent.run_standalone``: the gRPC
``SnapshotAgentService``, for services that schedule themselves without an orchestrator)."""

from __future__ import annotations

from typing import Any

import msgspec
from timeslice_client.protocol import JobContext, JobState, OpKind, SuspendMode

__all__ = ["standalone_context"]


def standalone_context(
    current: JobContext | None,
    node: str,
    job: str,
    kind: OpKind,
    *,
    group: str | None,
    backends: tuple[str, ...] | None,
    pids: tuple[int, ...],
    mode: SuspendMode | None,
    tags: tuple[str, ...] | None,
    endpoints: tuple[str, ...],
) -> JobContext:
    """The context to run with: ``current`` itself when the call changes nothing, else a new one to store.

    A registered job keeps its configuration except what the call gives. A job the agent does not know is
    taken on for a snapshot when ``backends`` and ``pids`` name its processes. Raises ``LookupError``
    (unknown job, nothing to restore) and ``ValueError`` (the job is registered in another group).
    """
    if current is None:
        if kind is OpKind.RESTORE or not backends or not pids:
            what = "nothing was saved for it here" if kind is OpKind.RESTORE else "name its processes"
            raise LookupError(f"job {job!r} is not registered with the agent on node {node!r} ({what}); register "
                              "it through the workload channel, or give a backend with explicit process ids")
        return JobContext(node=node, job=job, group=group or "standalone", state=JobState.RUNNING,
                          backends=backends, pids=pids, mode=mode or SuspendMode.OFFLOAD, tags=tags or (),
                          endpoints=endpoints)
    if group and group != current.group:
        raise ValueError(f"job {job!r} is registered in group {current.group!r} on node {node!r}, not {group!r}")
    changes: dict[str, Any] = {}
    if backends and backends != current.backends:
        changes["backends"] = backends
    if pids and pids != current.pids:
        changes["pids"] = pids
    if mode is not None and mode != current.mode:
        changes["mode"] = mode
    if tags is not None and tags != current.tags:
        changes["tags"] = tags
    if endpoints and endpoints != current.endpoints:
        changes["endpoints"] = endpoints
    return msgspec.structs.replace(current, **changes) if changes else current
