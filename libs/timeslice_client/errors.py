"""The exception tree of ``timeslice_client``.

::

    TimeSliceError
    ├── InvalidId            an id that can never be put into a subject or key
    ├── InvalidNatsUrl       a NATS URL (or one entry of a comma-separated list) that cannot name a server
    ├── InvalidRequest       a request the orchestrator refused as malformed
    │   └── GroupFull        the group's queue is at its bound; try again later or use another group
    ├── GroupQuarantined     the group's record is unusable; an operator must repair it (other groups work)
    ├── Unavailable          the bus (or the orchestrator behind it) did not answer in time
    │   └── BusUnreachable   no NATS server of the URL could be connected to (refused, or no answer in time)
    ├── AcquireTimeout       the group was not granted before the acquire's timeout
    │   └── AcquireAllTimeout  ``acquire_all`` ran out of time at one group (also an AcquireAllFailed)
    ├── AcquireAllFailed     ``acquire_all`` failed at one group; ``error`` says why (everything it took given back)
    ├── LockOrderError       a job asked for a group that sorts before one it holds (docs/multi-pool.md)
    ├── AcquireCancelled     the wait was cancelled, or the orchestrator dropped the waiter
    ├── JobFaulted           the job is faulted in its group; clear the fault first
    ├── HandlerError         a workload handler could not suspend or resume the job's state
    │   ├── UnresizableStorage  a registered tensor whose memory can never be freed (e.g. after ``.numpy()``)
    │   ├── MissingEngineMethod an object given as an inference engine lacks a method called (also TypeError)
    │   ├── EngineNotSleepable  an engine started without the setting its sleep needs
    │   ├── NoWeightReload      a discard suspend of an engine with no weight-reload hook (refused, nothing moved)
    │   └── EngineCallFailed    an engine's sleep or wake call failed (its words, and the state it is left in)
    ├── AgentRefused         the node's agent refused a registration (e.g. processes the job did not prove)
    ├── AgentError           the agent's gRPC API refused a request (``code``: the gRPC status code)
    │   └── OperationNotFound   no operation of that id (also LookupError)
    ├── OperationFailed      a snapshot or restore asked through the agent's gRPC API failed
    ├── OperationTimeout     it did not finish in the time waited (also TimeoutError; it may still finish)
    ├── CredentialsError     a credentials or TLS file that cannot be used (also ValueError)
    ├── MetricsServerError   a metrics endpoint could not listen (port taken, address not local)
    ├── GrpcRefusedToStart   gRPC settings that would serve unidentifiable callers, or incomplete ones (also ValueError)
    ├── TrustError           the account ``--grpc-trust-account`` names could not be read (also ValueError)
    ├── CallerRefused        a gRPC call refused for who made it (the shims answer it with its status code)
    │   ├── Unauthenticated     the caller proved no identity (no, bad, expired or revoked credential)
    │   └── PermissionDenied    the caller is known, but may not do this (another job's Acquire, a reader acting)
    └── LockLost             the caller does not hold the group (any more)
        ├── NotHolder        another job (or nobody) holds the group
        ├── StaleEpoch       the caller's grant is older than the group's current epoch
        └── LeaseExpired     the lease lapsed (not renewed in time) and the group moved on

Every error carries the values that explain it as attributes and says in its message what to do. Foreign errors
(nats-py's, grpc's, the OS's) are translated by type where they are met: ``_publish_rules`` and ``bus`` into
``Unavailable`` / ``BusUnreachable``, ``agent_client`` (by gRPC status code) into ``Unavailable``, ``InvalidRequest``,
``OperationNotFound`` or ``AgentError``, each ``from`` grpc's error. The gRPC shims' door (``guard`` and
``identity`` in ``_internal.grpc_server``, which re-export their errors from here) answers a ``CallerRefused`` with
UNAUTHENTICATED or PERMISSION_DENIED. The services' trees hang below the root:
``timeslice_orchestrator.OrchestratorError`` and ``timeslice_agent.AgentServiceError``.

Signals that never reach a caller stay beside the code that raises and catches them: ``_agent_socket.ProofUnavailable``
(no proof from the agent's socket: the job registers unproven), ``_shared_loop.LoopClosed`` and ``CallTimeout`` (the
blocking client turns them into ``TimeSliceError`` and ``Unavailable``), ``sglang_engine.CacheNotFlushed`` (becomes an
``EngineCallFailed``), ``_internal.bus_layout._PlacementRefused`` (a ``TimeSliceError`` that ``ensure_bus`` retries
within its wait), and ``_grants._WaitLost`` / ``_Superseded``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ._codes import DequeueCode

if TYPE_CHECKING:  # the gRPC agent client's types: grpc is an extra, imported only by ``agent_client``
    import grpc

    from .agent_client import Operation

__all__ = [
    "AcquireAllFailed",
    "AcquireAllTimeout",
    "AcquireCancelled",
    "AcquireTimeout",
    "AgentError",
    "AgentRefused",
    "BusUnreachable",
    "CallerRefused",
    "CredentialsError",
    "EngineCallFailed",
    "EngineNotSleepable",
    "GroupFull",
    "GroupQuarantined",
    "GrpcRefusedToStart",
    "HandlerError",
    "InvalidId",
    "InvalidNatsUrl",
    "InvalidRequest",
    "JobFaulted",
    "LeaseExpired",
    "LockLost",
    "LockOrderError",
    "MetricsServerError",
    "MissingEngineMethod",
    "NoWeightReload",
    "NotHolder",
    "OperationFailed",
    "OperationNotFound",
    "OperationTimeout",
    "PermissionDenied",
    "StaleEpoch",
    "TimeSliceError",
    "TrustError",
    "Unauthenticated",
    "Unavailable",
    "UnresizableStorage",
]


class TimeSliceError(Exception):
    """Root of every error raised by ``timeslice_client``."""


class InvalidId(TimeSliceError, ValueError):
    def __init__(self, kind: str, value: object, rule: str) -> None:
        self.kind = kind
        self.value = value
        self.rule = rule
        super().__init__(f"invalid {kind} id {value!r}: {rule}")


class InvalidNatsUrl(TimeSliceError, ValueError):
    """A NATS URL (one of a comma-separated list) that cannot name a server; ``entry`` the bad one, ``text`` all of
    it, ``source`` where it came from (``bus.NatsUrl.source``; None: given to the call that refused it)."""

    def __init__(self, entry: str, reason: str, text: str, source: str | None = None) -> None:
        self.entry = entry
        self.reason = reason
        self.text = text
        self.source = source
        context = ([f"in {text!r}"] if text.strip() != entry else []) + ([source] if source else [])
        where = f" ({'; '.join(context)})" if context else ""
        super().__init__(
            f"invalid NATS server {entry!r}{where}: {reason}; give one URL or several, comma-separated, such "
            "as nats://10.0.0.1:4222,nats://10.0.0.2:4222 (schemes: nats, tls, ws, wss; a bare host:port means "
            "nats://)"
        )


class InvalidRequest(TimeSliceError, ValueError):
    def __init__(self, message: str, *, group_id: str | None = None, job_id: str | None = None) -> None:
        self.group_id = group_id
        self.job_id = job_id
        super().__init__(message)


class GroupFull(InvalidRequest):
    """The group already has as many waiters as a record can hold (``max_waiters``)."""

    def __init__(self, group_id: str, job_id: str, max_waiters: int) -> None:
        self.max_waiters = max_waiters
        super().__init__(
            f"group {group_id!r} already has {max_waiters} waiters, the most it takes; try again once "
            "some have been served, or spread the jobs over more groups",
            group_id=group_id,
            job_id=job_id,
        )


class GroupQuarantined(TimeSliceError):
    """The orchestrator could not load, decode or store the group's record and stopped serving that group alone."""

    def __init__(self, group_id: str, reason: str) -> None:
        self.group_id = group_id
        self.reason = reason
        super().__init__(
            f"group {group_id!r} is quarantined by the orchestrator ({reason}); every other group works "
            "on. `timeslice status` shows it; see docs/operations.md to repair the record"
        )


