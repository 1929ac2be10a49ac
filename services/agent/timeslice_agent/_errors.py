"""The exception tree of ``timeslice_agent`` (one root, under the client's ``TimeSliceError``)::

    TimeSliceError                       (timeslice_client.errors)
    └── AgentServiceError                the agent's own errors
        ├── BackendError                 an operation failed; ``rolled_back``: the job's context is as before
        │   ├── BackendUnavailable       the backend cannot run on this node (driver, library, permission)
        │   ├── UnsupportedMode          a suspend mode the job's workload did not declare (WorkloadChannel)
        │   └── StreamClosed             a workload's WorkloadChannel stream ended before it answered a command
        ├── DriverError                  a CUDA checkpoint call returned an error (call, pid, driver code)
        │   └── UnknownProcessState      a process state this agent does not know (a newer driver's)
        ├── HttpError                    an app endpoint's request got no answer (refused, reset, timeout)
        ├── AgentSocketError             the agent cannot serve its socket (path, why)
        ├── PodListError                 the Kubernetes API did not list this node's pods (url, status, why)
        ├── OperationInProgress          a standalone operation asked while another runs on the job (ABORTED)
        └── Refused (also ValueError)    a message the agent will not act on; ``code`` (a Refusal) says why

Foreign errors (nats-py's, the driver binding's, the OS's) are translated at the boundary that meets them:
``_cuda`` into ``DriverError``, ``_app_endpoint`` into ``HttpError``, ``_pods`` into ``PodListError``, the checks of
``_untrusted`` into ``Refused``. Every error carries the values that explain it and says what to do.

Signals that never leave the agent stay beside the code that raises and catches them: ``_process_stop.NotStopped``
(the ``freeze`` backend turns it into a ``BackendError``), ``_nvml.NvmlUnavailable`` (``gpu_source()`` is then None:
no GPUs reported), ``_cuda._PidFailed`` (one process's failure, gathered into the operation's ``BackendError``) and
``service._Stopped`` (ends the task group of ``run()`` once a shutdown is asked).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Final

from timeslice_client.errors import TimeSliceError

__all__ = [
    "REFUSALS",
    "AgentServiceError",
    "AgentSocketError",
    "BackendError",
    "BackendUnavailable",
    "DriverError",
    "HttpError",
    "OperationInProgress",
    "PodListError",
    "Refusal",
    "Refused",
    "StreamClosed",
    "UnknownProcessState",
    "UnsupportedMode",
]


class AgentServiceError(TimeSliceError):
    """The root of the agent's errors."""


class BackendError(AgentServiceError):
    """An operation failed. ``rolled_back`` says whether the job's context is as it was before."""

    def __init__(self, message: str, *, rolled_back: bool = True) -> None:
        self.rolled_back = rolled_back
        super().__init__(message)


class BackendUnavailable(BackendError):
    """The backend cannot run on this node (missing driver, library or permission)."""


class UnsupportedMode(BackendError):
    """A suspend in ``mode``, which job ``job``'s workload did not declare among the modes it can carry out
    (``supported``, its ``WorkloadChannel`` registration's): refused, never sent to it, so nothing changed."""

    def __init__(self, job: str, mode: object, supported: Iterable[object]) -> None:
        self.job, self.mode = job, str(mode)
        self.supported = tuple(sorted(str(m) for m in supported))
        super().__init__(
            f"job {job!r} declared it can suspend in mode {', '.join(self.supported)} only, not "
            f"{self.mode}: ask for one of those, or leave the mode unset (its default)"
        )


class DriverError(AgentServiceError):
    """A checkpoint call returned an error: which call, for which process, and the driver's code."""

    def __init__(self, call: str, pid: int, code: str, detail: str = "") -> None:
        self.call, self.pid, self.code, self.detail = call, pid, code, detail
        super().__init__(f"{call}(pid {pid}) returned {code}" + (f": {detail}" if detail else ""))

    @property
    def timed_out(self) -> bool:
        """A lock not taken within its timeout: the driver documents ``CUDA_ERROR_NOT_READY`` for it (the process
        is left RUNNING); ``CUDA_ERROR_TIMEOUT`` is taken the same way."""
        return self.code in _LOCK_TIMED_OUT


