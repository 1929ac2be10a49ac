"""The wire protocol: ids, subjects, bus messages and KV records.

Every message is a frozen :class:`msgspec.Struct` encoded as JSON, tagged by a ``type`` field so
that one decoder per subject family dispatches without a ``"type"``-string ``if`` chain. Decoding
is strict: unknown fields are rejected.

Subjects (all versioned under ``ts.v1``; the ``TIMESLICE`` stream captures ``ts.v1.>``):

==================================  ==========================================================
``ts.v1.job.<group>.<job>.<verb>``  job → orchestrator: acquire, release, renew, cancel, phase
``ts.v1.ctl.<group>.<verb>``        orchestrator / operator → orchestrator: tick, clear_fault,
                                    agent_lost
``ts.v1.agent.<node>.evt.<group>``  agent → orchestrator: job registered, operation outcome
``ts.v1.notice.<group>.<job>``      orchestrator → job: granted, released, refused, revoked,
                                    dequeued, contended
``ts.v1.agent.<node>.cmd``          orchestrator → agent: snapshot / restore commands
``ts.v1.group.<group>.state``       orchestrator: group state transitions (for people and replay)
==================================  ==========================================================

Request/reply subjects live under ``ts.rpc.>``, outside every stream (a stream would answer them
with its PubAck): ``ts.rpc.agent.<node>.register.<job>`` and ``.unregister.<job>`` (job → its node's agent;
the subject's job is authoritative), ``ts.rpc.agent.<node>.clear_fault`` (admin) and ``.status`` (reader),
``ts.rpc.workload.<node>.<job>`` (agent → the job's workload channel: suspend/resume).

Schema evolution: add fields only with defaults; never change a field's type or meaning; a new
message is a new tag. Consumers of an older version reject unknown tags loudly.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, cast

import msgspec

from ._agent_info import MAX_JOB_PARTS, AgentInfo, DeviceInfo, JobContext, JobPart, ProcessOwner
from ._bounds import (
    DEFAULT_OP_TIMEOUT_MS,
    MAX_PRIORITY,
    Count,
    Elapsed,
    Id,
    Ms,
    Name,
    OpId,
    OpTimeoutMs,
    Reason,
    RequestId,
    Text,
)
from ._codes import DequeueCode, ErrorCode, GroupState, JobState, OpKind, RevokeCode, SuspendMode
from ._group_records import (
    MAX_PHASE_CUES,
    Cycle,
    GroupRecord,
    HolderRecord,
    OpRecord,
    PhaseCue,
    Prediction,
    SwitchRecord,
    TrailRecord,
    WaiterRecord,
)
from ._names import subjects, validate_id
from ._policy_msgs import (
    MAX_MIN_HOLD_MS,
    MAX_QUANTUM_MS,
    MAX_SHARE,
    MAX_SHARES,
    FairPick,
    Reservation,
    SetPolicy,
    Usage,
    YieldRequested,
)

__all__ = [
    "AGENTS_BUCKET",
    "DEFAULT_OP_TIMEOUT_MS",
    "GROUPS_BUCKET",
    "JOBS_BUCKET",
    "MAX_JOB_PARTS",
    "MAX_MIN_HOLD_MS",
    "MAX_PHASE_CUES",
    "MAX_PRIORITY",
    "MAX_QUANTUM_MS",
    "MAX_SHARE",
    "MAX_SHARES",
    "NOTICE_SEQ_HEADER",
    "STREAM",
    "STREAM_SUBJECTS",
    "Acquire",
    "AgentCommand",
    "AgentInfo",
    "AgentLost",
    "AgentReply",
    "Cancel",
    "ClearFault",
    "ClearJobFault",
    "Contended",
    "ControlEvent",
    "Cycle",
    "DequeueCode",
    "Dequeued",
    "DeviceInfo",
    "ErrorCode",
    "FairPick",
    "Granted",
    "GroupRecord",
    "GroupState",
    "HolderRecord",
    "InputEvent",
    "JobContext",
    "JobEvent",
    "JobPart",
    "JobRegistered",
    "JobState",
    "JobUnregistered",
    "Notice",
    "OpKind",
    "OpRecord",
    "OpResult",
    "OpStarted",
    "Phase",
    "PhaseCue",
    "Prediction",
    "ProcessOwner",
    "Quarantined",
    "Refused",
    "RegisterJob",
    "Release",
    "Released",
    "Renew",
    "Reservation",
    "Restore",
    "RevokeCode",
    "Revoked",
    "SetPolicy",
    "Snapshot",
    "StateChanged",
    "SuspendMode",
    "SwitchRecord",
    "Tick",
    "TrailRecord",
    "UnregisterJob",
    "Usage",
    "WaiterRecord",
    "WorkloadCommand",
    "WorkloadReply",
    "YieldRequested",
    "decode_input",
    "decode_notice",
    "decode_record",
    "encode",
    "is_group_key",
    "subjects",
    "validate_id",
]

STREAM: Final = "TIMESLICE"
STREAM_SUBJECTS: Final = ("ts.v1.>",)
GROUPS_BUCKET: Final = "groups"
AGENTS_BUCKET: Final = "agents"
JOBS_BUCKET: Final = "jobs"
# A notice's header: the stream sequence of the input whose ``apply`` decided it. The group's record reflects that
# input once its ``last_seq`` reaches it (every input that decides a notice is stored, with its sequence), which is
# what a client's ``status()`` waits for to read its own writes. A header, not a field: clients that predate it
# decode notices strictly and would refuse a new field; a notice without it (an older orchestrator) promises nothing.
NOTICE_SEQ_HEADER: Final = "Ts-Seq"


def is_group_key(key: str) -> bool:
    """Whether a key of KV ``groups`` is a group's record. Keys starting with ``_`` (never a group id) are the
    orchestrator's own: ``_term``, the marker that fences the leader's writes."""
    return not key.startswith("_")


class _Msg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    pass


# --------------------------------------------------------------------------- job → orchestrator


class Acquire(_Msg, frozen=True, tag="acquire"):
    """Ask for the group. With ``claim_epoch`` set, it is a *claim*: the job released the group with no one
    waiting, and the stream stored this acquire as the group's next job input after that release (the
    publish carried ``Nats-Expected-Last-Subject-Sequence`` for ``ts.v1.job.<group>.>``), so the core's
    decision is already known: a grant at ``claim_epoch`` (the release's epoch + 1). The client returns at
    the PubAck without waiting for the notice; the orchestrator grants it like any acquire and must decide
    exactly that (``StreamChecker`` checks it; a claim it cannot honour is revoked)."""

    group: Id
    job: Id
    request_id: RequestId
    lease_ms: Ms = 30_000
    timeout_ms: Ms = 300_000
    waiter_ttl_ms: Ms = 5_000
    confirm_ms: Ms = 3_000
    claim_epoch: Count | None = None
    # The job's priority class, 0 (the default) to MAX_PRIORITY: when the group passes on, the waiter with the highest
    # class plus one per ``Limits.priority_ageing_ms`` it has waited goes first (ties: who asked first), so no waiter
    # starves; all at 0 is first come, first served (docs/scheduling.md, "Priorities").
    priority: Annotated[int, msgspec.Meta(ge=0, le=MAX_PRIORITY)] = 0


class Release(_Msg, frozen=True, tag="release"):
    group: Id
    job: Id
    request_id: RequestId
    epoch: Count


class Renew(_Msg, frozen=True, tag="renew"):
    """Keeps a holder's lease (``epoch`` set) or a waiter's place (``epoch`` None) alive."""

    group: Id
    job: Id
    request_id: RequestId
    epoch: Count | None = None


class Cancel(_Msg, frozen=True, tag="cancel"):
    group: Id
    job: Id
    request_id: RequestId
    reason: Reason = "cancelled"


class Phase(_Msg, frozen=True, tag="phase"):
    group: Id
    job: Id
    name: Name
    edge: Literal["start", "end"]
    epoch: Count | None = None
    error: Text | None = None


JobEvent = Acquire | Release | Renew | Cancel | Phase


# --------------------------------------------------------------------------- control


class Tick(_Msg, frozen=True, tag="tick"):
    group: Id


class ClearFault(_Msg, frozen=True, tag="clear_fault"):
    group: Id
    job: Id


class AgentLost(_Msg, frozen=True, tag="agent_lost"):
    group: Id
    node: Id


ControlEvent = Tick | ClearFault | AgentLost | SetPolicy


# --------------------------------------------------------------------------- agent → orchestrator


class JobRegistered(_Msg, frozen=True, tag="job_registered"):
    group: Id
    job: Id
    node: Id
    backend: Name = "noop"
    op_timeout_ms: OpTimeoutMs = DEFAULT_OP_TIMEOUT_MS


class JobUnregistered(_Msg, frozen=True, tag="job_unregistered"):
    group: Id
    job: Id
    node: Id


class OpResult(_Msg, frozen=True, tag="op_result"):
    group: Id
    op_id: OpId
    node: Id
    job: Id
    kind: OpKind
    epoch: Count
    ok: bool
    error: Text | None = None
    backend: Name = "noop"
    bytes_moved: Count = 0
    device_bytes_freed: Count = 0
    elapsed_ms: Elapsed = 0.0
    # The workload's suspend began at the job's release, before this operation (early suspend): elapsed_ms
    # covers only its end, work_ms the workload's whole call.
    began_at_release: bool = False
    work_ms: Elapsed | None = None
    # A restore that ran beside the snapshots its ``Restore.after`` names, by the agent's room rule (its OpStarted said
    # so too): the core may grant on it before those snapshots end. An older agent never says so: not overlapped.
    overlapped: bool = False


InputEvent = (
    Acquire
    | Release
    | Renew
    | Cancel
    | Phase
    | Tick
    | ClearFault
    | AgentLost
    | SetPolicy
    | JobRegistered
    | JobUnregistered
    | OpResult
)


# --------------------------------------------------------------------------- orchestrator → job


class Granted(_Msg, frozen=True, tag="granted", omit_defaults=True):
    """A grant. Fields at their defaults are left out on the wire (``omit_defaults``), so a client that predates one
    of them still reads a grant that does not use it (decoding is strict)."""

    group: str
    job: str
    request_id: str
    epoch: int
    waited_ms: int
    context_restored: bool
    lease_deadline_ms: int
    waiters: int = 0  # jobs still waiting for the group at this grant (see Contended)
    # The time left (ms) of this hold's minimum hold (``SetPolicy.min_hold_ms``): a release sooner than that, while
    # others wait, keeps the group for this job, so its workloads need not suspend at that release (0: none).
    min_hold_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_MIN_HOLD_MS)] = 0


class Released(_Msg, frozen=True, tag="released", omit_defaults=True):
    """The holder's release, answered. ``ahead``: with the group's predictive restore on, the job expected to ask
    next, whose context will be brought back while the group is idle (``SetPolicy.predict``): the releasing job's
    next acquire is then an ordinary one, never a claim (the prediction may start a switch before it). Left out on
    the wire when None (``omit_defaults``), so a client that predates it still reads every other release."""

    group: str
    job: str
    request_id: str
    epoch: int
    pending_waiters: int
    snapshot_deferred: bool
    ahead: Id | None = None


class Refused(_Msg, frozen=True, tag="refused"):
    group: str
    job: str
    request_id: str
    code: ErrorCode
    message: str
    holder: str | None = None
    epoch: int = 0
    limit: int = 0  # with QUEUE_FULL: the bound that was reached


class Revoked(_Msg, frozen=True, tag="revoked"):
    group: str
    job: str
    epoch: int
    reason: str
    code: RevokeCode | None = None  # what to act on (None: from an orchestrator older than the codes)


class Dequeued(_Msg, frozen=True, tag="dequeued"):
    group: str
    job: str
    request_id: str
    reason: str  # in words, for people; decisions read ``code``
    # The wait ended because no renewal of it reached the orchestrator in time (the waiter died, or the bus was
    # away longer than its TTL), or a renewal named a wait it does not know: a live client may simply ask again.
    lost: bool = False
    code: DequeueCode | None = None  # what to act on (None: from an orchestrator older than the codes)


class Contended(_Msg, frozen=True, tag="contended"):
    """A job began to wait for the group that ``job`` holds at ``epoch``, where nobody waited before (a grant
    made while others wait says so in ``Granted.waiters`` instead). A hint, never a decision: the holder's
    workloads may begin their suspend at its release instead of at the agent's command."""

    group: str
    job: str
    epoch: int
    waiters: int


Notice = Granted | Released | Refused | Revoked | Dequeued | Contended | YieldRequested


# --------------------------------------------------------------------------- orchestrator → agent


class _OpCommand(_Msg, frozen=True):
    """What both commands carry: operation ``op_id`` on ``job``'s context on ``node``, for the switch of ``epoch``
    of ``group``, due by ``deadline_ms``. Never sent itself."""

    op_id: OpId
    group: Id
    job: Id
    node: Id
    epoch: Count
    deadline_ms: Ms


class Snapshot(_OpCommand, frozen=True, tag="snapshot"):
    pass  # move ``job``'s context off ``node``'s accelerators (no docstring: it would enter the published schema)


class Restore(_OpCommand, frozen=True, tag="restore"):
    """Bring ``job``'s context back on ``node``. The orchestrator sends it together with the switch's
    snapshots; ``after`` names the snapshot operations on this node that the agent finishes first (whatever
    their outcome), so a restore never waits for a round trip through the orchestrator."""

    after: Annotated[tuple[OpId, ...], msgspec.Meta(max_length=64)] = ()


AgentCommand = Snapshot | Restore


class StateChanged(_Msg, frozen=True, tag="state_changed"):
    group: str
    state: GroupState
    previous: GroupState
    epoch: int
    holder: str | None
    active_job: str | None
    reason: str


class Quarantined(_Msg, frozen=True, tag="quarantined"):
    """The orchestrator stopped serving ``group``: its record cannot be loaded, decoded or stored (``reason``).
    Every other group goes on. ``lifted``: the record is usable again (repaired, then the orchestrator restarted).
    On ``ts.v1.group.<group>.quarantine``; ``timeslice status`` shows the latest one of each group."""

    group: str
    reason: str
    lifted: bool = False


class OpStarted(_Msg, frozen=True, tag="op_started"):
    """An agent started an operation. ``overlapped``: a restore started beside the snapshots its
    ``Restore.after`` names, because the node had room for both contexts at once."""

    op_id: str
    group: str
    job: str
    node: str
    kind: OpKind
    epoch: int
    backend: str
    overlapped: bool = False


# --------------------------------------------------------------------------- workload channel (request/reply)


class RegisterJob(_Msg, frozen=True, tag="register"):
    """A job asks its node's agent to manage its context (``ts.rpc.agent.<node>.register.<job>``). ``proof``: the
    token the agent's Unix socket handed the registering process (``timeslice_client._agent_socket``), which
    proves its pid and uid; without one only backends that touch no process are accepted."""

    group: Id
    job: Id
    backends: Annotated[tuple[Name, ...], msgspec.Meta(max_length=8)] = ("app_channel",)
    pids: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, le=2**31)], ...], msgspec.Meta(max_length=4096)] = ()
    pgid: Annotated[int, msgspec.Meta(ge=0, le=2**31)] | None = None
    mode: SuspendMode = SuspendMode.OFFLOAD
    tags: Annotated[tuple[Name, ...], msgspec.Meta(max_length=32)] = ()
    op_timeout_ms: OpTimeoutMs = DEFAULT_OP_TIMEOUT_MS
    endpoints: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=512)], ...], msgspec.Meta(max_length=16)] = ()
    proof: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    # The registering channel's own token: the agent names it in every WorkloadCommand, and a channel answers only
    # its own, so a command meant for a process that died never reaches the process that registered next as the job.
    channel: Name | None = None
    # A job that registers no handler binds its process instead (the client, at its first acquire): the agent
    # gives it the node's default backend (``backends`` is then ignored), or leaves it to the lock alone.
    bind: bool = False