class Unavailable(TimeSliceError):
    def __init__(self, what: str, *, nats_url: str | None = None, after_s: float | None = None) -> None:
        self.what = what
        self.nats_url = nats_url
        self.after_s = after_s
        where = f" at {nats_url}" if nats_url else ""
        when = f" after {after_s:.3g} s" if after_s is not None else ""
        super().__init__(
            f"{what}: no answer from the bus{where}{when}; check that NATS and the orchestrator are running "
            "(`timeslice up` starts both) and that TIMESLICE_NATS_URL points at them"
        )


class BusUnreachable(Unavailable):
    """No server of ``nats_url`` could be connected to: each refused the connection or could not be resolved
    (``refused``: at once), or none answered within ``after_s``. ``source`` says where the URL came from
    (``bus.NatsUrl.source``), ``reason`` the first failure, ``advice`` what to do about it."""

    def __init__(
        self, nats_url: str, source: str, reason: str, *, after_s: float | None, refused: bool, advice: str
    ) -> None:
        self.source = source
        self.reason = reason
        self.refused = refused
        self.advice = advice
        self.what = "cannot connect to NATS"
        self.nats_url = nats_url
        self.after_s = after_s
        how = (
            "every server refused the connection or could not be found"
            if refused
            else f"no server answered within {after_s:.3g} s"
            if after_s is not None
            else "the connection failed"
        )
        TimeSliceError.__init__(self, f"cannot connect to NATS at {nats_url} ({source}): {how} ({reason}); {advice}")