_LOCK_TIMED_OUT = frozenset({"CUDA_ERROR_NOT_READY", "CUDA_ERROR_TIMEOUT"})


class UnknownProcessState(DriverError):
    """``cuCheckpointProcessGetState`` answered a state this agent does not know (a newer driver's, such as one
    for a checkpoint or restore in progress): a CUDA process, in a state nothing here may assume."""

    def __init__(self, pid: int, value: int) -> None:
        self.value = value
        super().__init__(
            "cuCheckpointProcessGetState",
            pid,
            f"CU_PROCESS_STATE_{value}",
            "a process state this agent does not know (a newer driver's); upgrade the agent",
        )


class HttpError(AgentServiceError):
    """The request did not get an answer (connection refused, reset, garbage, timeout)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        self.timed_out = timed_out
        super().__init__(message)


class AgentSocketError(AgentServiceError):
    """The agent cannot serve its socket at ``path``; the message says why and what to do."""

    def __init__(self, path: str, why: str) -> None:
        self.path = path
        super().__init__(f"the agent cannot serve its socket at {path}: {why}")


class PodListError(AgentServiceError):
    """The Kubernetes API at ``url`` did not list this node's pods: no answer, an HTTP ``status`` other than 200
    (None: no HTTP answer at all), or an answer that is no pod list; ``why`` says which and what to check."""

    def __init__(self, url: str, why: str, *, status: int | None = None) -> None:
        self.url, self.status, self.why = url, status, why
        super().__init__(f"listing pods at {url}: {why}")


class OperationInProgress(AgentServiceError):
    """A standalone operation asked for a job while another operation on it runs: refused at once (gRPC
    ``ABORTED``), never queued behind it. ``op_id``: the running one, when it is a standalone operation."""

    def __init__(self, job: str, op_id: str | None) -> None:
        self.job, self.op_id = job, op_id
        which = f"operation {op_id}" if op_id else "an operation of the orchestrator's switch"
        super().__init__(f"job {job!r} is busy: {which} runs on it; wait for it to end (GetOperation), then ask again")


class Refusal(enum.StrEnum):
    """Why a message was refused (a metric label: a fixed set)."""

    UNDECODABLE = "undecodable"  # not JSON, an unknown type or field, a field of the wrong type
    INVALID_ID = "invalid_id"  # a group/job/node/op id that cannot go into a subject or key
    WRONG_NODE = "wrong_node"  # a command or context for another node
    OUT_OF_RANGE = "out_of_range"  # an epoch, deadline or timeout outside its bounds
    TOO_LARGE = "too_large"  # too many pids, tags, endpoints, backends or ``after`` ids, or one too long
    FORBIDDEN_PROCESS = "forbidden_process"  # pid/pgid <= 1, past PID_MAX, or the agent's own
    WRONG_JOB = "wrong_job"  # a request whose payload names another job than its subject
    UNPROVEN = "unproven"  # a process-level backend for a job that did not prove its processes (agent socket)
    NOT_OWNED = "not_owned"  # a pid or group that is not the proven process's own, or runs as another uid
    WRONG_SUBJECT = "wrong_subject"  # a message delivered here that was not sent on this subject (a pushed stream copy)


REFUSALS: Final = tuple(r.value for r in Refusal)


class Refused(AgentServiceError, ValueError):
    """A message the agent will not act on; ``code`` says why, the message which field and what to send."""

    def __init__(self, code: Refusal, message: str) -> None:
        self.code = code
        super().__init__(message)


class StreamClosed(BackendError):
    """The stream ended before its workload answered (or before the command could be sent)."""
