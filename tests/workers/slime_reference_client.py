"""A stand-in for the reference project's Python client (llm-d-incubation/llm-d-rl-time-slicing,
``pkg/client/python/timeslice/orchestrator/client.py``: ``TimeSliceOrchestratorClient``, exported by
``timeslice/__init__.py``), for when that package is not installed. It speaks the same wire: written from what that
client does, not copied from it, on stubs compiled from the proto *we* ship (``tests/grpc_proto_client.py``), so a
difference between our proto and the reference's would show here.

What the reference client does, and this one too:

* one insecure channel per client, with its channel options: a ``grpc.service_config`` whose retry policy (5
  attempts on UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED, DEADLINE_EXCEEDED) names the service
  ``timeslice.orchestrator.AcceleratorOrchestratorService`` (a name no server serves, so it never applies; kept as
  is, as the reference sends it);
* the stub of ``accelerator_orchestrator.v1alpha1.AcceleratorOrchestratorService`` (its ``_generated/__init__.py``
  binds ``accelerator_orchestrator_pb2_grpc``; ``TIMESLICE_REFERENCE_SERVICE=timeslice_orchestrator`` picks the
  renamed ``timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService`` its ``_generated`` also holds);
* ``acquire(job_id=None, group_id=None, timeout_sec=None)``: ``Acquire(AcquireRequest(job_id, group_id),
  timeout=timeout_sec)`` (None: no deadline, it blocks until granted), the ids defaulting to the constructor's;
  returns ``success``, ``waited_ms``, ``context_restored``;
* ``release(job_id=None, group_id=None, timeout_sec=None)``: ``Yield(YieldRequest(job_id, group_id))``; returns
  ``success``, ``pending_waiters``, ``snapshot_deferred``;
* ``get_status``, ``list_groups``, ``on_accelerators`` (acquire, then release in ``finally``), ``close``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any

import grpc

from ..grpc_proto_client import LEGACY_PROTO, ORCHESTRATOR_PROTO, Stub, compile_proto, held

__all__ = ["OrchestratorError", "TimeSliceOrchestratorClient"]

SERVICES = {
    "accelerator_orchestrator": (LEGACY_PROTO, "AcceleratorOrchestratorService"),
    "timeslice_orchestrator": (ORCHESTRATOR_PROTO, "TimeSliceOrchestratorService"),
}
DEFAULT_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "timeslice.orchestrator.AcceleratorOrchestratorService"}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2.0,
                    "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED", "ABORTED", "DEADLINE_EXCEEDED"],
                },
            }
        ]
    }
)
DEFAULT_CHANNEL_OPTIONS: list[tuple[str, Any]] = [("grpc.service_config", DEFAULT_SERVICE_CONFIG)]


class OrchestratorError(Exception):
    """A failed call (the reference wraps ``grpc.RpcError`` the same way): ``code`` and ``details``."""

    def __init__(self, err: grpc.RpcError) -> None:
        self.code = err.code() if isinstance(err, grpc.Call) else None
        self.details = err.details() if isinstance(err, grpc.Call) else str(err)
        super().__init__(f"{self.code}: {self.details}")


@dataclass(frozen=True)
class AcquireResult:
    success: bool
    waited_ms: int
    context_restored: bool


@dataclass(frozen=True)
class YieldResult:
    success: bool
    pending_waiters: int
    snapshot_deferred: bool


class TimeSliceOrchestratorClient:
    def __init__(
        self,
        target: str,
        job_id: str | None = None,
        group_id: str | None = None,
        channel_options: list[tuple[str, Any]] | None = None,
    ) -> None:
        proto, service = SERVICES[os.environ.get("TIMESLICE_REFERENCE_SERVICE", "accelerator_orchestrator")]
        self.target, self.job_id, self.group_id = target, job_id, group_id
        self.pb = compile_proto(proto)
        self._channel: grpc.Channel | None = grpc.insecure_channel(
            target, options=DEFAULT_CHANNEL_OPTIONS if channel_options is None else channel_options
        )
        self._stub = Stub(self._channel, self.pb, service)

    def __enter__(self) -> TimeSliceOrchestratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def acquire(
        self, job_id: str | None = None, group_id: str | None = None, timeout_sec: float | None = None
    ) -> AcquireResult:
        r = self._call("Acquire", self._job_request("AcquireRequest", job_id, group_id), timeout_sec)
        return AcquireResult(r.success, r.waited_ms, r.context_restored)

    def release(
        self, job_id: str | None = None, group_id: str | None = None, timeout_sec: float | None = None
    ) -> YieldResult:
        r = self._call("Yield", self._job_request("YieldRequest", job_id, group_id), timeout_sec)
        return YieldResult(r.success, r.pending_waiters, r.snapshot_deferred)

    def get_status(self, group_id: str | None = None, timeout_sec: float | None = None) -> Any:
        return self._call("GetGroupStatus", self.pb.GetGroupStatusRequest(group_id=self._group(group_id)), timeout_sec)

    def list_groups(self, timeout_sec: float | None = None) -> list[str]:
        return list(self._call("ListGroups", self.pb.ListGroupsRequest(), timeout_sec).group_ids)

    def on_accelerators(
        self, job_id: str | None = None, group_id: str | None = None, timeout_sec: float | None = None
    ) -> contextlib.AbstractContextManager[AcquireResult]:
        return held(lambda: self.acquire(job_id, group_id, timeout_sec), lambda: self.release(job_id, group_id))

    def _job_request(self, message: str, job_id: str | None, group_id: str | None) -> Any:
        """A request ``message`` for the job and the group (the call's, else the client's)."""
        return getattr(self.pb, message)(job_id=self._job(job_id), group_id=self._group(group_id))

    def _call(self, method: str, request: Any, timeout_sec: float | None) -> Any:
        """One call of the service (None: no deadline); a failure raised as ``OrchestratorError``, as the
        reference raises it."""
        try:
            return getattr(self._stub, method)(request, timeout=timeout_sec)
        except grpc.RpcError as e:
            raise OrchestratorError(e) from e

    def _job(self, job_id: str | None) -> str:
        if not (job_id or self.job_id):
            raise ValueError("no job_id: give it to the client or to the call")
        return job_id or self.job_id or ""

    def _group(self, group_id: str | None) -> str:
        if not (group_id or self.group_id):
            raise ValueError("no group_id: give it to the client or to the call")
        return group_id or self.group_id or ""


OrchestratorClient = TimeSliceOrchestratorClient  # the older name the guides' package tries first