class AcquireTimeout(TimeSliceError, TimeoutError):
    def __init__(self, group_id: str, job_id: str, timeout_s: float, holder: str | None = None) -> None:
        self.group_id = group_id
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.holder = holder
        held = f" (held by {holder!r})" if holder else ""
        super().__init__(
            f"job {job_id!r} was not granted group {group_id!r} within {timeout_s:.3g} s{held}; "
            "the wait was cancelled. Retry with a longer timeout, or see `timeslice status` for who holds it"
        )


class AcquireAllFailed(TimeSliceError):
    """``acquire_all`` (or ``on_accelerators(groups=...)``) failed at ``group_id``, one of ``groups`` (the call's
    groups, in the order it takes them); ``error`` is that group's own error (also ``__cause__``). Before this is
    raised every group the call took is given back (``released``) and its wait withdrawn: the job holds and waits
    for nothing of the call, but for ``kept``, the groups it held before the call. ``unanswered``: released groups
    whose release got no answer (the bus was away): the orchestrator frees them when their lease lapses."""

    def __init__(
        self,
        job_id: str,
        groups: tuple[str, ...],
        group_id: str,
        error: BaseException,
        *,
        released: tuple[str, ...],
        kept: tuple[str, ...] = (),
        unanswered: tuple[str, ...] = (),
    ) -> None:
        self.job_id = job_id
        self.groups = groups
        self.group_id = group_id
        self.error = error
        self.released = released
        self.kept = kept
        self.unanswered = unanswered
        TimeSliceError.__init__(
            self,
            f"job {job_id!r} could not take groups {list(groups)} at once: group "
            f"{group_id!r} failed ({error}); {_given_back(released, kept, unanswered)}",
        )