class UnregisterJob(_Msg, frozen=True, tag="unregister"):
    """A job leaves its node's agent. ``channel``: only the registration of that workload channel leaves (the job's
    other processes stay registered); None: the whole job."""

    group: Id
    job: Id
    channel: Name | None = None


class ClearJobFault(_Msg, frozen=True, tag="clear_job_fault"):
    job: Id


class AgentReply(_Msg, frozen=True, tag="agent_reply"):
    ok: bool
    error: str | None = None
    state: JobState | None = None
    code: str | None = None  # why it was refused (the agent's refusal code, e.g. "unproven", "not_owned")
    # A bind's answer: the backends the job has now (empty: the lock alone).
    backends: Annotated[tuple[Name, ...], msgspec.Meta(max_length=8)] | None = None
    kept: bool = False  # a bind's answer: the job's own registration (its handler) was there and stays as it was


class WorkloadCommand(_Msg, frozen=True, tag="workload_command"):
    """Agent → workload (``ts.rpc.workload.<node>.<job>``)."""

    op_id: str
    action: Literal["suspend", "resume"]
    mode: SuspendMode = SuspendMode.OFFLOAD
    tags: tuple[str, ...] = ()
    epoch: int = 0
    channel: Name | None = None  # RegisterJob.channel of the registration it is for (None: any channel answers)


