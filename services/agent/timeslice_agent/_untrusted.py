"""Checks of what the agent receives: commands (its durable consumer, ``Agent.take``), requests
(``ts.rpc.agent.<node>.*``), gRPC calls and the job contexts it reads back from KV. Every field is untrusted:
an id goes into a subject or a KV key only once :func:`validate_id` accepted it, numbers are bounded, a
registration never names a process the agent must not touch (init, its own process or process group), and a
process-level backend acts only on processes the job proved to own (``_ownership``).

A check raises :class:`Refused`, whose ``code`` (a :class:`Refusal`) is what callers decide on and what the
metrics count; its message names the field, the value and the rule.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Final

from timeslice_client.errors import InvalidId
from timeslice_client.protocol import JobContext, RegisterJob, Restore, Snapshot, validate_id

from ._errors import REFUSALS, Refusal, Refused

__all__ = [
    "MAX_DEADLINE_AHEAD_MS",
    "MAX_EPOCH",
    "MAX_JOBS",
    "MAX_OP_ID",
    "PID_MAX",
    "PROCESS_ACTING",
    "REFUSALS",
    "Refusal",
    "Refused",
    "answerable",
    "cap",
    "check_command",
    "check_id",
    "check_op_id",
    "check_processes",
    "check_registration",
    "shown",
]

MAX_OP_ID: Final = 256  # characters of an op id
MAX_JOBS: Final = 4096  # jobs registered on one node
MAX_AFTER: Final = 256  # op ids a restore may follow
MAX_EPOCH: Final = 2**53  # exact in every JSON reader
# A deadline further ahead than any timer can hold (threading.TIMEOUT_MAX is ~292 years; asyncio's, uvloop's
# and nats-py's timeouts hold it too): far-off deadlines are legitimate (tests, a job that must never time out).
MAX_DEADLINE_AHEAD_MS: Final = 100 * 365 * 24 * 3600 * 1000
MAX_OP_TIMEOUT_MS: Final = 24 * 3600 * 1000
MAX_BACKENDS: Final = 8
MAX_PIDS: Final = 1024
MAX_TAGS: Final = 64
MAX_TAG: Final = 256
MAX_ENDPOINTS: Final = 16
MAX_ENDPOINT: Final = 512
MAX_CHAIN: Final = 64  # characters of a backend chain ("app_channel+freeze"): OpResult.backend's bound
MAX_ERROR: Final = 2000  # characters of an error text the agent publishes (the wire bounds them at 2048)
PID_MAX: Final = 1 << 22  # the kernel's PID_MAX_LIMIT on 64-bit Linux: no pid or pgid is larger
# Backends that signal or checkpoint the job's processes: the agent's own process or group would stop it.
PROCESS_ACTING: Final = frozenset({"freeze", "cuda"})

# Printable ASCII without spaces: safe in a message id header (Nats-Msg-Id) and on a log line.
_OP_ID_RE: Final = re.compile(rf"[!-~]{{1,{MAX_OP_ID}}}")


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a log line or an error never repeats a huge field."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}…({len(text)} chars)"


def cap(text: str) -> str:
    """An error text short enough for the wire (``MAX_ERROR``), cut with a mark where it was longer."""
    return text if len(text) <= MAX_ERROR else f"{text[: MAX_ERROR - 20]}…(cut, {len(text)} chars)"


def check_id(kind: str, value: object) -> str:
    """:func:`validate_id` as a :class:`Refused` (``INVALID_ID``), with the value cut to a readable length."""
    try:
        return validate_id(kind, value)
    except InvalidId as exc:
        raise Refused(Refusal.INVALID_ID, f"invalid {kind} id {shown(value)}: {exc.rule}") from None


def check_op_id(value: object, what: str = "op_id") -> str:
    if not isinstance(value, str) or _OP_ID_RE.fullmatch(value) is None:
        raise Refused(
            Refusal.INVALID_ID,
            f"invalid {what} {shown(value)}: 1 to {MAX_OP_ID} printable ASCII characters without spaces",
        )
    return value


def answerable(cmd: Snapshot | Restore) -> bool:
    """Whether a refusal of ``cmd`` can be answered on the stream: its group, job and op id are safe to put in
    a subject, a result and a message id."""
    try:
        check_id("group", cmd.group)
        check_id("job", cmd.job)
        check_op_id(cmd.op_id)
    except Refused:
        return False
    return True


def check_command(cmd: Snapshot | Restore, node: str, now_ms: int) -> None:
    """Refuse a command this agent must not run: bad ids, another node, an epoch or deadline out of bounds."""
    check_op_id(cmd.op_id)
    check_id("group", cmd.group)
    check_id("job", cmd.job)
    check_id("node", cmd.node)
    if cmd.node != node:
        raise Refused(
            Refusal.WRONG_NODE,
            f"command {cmd.op_id} is for node {cmd.node!r}, not {node!r}: send it on that node's subject",
        )
    if not 0 <= cmd.epoch <= MAX_EPOCH:
        raise Refused(Refusal.OUT_OF_RANGE, f"command {cmd.op_id}: epoch {shown(cmd.epoch)} is not in 0..{MAX_EPOCH}")
    if not 0 <= cmd.deadline_ms <= now_ms + MAX_DEADLINE_AHEAD_MS:
        raise Refused(
            Refusal.OUT_OF_RANGE,
            f"command {cmd.op_id}: deadline_ms {shown(cmd.deadline_ms)} is not an "
            "epoch time in ms, at most 100 years ahead of this node's clock "
            f"({now_ms})",
        )
    if isinstance(cmd, Restore):
        if len(cmd.after) > MAX_AFTER:
            raise Refused(
                Refusal.TOO_LARGE, f"command {cmd.op_id}: it follows {len(cmd.after)} operations (at most {MAX_AFTER})"
            )
        for op_id in cmd.after:
            check_op_id(op_id, "op id in after")


def check_processes(pids: Iterable[int], pgid: int | None, backends: Iterable[str]) -> None:
    """Refuse pids and a process group the agent must never act on: init (1), 0 and negatives (a kill(2) of
    those signals whole groups), past ``PID_MAX``, the agent's own process group and, for a backend that acts
    on processes (``PROCESS_ACTING``), the agent's own pid. The agent's pid is accepted for the other backends:
    a workload may run in the agent's process (an agent embedded beside its jobs), where the pid only says the
    job lives while the agent does."""
    pids, own_pid, own_pgid = tuple(pids), os.getpid(), os.getpgid(0)
    if len(pids) > MAX_PIDS:
        raise Refused(
            Refusal.TOO_LARGE, f"{len(pids)} pids (at most {MAX_PIDS}); register the job's process group (pgid) instead"
        )
    acting = sorted(PROCESS_ACTING.intersection(backends))
    for pid in pids:
        if not 1 < pid <= PID_MAX:
            raise Refused(
                Refusal.FORBIDDEN_PROCESS,
                f"pid {shown(pid)} is not a job's process id (2..{PID_MAX}); register the job's own pids",
            )
        if pid == own_pid and acting:
            raise Refused(
                Refusal.FORBIDDEN_PROCESS,
                f"pid {pid} is the agent's own process, which the "
                f"{'+'.join(acting)} backend would stop; register the job's "
                "own pids",
            )
    if pgid is not None:
        if not 1 < pgid <= PID_MAX:
            raise Refused(
                Refusal.FORBIDDEN_PROCESS,
                f"pgid {shown(pgid)} is not a job's process group (2..{PID_MAX}); 0 would mean the agent's own group",
            )
        if pgid == own_pgid:
            raise Refused(
                Refusal.FORBIDDEN_PROCESS,
                f"pgid {pgid} is the agent's own process group; start the "
                "job in a group of its own (e.g. os.setsid()) or register "
                "its pids",
            )


def _bounded(what: str, items: tuple[str, ...], count: int, length: int) -> None:
    if len(items) > count:
        raise Refused(Refusal.TOO_LARGE, f"{len(items)} {what} (at most {count})")
    for item in items:
        if not item or len(item) > length:
            raise Refused(Refusal.TOO_LARGE, f"{what[:-1]} {shown(item)} is empty or longer than {length} characters")


def check_registration(req: RegisterJob | JobContext, *, processes: bool = True) -> None:
    """Refuse a registration with bad ids, absurd sizes or (``processes``) a process the agent must not act on.
    A job context (one part's view, ``_job_parts.views``) is checked as the registration it stands for: one read
    back from KV, or made up for a standalone operation, passes the checks a registration would."""
    check_id("group", req.group)
    check_id("job", req.job)
    if not req.backends:
        raise Refused(Refusal.TOO_LARGE, "no backend given; name at least one (e.g. app_channel)")
    _bounded("backends", req.backends, MAX_BACKENDS, MAX_CHAIN)
    chain = "+".join(req.backends)
    if len(set(req.backends)) != len(req.backends) or len(chain) > MAX_CHAIN:
        raise Refused(Refusal.TOO_LARGE, f"backends {shown(chain)}: each at most once, {MAX_CHAIN} characters in all")
    _bounded("tags", req.tags, MAX_TAGS, MAX_TAG)
    _bounded("endpoints", req.endpoints, MAX_ENDPOINTS, MAX_ENDPOINT)
    if not 0 < req.op_timeout_ms <= MAX_OP_TIMEOUT_MS:
        raise Refused(
            Refusal.OUT_OF_RANGE, f"op_timeout_ms {shown(req.op_timeout_ms)} is not in 1..{MAX_OP_TIMEOUT_MS} (24 h)"
        )
    if processes:
        check_processes(req.pids, req.pgid, req.backends)
