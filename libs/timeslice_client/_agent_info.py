"""The agents' records: their liveness (KV ``agents``) and their jobs' contexts (KV ``jobs``), exported by
``protocol`` with the other wire and KV types."""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from ._bounds import DEFAULT_OP_TIMEOUT_MS
from ._codes import JobState, SuspendMode

__all__ = ["MAX_JOB_PARTS", "AgentInfo", "DeviceInfo", "JobContext", "JobPart", "ProcessOwner"]

MAX_JOB_PARTS: Final = 64  # registrations of one job on one node (its processes: workers, actors, engines)


class _Rec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class DeviceInfo(_Rec, frozen=True):
    index: int
    uuid: str
    name: str = ""
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0


class AgentInfo(_Rec, frozen=True):
    """An agent's liveness record (KV ``agents``, key = node id, with a TTL)."""

    node: str
    pid: int
    started_at_ms: int
    backends: tuple[str, ...] = ()
    devices: tuple[DeviceInfo, ...] = ()
    host_memory_total_bytes: int = 0
    host_memory_available_bytes: int = 0


class ProcessOwner(_Rec, frozen=True):
    """The process that proved a job's registration through the agent's Unix socket (its peer credentials), and
    the start times (``/proc/<pid>/stat``, clock ticks since boot) that tell the registered processes from later
    ones that reuse their numbers: ``pid_starts`` one per registered pid, ``group_start`` the process group's
    leader's (None when the group had no leader)."""

    pid: int
    uid: int
    gid: int
    start: int
    pid_starts: tuple[int, ...] = ()
    group_start: int | None = None


class JobPart(_Rec, frozen=True):
    """One more registration of a job on a node, beside the one ``JobContext``'s own fields describe: a job spread
    over several processes there (a trainer's workers, a rollout engine, Ray actors) registers each, and a switch
    moves them all. The fields mean what ``JobContext``'s of the same names mean."""

    backends: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()
    pgid: int | None = None
    mode: SuspendMode = SuspendMode.OFFLOAD
    tags: tuple[str, ...] = ()
    op_timeout_ms: int = DEFAULT_OP_TIMEOUT_MS
    endpoints: tuple[str, ...] = ()
    owner: ProcessOwner | None = None
    channel: str | None = None


class JobContext(_Rec, frozen=True):
    """One job's context on one node (KV ``jobs``, key ``<node>.<job>``), kept by that node's agent. Its own
    backends, processes and settings are its first registration's; ``parts`` holds the others (``JobPart``), and
    ``state`` is the whole job's: every part moves in each operation."""

    node: str
    job: str
    group: str
    state: JobState
    backends: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()
    pgid: int | None = None
    mode: SuspendMode = SuspendMode.OFFLOAD
    tags: tuple[str, ...] = ()
    op_timeout_ms: int = DEFAULT_OP_TIMEOUT_MS
    endpoints: tuple[str, ...] = ()
    reason: str | None = None
    epoch: int = 0
    last_op_id: str | None = None
    last_op_ok: bool | None = None
    last_op_error: str | None = None
    bytes_moved: int = 0
    device_bytes_freed: int = 0
    elapsed_ms: float = 0.0
    updated_ms: int = 0
    owner: ProcessOwner | None = None  # None: not proven; process-level backends then never act
    channel: str | None = None  # RegisterJob.channel: the workload channel that registered it
    # How the state now saved was suspended, when a request's own settings did it (None: the registered ones): the
    # restore after it resumes it the same way.
    saved_mode: SuspendMode | None = None
    saved_tags: tuple[str, ...] | None = None
    parts: Annotated[tuple[JobPart, ...], msgspec.Meta(max_length=MAX_JOB_PARTS - 1)] = ()