class AcquireAllTimeout(AcquireAllFailed, AcquireTimeout):
    """``acquire_all`` was not granted ``group_id`` within ``timeout_s``, the bound of the whole call; also an
    :class:`AcquireTimeout` (and a ``TimeoutError``), as a single acquire's timeout is. ``holder``: the group's
    holder then (None: nobody, or not known)."""

    def __init__(
        self,
        job_id: str,
        groups: tuple[str, ...],
        group_id: str,
        error: BaseException,
        *,
        timeout_s: float,
        holder: str | None,
        released: tuple[str, ...],
        kept: tuple[str, ...] = (),
        unanswered: tuple[str, ...] = (),
    ) -> None:
        self.timeout_s = timeout_s
        self.holder = holder
        AcquireAllFailed.__init__(
            self, job_id, groups, group_id, error, released=released, kept=kept, unanswered=unanswered
        )
        held = f" (held by {holder!r})" if holder else ""
        self.args = (
            f"job {job_id!r} was not granted group {group_id!r}{held} within {timeout_s:.3g} s, the bound "
            f"of acquire_all({list(groups)}); {_given_back(released, kept, unanswered)}. Retry with a "
            "longer timeout, or see `timeslice status` for who holds it",
        )


def _given_back(released: tuple[str, ...], kept: tuple[str, ...], unanswered: tuple[str, ...]) -> str:
    out = (
        f"released what the call took ({', '.join(map(repr, released))})" if released else "the call had taken nothing"
    )
    if unanswered:
        out += (
            f" (no answer to the release of {', '.join(map(repr, unanswered))}: the orchestrator frees it when "
            "its lease lapses)"
        )
    out += " and withdrew its wait; nothing of the call is held or queued"
    if kept:
        out += f"; still held from before the call: {', '.join(map(repr, kept))}"
    return out


class LockOrderError(TimeSliceError):
    """Job ``job_id`` asked for ``group_id`` while it holds ``held``, groups that sort after it. A job takes its
    groups in one global order (sorted ids), so that jobs holding several can never wait for each other in a cycle;
    asking against it is refused at once, before anything is sent (nothing held is given up)."""

    def __init__(self, job_id: str, group_id: str, held: tuple[str, ...]) -> None:
        self.job_id = job_id
        self.group_id = group_id
        self.held = held
        every = sorted({group_id, *held})
        them = ", ".join(map(repr, held))
        super().__init__(
            f"job {job_id!r} asked for group {group_id!r} while it holds {them}, which sort after it: a job takes "
            "its groups in sorted order, so that two jobs can never each hold what the other waits for (deadlock). "
            f"Release {them} first, or take them together with acquire_all({every!r}) (docs/multi-pool.md)"
        )


class AcquireCancelled(TimeSliceError):
    """The wait ended without a grant. ``code``: why, as the orchestrator said it (``DequeueCode``; None when
    the client itself ended it, or from an orchestrator older than the codes); ``reason``: the same in words."""

    def __init__(self, group_id: str, job_id: str, reason: str, *, code: DequeueCode | None = None) -> None:
        self.group_id = group_id
        self.job_id = job_id
        self.reason = reason
        self.code = code
        super().__init__(f"the wait of job {job_id!r} for group {group_id!r} ended without a grant: {reason}")


class JobFaulted(TimeSliceError):
    def __init__(self, group_id: str, job_id: str, reason: str) -> None:
        self.group_id = group_id
        self.job_id = job_id
        self.reason = reason
        super().__init__(
            f"job {job_id!r} is faulted in group {group_id!r}: {reason}; fix the cause, then clear it with "
            f"`timeslice clear-fault --group {group_id} --job {job_id}`"
        )


class LockLost(TimeSliceError):
    """``epoch``: the group's current epoch (None: its record could not be read), ``holder`` its holder then."""

    def __init__(
        self, message: str, *, group_id: str, job_id: str, holder: str | None, epoch: int | None, your_epoch: int | None
    ) -> None:
        self.group_id = group_id
        self.job_id = job_id
        self.holder = holder
        self.epoch = epoch
        self.your_epoch = your_epoch
        super().__init__(message)


