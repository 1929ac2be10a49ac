"""A job's registrations on one node (its parts): which registration a new one replaces, which processes and backends
the job has in all, and each part as a context of its own for the backends to act on.

A job spread over several processes on a node (a trainer's workers, a rollout engine beside them, Ray actors)
registers each of them; a switch must move them all, or the outgoing job's memory stays on the device beside the next
job's. ``JobContext``'s own backends, processes and settings are its first registration's, ``JobContext.parts`` the
others'. A registration *is* a part already there, and replaces it, when it comes through the same workload channel
(``channel``), or from the same processes where either of the two has no channel (a process's bind and a handler it
registers are one part: the handler replaces the bind), or when either names no processes (nothing tells them
apart). Process-level backends (``cuda``, ``freeze``) of two parts
never act on the same process: such a registration is refused, as it would checkpoint or stop that process twice.
All of it is pure: the agent's ``_job_book`` and ``service`` keep the records and run the operations."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from timeslice_client.protocol import MAX_JOB_PARTS, JobContext, JobPart, JobState, ProcessOwner, RegisterJob

from ._errors import Refused
from ._untrusted import PROCESS_ACTING, Refusal

__all__ = [
    "all_backends",
    "all_pids",
    "combine",
    "part_count",
    "put_part",
    "registered",
    "same_part",
    "views",
    "without_channel",
    "without_dead",
]

_PART_FIELDS = tuple(JobPart.__struct_fields__)


def views(ctx: JobContext) -> list[JobContext]:
    """Each part of the job as a context of its own (no ``parts``), the first registration first: what a backend
    acts on. The job's state, epoch and saved settings are every view's."""
    first = msgspec.structs.replace(ctx, parts=()) if ctx.parts else ctx
    return [first, *(msgspec.structs.replace(first, **_fields(p)) for p in ctx.parts)]


def combine(parts: list[JobContext]) -> JobContext:
    """The job's context from its parts' views (``views``' inverse): the first's fields, the others as parts."""
    first, rest = parts[0], parts[1:]
    return msgspec.structs.replace(first, parts=tuple(JobPart(**_fields(v)) for v in rest))


def all_pids(ctx: JobContext) -> tuple[int, ...]:
    """Every registered pid of the job on this node, each once, in the order the parts name them."""
    return tuple(dict.fromkeys(p for v in views(ctx) for p in v.pids))


def all_backends(ctx: JobContext) -> tuple[str, ...]:
    """Every backend any part of the job has, each once."""
    return tuple(dict.fromkeys(b for v in views(ctx) for b in v.backends))


def part_count(ctx: JobContext) -> int:
    return 1 + len(ctx.parts)


def same_part(a: JobContext, b: JobContext) -> bool:
    """Whether registrations ``a`` and ``b`` are the same part of their job (see the module doc). Two channels of
    which one registered no processes are one part too: without pids nothing tells a second process of the job from
    the first one started again, so the newer takes the older's place, as a single registration always did."""
    if a.channel is not None and b.channel is not None:
        return a.channel == b.channel or not a.pids or not b.pids
    return (a.pids, a.pgid) == (b.pids, b.pgid)


def registered(node: str, req: RegisterJob, owner: ProcessOwner | None) -> JobContext:
    """Registration ``req`` as the single-part context ``put_part`` takes, IDLE (``owner``: the process that proved
    it, None when unproven). Its part's fields are ``JobPart``'s, so a registration carries into a part every field
    a part keeps, and only those."""
    part = {f: getattr(req, f) for f in _PART_FIELDS if f != "owner"}
    return JobContext(node=node, job=req.job, group=req.group, state=JobState.IDLE, owner=owner, **part)


def put_part(ctx: JobContext | None, new: JobContext) -> tuple[JobContext, JobContext | None]:
    """The job with registration ``new`` (a single-part context) in it: in place of the part it is (which it replaces,
    settings and all), or as one more. Returns the job and the part ``new`` replaced (None: a new part). The job's
    state and saved settings stay ``ctx``'s. Refused (``too_large``) past ``MAX_JOB_PARTS`` parts, and
    (``forbidden_process``) when a process-level backend of ``new`` would act on a process another part's does."""
    if ctx is None:
        return new, None
    parts = views(ctx)
    at = next((i for i, v in enumerate(parts) if same_part(v, new)), None)
    replaced = parts[at] if at is not None else None
    others = [v for i, v in enumerate(parts) if i != at]
    _check_disjoint(new, others)
    if at is None:
        if len(parts) >= MAX_JOB_PARTS:
            raise Refused(
                Refusal.TOO_LARGE,
                f"job {ctx.job!r} has {len(parts)} registrations on node {ctx.node!r} (at "
                f"most {MAX_JOB_PARTS}); unregister those of processes that are gone",
            )
        parts.append(new)
    else:
        parts[at] = new
    job = combine([_job_fields(v, ctx) for v in parts])
    return job, replaced


def without_channel(ctx: JobContext, channel: str) -> JobContext | None:
    """The job without the part its workload channel ``channel`` registered; None when no part is left. The job as
    it was when no part has that channel."""
    parts = views(ctx)
    kept = [v for v in parts if v.channel != channel]
    if len(kept) == len(parts):
        return ctx
    return combine(kept) if kept else None


def without_dead(ctx: JobContext, alive: Callable[[int], bool]) -> tuple[JobContext | None, int]:
    """The job without the parts whose registered processes all exited (a part with no pids is never dead: its
    backends touch no process); None when none is left. Also how many parts were dropped."""
    kept = [v for v in views(ctx) if not v.pids or any(alive(p) for p in v.pids)]
    dropped = part_count(ctx) - len(kept)
    if not dropped:
        return ctx, 0
    return (combine(kept) if kept else None), dropped


def _check_disjoint(new: JobContext, others: Iterable[JobContext]) -> None:
    if not PROCESS_ACTING.intersection(new.backends):
        return
    mine = set(new.pids) | ({new.pgid} if new.pgid is not None else set())
    for other in others:
        if not PROCESS_ACTING.intersection(other.backends):
            continue
        theirs = set(other.pids) | ({other.pgid} if other.pgid is not None else set())
        if shared := sorted(mine & theirs):
            raise Refused(
                Refusal.FORBIDDEN_PROCESS,
                f"process {shared[0]} is registered for job {new.job!r} already, "
                f"with {'+'.join(other.backends)}: one registration per process "
                "acts on it (register its handler through the same channel, or "
                "unregister the other first)",
            )


def _fields(v: JobContext | JobPart) -> dict[str, Any]:
    return {f: getattr(v, f) for f in _PART_FIELDS}


def _job_fields(part: JobContext, job: JobContext) -> JobContext:
    """A part's view carrying the job's own fields (state, epoch, last operation, saved settings) from ``job``."""
    return msgspec.structs.replace(job, parts=(), **_fields(part))