class WorkloadReply(_Msg, frozen=True, tag="workload_reply"):
    op_id: OpId
    ok: bool
    error: Text | None = None
    bytes_moved: Count = 0
    device_bytes_freed: Count = 0
    elapsed_ms: Elapsed = 0.0  # the handler's own call
    began_at_release: bool = False  # the suspend began at the job's release, before the command came


# --------------------------------------------------------------------------- codecs

_encoder: Final = msgspec.json.Encoder()
_input_decoder: Final = msgspec.json.Decoder(InputEvent)
_notice_decoder: Final = msgspec.json.Decoder(Notice)
_record_decoder: Final = msgspec.json.Decoder(GroupRecord)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> InputEvent:
    return _input_decoder.decode(data)


def decode_notice(data: bytes) -> Notice:
    """A notice; a ``code`` a newer orchestrator added reads as None (as from one older than the codes)."""
    try:
        return _notice_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raw = msgspec.json.decode(data)
        if not isinstance(raw, dict) or raw.get("code") is None:
            raise
        try:  # valid but for its code: one this client does not know
            return cast(Notice, msgspec.convert({**raw, "code": None}, Notice))
        except msgspec.ValidationError:
            raise exc from None


def decode_record(data: bytes) -> GroupRecord:
    return _record_decoder.decode(data)