class NotHolder(LockLost):
    """``holder`` and ``epoch``: the group's holder and current epoch (epoch None: the record could not be read)."""

    def __init__(
        self, group_id: str, job_id: str, holder: str | None, epoch: int | None, your_epoch: int | None = None
    ) -> None:
        if epoch is None:
            who = "its record could not be read to say who does"
        elif holder == job_id:
            who = (
                f"the group's record names job {holder!r} at epoch {epoch}, but this client has no grant of it "
                "(another client with the same job id holds it, or a release of this one was not answered)"
            )
        elif holder:
            who = f"job {holder!r} holds it at epoch {epoch}"
        else:
            who = f"nobody holds it (the group is at epoch {epoch})"
        super().__init__(
            f"job {job_id!r} does not hold group {group_id!r}: {who}; acquire it first",
            group_id=group_id,
            job_id=job_id,
            holder=holder,
            epoch=epoch,
            your_epoch=your_epoch,
        )


class StaleEpoch(LockLost):
    def __init__(self, group_id: str, job_id: str, holder: str | None, epoch: int, your_epoch: int | None) -> None:
        super().__init__(
            f"job {job_id!r} used epoch {your_epoch} of group {group_id!r}, but the group is at epoch {epoch} "
            f"(holder {holder!r}); that grant is over, acquire again",
            group_id=group_id,
            job_id=job_id,
            holder=holder,
            epoch=epoch,
            your_epoch=your_epoch,
        )


class LeaseExpired(LockLost):
    def __init__(self, group_id: str, job_id: str, epoch: int, reason: str) -> None:
        super().__init__(
            f"job {job_id!r} lost group {group_id!r} at epoch {epoch}: {reason}; its lease was not renewed in "
            "time (a stalled event loop or a lost bus connection). Acquire again",
            group_id=group_id,
            job_id=job_id,
            holder=None,
            epoch=epoch,
            your_epoch=epoch,
        )


class HandlerError(TimeSliceError):
    """A workload handler could not suspend or resume (part of) the job's state."""

    def __init__(self, message: str, *, tag: str | None = None) -> None:
        self.tag = tag
        super().__init__(message)


class UnresizableStorage(HandlerError):
    """A tensor given to ``TorchOffloadHandler`` whose storage torch will not resize, so a switch could never free
    its memory: refused when the handler is made, or (made so later) at the suspend, before anything moves.
    ``what`` names the tensor (``parameter 'fc.weight'``, ``tensor [0]``, ...), ``nbytes`` its storage's size."""

    def __init__(self, tag: str, what: str, nbytes: int) -> None:
        self.what = what
        self.nbytes = nbytes
        super().__init__(  # the gist first: a fault reason on the wire keeps 256 characters
            f"a tensor of group {tag!r} cannot be freed at a switch: `tensor.numpy()` (or numpy, DLPack, shared "
            "memory) made its storage not resizable; register a `.clone()`, read values via "
            f"`t.detach().clone().numpy()` ({what}, {nbytes} bytes; one `.numpy()` on a CPU tensor marks its "
            "storage so for good, a torch rule)",
            tag=tag,
        )


class AgentRefused(TimeSliceError):
    """The node's agent refused a request of a job; ``code`` is the agent's refusal code (``unproven``: the job did
    not prove its processes through the agent's socket; ``not_owned``: a pid or process group that is not the
    registering process's own; ``wrong_job``, ``forbidden_process``, ...), ``reason`` its message."""

    def __init__(self, node_id: str, job_id: str, verb: str, code: str | None, reason: str) -> None:
        self.node_id = node_id
        self.job_id = job_id
        self.verb = verb
        self.code = code
        self.reason = reason
        super().__init__(
            f"the agent on node {node_id!r} refused {verb} of job {job_id!r}{f' ({code})' if code else ''}: {reason}"
        )


class CredentialsError(TimeSliceError, ValueError):
    """A credentials or TLS file that cannot be used (missing, unreadable, not a NATS ``.creds`` file)."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot use {self.path}: {reason}")


class MetricsServerError(TimeSliceError):
    """The metrics endpoint could not listen (port taken, address not local)."""

    def __init__(self, host: str, port: int, reason: str) -> None:
        self.host, self.port, self.reason = host, port, reason
        super().__init__(
            f"cannot serve metrics on {host}:{port} ({reason}); pass --metrics-port with a free "
            "port, 0 for any free port, or -1 to turn the metrics endpoint off"
        )


class AgentError(TimeSliceError):
    """The agent refused a request (``code`` is the gRPC status code)."""

    def __init__(self, message: str, *, code: grpc.StatusCode, target: str) -> None:
        self.code = code
        self.target = target
        super().__init__(f"snapshot agent at {target}: {message} ({code.name})")


class OperationNotFound(AgentError, LookupError):
    """The agent knows no operation of that id (it ended long ago, or was never asked)."""


class OperationFailed(TimeSliceError):
    """A snapshot or restore asked through the agent's gRPC API ended failed; ``operation`` is its final state."""

    def __init__(self, op: Operation) -> None:
        self.operation = op
        super().__init__(f"operation {op.op_id} failed after {op.elapsed_ms} ms: {op.error}")


class OperationTimeout(TimeSliceError, TimeoutError):
    """The operation did not end within the time waited for it; it may still end (poll ``get_operation()``)."""

    def __init__(self, op_id: str, timeout_s: float) -> None:
        self.op_id = op_id
        self.timeout_s = timeout_s
        super().__init__(
            f"operation {op_id} did not finish within {timeout_s:.3g} s; it may still finish: poll get_operation()"
        )


class MissingEngineMethod(HandlerError, TypeError):
    """The object given as an engine lacks a method the handler calls; ``method`` names it, ``type_name`` the
    object's type."""

    def __init__(self, engine: str, type_name: str, method: str, hint: str) -> None:
        self.engine = engine
        self.type_name = type_name
        self.method = method
        super().__init__(
            f"the {type_name!r} object given as a {engine} has no callable {method}(): pass the engine "
            f"object itself ({hint})"
        )


class EngineNotSleepable(HandlerError):
    """The engine was started without the setting its sleep needs (``setting``), so a suspend would free nothing
    or fail: refused when the handler is made."""

    def __init__(self, engine: str, setting: str, hint: str) -> None:
        self.engine = engine
        self.setting = setting
        super().__init__(f"the {engine} was started without {setting}, so it cannot release its device memory: {hint}")


class NoWeightReload(HandlerError):
    """A suspend that would drop the weights' contents, with no ``reload_weights`` hook to put them back: refused
    before the engine is touched (the job keeps running). ``why`` says what drops them."""

    def __init__(self, engine: str, why: str, hint: str) -> None:
        self.engine = engine
        self.why = why
        super().__init__(
            f"{engine}: {why} drops the weights' contents and no reload_weights hook was given to put "
            f"them back after waking: {hint}",
            tag="weights",
        )


class EngineCallFailed(HandlerError):
    """One of the engine's own calls raised. ``call`` is the call as made, ``reason`` the engine's exception (at most
    ``MESSAGE_CHARS``), ``state`` what the engine is left in, ``rolled_back`` whether a failed suspend left (or put)
    the engine back awake."""

    def __init__(self, engine: str, call: str, reason: str, state: str, *, rolled_back: bool) -> None:
        self.engine = engine
        self.call = call
        self.reason = reason
        self.state = state
        self.rolled_back = rolled_back
        super().__init__(f"{engine} {call} failed: {reason}; {state}")


class GrpcRefusedToStart(TimeSliceError, ValueError):
    """The gRPC settings would serve callers nobody can identify, or are incomplete."""


class TrustError(TimeSliceError, ValueError):
    """The trusted account could not be read from what ``--grpc-trust-account`` names."""


class CallerRefused(TimeSliceError):
    """A gRPC call refused for who made it."""


class Unauthenticated(CallerRefused):
    """The caller proved no identity (no, bad, expired or revoked credential)."""


class PermissionDenied(CallerRefused):
    """The caller is known, but may not do this (another job's Acquire or Yield, a reader acting)."""

    def __init__(self, message: str, *, caller: str, job: str, group: str | None) -> None:
        self.caller, self.job, self.group = caller, job, group
        super().__init__(message)
