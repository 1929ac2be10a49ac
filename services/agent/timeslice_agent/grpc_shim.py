"""The snapshot agent's gRPC API for standalone use: ``snapshot_agent.v1alpha1.SnapshotAgentService``.

For training services that schedule themselves and move a job's accelerator context directly,
without the orchestrator. A thin shim over :meth:`Agent.run_standalone` / :meth:`Agent.operation`:
the operations are the agent's own (same per-job state machine, lock, rollback, timeouts and events
in the stream), with true byte counts and elapsed times.

* ``Snapshot`` / ``Restore`` return an operation id at once; ``GetOperation`` reports PENDING,
  COMPLETE (``storage_bytes`` = bytes moved, ``snapshot_device_bytes`` = device bytes freed) or
  FAILED (``error``); an unknown id is NOT_FOUND. Restoring a job that already runs (or snapshotting
  one already saved) completes at once, with a real operation id.
* Backends: ``backend_config`` unset means the backends the job registered with (the workload
  channel); ``app_channel`` is the workload channel; ``cuda`` and ``app_endpoint`` are used when this
  agent has them. Anything else (``direct_memory``, ``memory_regions``, or a backend not installed
  here) is FAILED_PRECONDITION, naming what this agent supports.
* **Who calls** (``timeslice_client._internal.grpc_server.auth_config``): Snapshot and Restore act on the job they
  name, and only that job's identity (its bearer token or client certificate), the local user (a loopback caller
  running as the agent's user) or anyone on an ``--grpc-insecure`` agent may make them (PERMISSION_DENIED
  otherwise); GetOperation and Status take any identity; no identity is UNAUTHENTICATED.
* Bad ids → INVALID_ARGUMENT; a job the agent does not know (and no process target to take it on)
  → FAILED_PRECONDITION. A snapshot in a suspend mode that the job's ``WorkloadChannel`` registration did not declare
  → FAILED_PRECONDITION (nothing is started, nothing sent to the workload).
* ``WorkloadChannel``: a workload registers its job on the stream and takes its commands there
  (``_grpc_workload``); the same callers as for Snapshot and Restore may register a job.
"""

from __future__ import annotations

import os

# The services start subprocesses (``timeslice up`` starts the agent) with fork+exec, never using gRPC
# in a child: grpc's fork handlers would only log that they skip. Must be set before grpc loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import argparse
import logging
from typing import Any, NoReturn, TypedDict

import grpc
from grpc_health.v1 import health, health_pb2
from pydantic import Field
from pydantic_settings import SettingsConfigDict
from timeslice_client._grpc import snapshot_agent_pb2 as pb
from timeslice_client._internal.grpc_server.auth_config import auth_settings_from_args
from timeslice_client._internal.grpc_server.beside import (
    ShimSettings,
    listen_settings_from_args,
    open_shim,
    serve_beside,
)
from timeslice_client._internal.grpc_server.guard import Authenticator, authenticate, authorize
from timeslice_client._internal.grpc_server.serving import SERVER_OPTIONS, Handler, bind
from timeslice_client.protocol import JobState, OpKind, SuspendMode

from ._config import DEFAULT_GRPC_PORT
from ._errors import UnsupportedMode
from ._grpc_workload import WorkloadChannels
from ._standalone import OperationInProgress
from ._untrusted import Refusal, Refused, check_id, check_op_id
from ._workload_stream import of_job
from .backends import BackendUnavailable, available_backends, unavailable_backends
from .service import Agent

__all__ = ["SERVICE", "AgentGrpcConfig", "AgentGrpcShim", "from_args", "run_beside"]

_PERMISSION = frozenset({Refusal.UNPROVEN, Refusal.NOT_OWNED, Refusal.WRONG_JOB, Refusal.FORBIDDEN_PROCESS})
log = logging.getLogger("timeslice.agent.grpc")

SERVICE = pb.DESCRIPTOR.services_by_name["SnapshotAgentService"].full_name
Ctx = grpc.aio.ServicerContext[Any, Any]

_JOB_STATES = {
    JobState.IDLE: pb.JOB_STATE_IDLE,
    JobState.RUNNING: pb.JOB_STATE_RUNNING,
    JobState.TRANSITIONING: pb.JOB_STATE_TRANSITIONING,
    JobState.SAVED: pb.JOB_STATE_SAVED,
    JobState.FAULTED: pb.JOB_STATE_FAULTED,
}
_MODES = {pb.SUSPEND_MODE_OFFLOAD: SuspendMode.OFFLOAD, pb.SUSPEND_MODE_DISCARD: SuspendMode.DISCARD}
_APPS = {pb.APP_VLLM: "vllm", pb.APP_SGLANG: "sglang"}  # app_endpoint endpoints are "<app>+<url>" to the agent
# BackendConfig choices → the agent's backend names ("" = not implemented by timeslice at all).
_BACKENDS = {
    "cuda": "cuda",
    "app_endpoint": "app_endpoint",
    "app_channel": "app_channel",
    "direct_memory": "",
    "memory_regions": "",
}


class AgentGrpcConfig(ShimSettings):
    """The agent's gRPC API (env ``TIMESLICE_AGENT_GRPC_*``). Node-local by default; callers: ``GrpcAuthSettings``."""

    model_config = SettingsConfigDict(env_prefix="TIMESLICE_AGENT_GRPC_", extra="ignore")

    port: int = Field(default=DEFAULT_GRPC_PORT, ge=0, le=65535)


class _Plan(TypedDict, total=False):
    """What a call asks of its standalone operation beyond the job's registration: ``Agent.run_standalone``'s
    keywords of the same names (a key left out: as the job registered)."""

    backends: tuple[str, ...] | None
    pids: tuple[int, ...]
    mode: SuspendMode | None
    tags: tuple[str, ...] | None
    endpoints: tuple[str, ...]


class AgentGrpcShim:
    """``port = await shim.start()`` … ``await shim.stop()``, beside a running :class:`Agent`."""

    def __init__(self, agent: Agent, config: AgentGrpcConfig | None = None) -> None:
        self.agent = agent
        self.config = config or AgentGrpcConfig()
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self.port: int | None = None
        self.auth = Authenticator(
            self.config, mutual_tls=self.config.tls_client_ca is not None, server_port=lambda: self.port
        )
        self._channels = WorkloadChannels(agent, self.auth)

    async def start(self) -> int:
        cfg = self.config
        self._server = server = grpc.aio.server(options=SERVER_OPTIONS)
        handlers: dict[str, Handler] = {
            "Snapshot": self._snapshot,
            "Restore": self._restore,
            "GetOperation": self._get_operation,
            "Status": self._status,
            "WorkloadChannel": self._channels.serve,
        }
        bind(server, pb.DESCRIPTOR.services_by_name["SnapshotAgentService"], handlers)
        self.port = open_shim(server, cfg, self._health, (SERVICE,), log)
        await server.start()
        for name in ("", SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        # One health service per backend (``service="cuda"``, as the reference agent answers): SERVING where this
        # node can run it, NOT_SERVING where it cannot.
        for name in available_backends():
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        for name in unavailable_backends():
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info(
            "snapshot agent gRPC API on %s:%d; %s",
            cfg.host,
            self.port,
            self.auth.describe(),
            extra={"node": self.agent.node},
        )
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            for name in ("", SERVICE, *available_backends()):
                await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            await self._server.stop(self.config.stop_grace_s)
            self._server = None

    # ------------------------------------------------------------------ handlers

    async def _snapshot(self, req: pb.SnapshotRequest, ctx: Ctx) -> pb.SnapshotResponse:
        return pb.SnapshotResponse(operation_id=await self._start(req, ctx, OpKind.SNAPSHOT))

    async def _restore(self, req: pb.RestoreRequest, ctx: Ctx) -> pb.RestoreResponse:
        return pb.RestoreResponse(operation_id=await self._start(req, ctx, OpKind.RESTORE))

    async def _start(self, req: pb.SnapshotRequest | pb.RestoreRequest, ctx: Ctx, kind: OpKind) -> str:
        try:
            job = check_id("job", req.job_id)
            group = check_id("group", req.group) if req.group else None
        except Refused as exc:
            await self._refuse(ctx, exc)
        await authorize(ctx, self.auth, log, job, group)
        plan = await self._plan(req, ctx)
        stream = of_job(self.agent.node, job)
        mode = plan.get("mode")
        if kind is OpKind.SNAPSHOT and mode is not None and plan.get("backends") == ("app_channel",) and stream:
            try:
                stream.check_mode(mode)
            except UnsupportedMode as exc:
                await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        try:
            return await self.agent.run_standalone(job, kind, group=group, **plan)
        except OperationInProgress as exc:
            await ctx.abort(grpc.StatusCode.ABORTED, str(exc))
        except BackendUnavailable as exc:
            await self._unsupported(ctx, str(exc))
        except LookupError as exc:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0] if exc.args else exc))
        except Refused as exc:  # pids, tags, endpoints out of bounds
            await self._refuse(ctx, exc)
        except ValueError as exc:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def _plan(self, req: pb.SnapshotRequest | pb.RestoreRequest, ctx: Ctx) -> _Plan:
        which = req.backend_config.WhichOneof("backend") if req.HasField("backend_config") else None
        if which is None:
            # The deprecated enum's only choice is CUDA; unset means "as the job registered".
            return _Plan(backends=("cuda",)) if req.backend == pb.BACKEND_CUDA else _Plan()
        name = _BACKENDS.get(which, "")
        if not name:
            await self._unsupported(ctx, f"BackendConfig.{which} is not implemented by the timeslice agent")
        cfg = req.backend_config
        if which == "cuda":
            return _Plan(backends=(name,), pids=tuple(cfg.cuda.explicit_target.pids))
        if which == "app_endpoint":
            ep = cfg.app_endpoint
            if not ep.endpoints:
                await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "app_endpoint needs at least one endpoint")
            app = _APPS.get(ep.app)
            if app is None:
                await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "app_endpoint needs app APP_VLLM or APP_SGLANG")
            return _Plan(
                backends=(name,),
                mode=_MODES.get(ep.mode),
                tags=tuple(ep.tags) or None,
                endpoints=tuple(f"{app}+{url}" for url in ep.endpoints),
            )
        ch = cfg.app_channel
        return _Plan(backends=(name,), mode=_MODES.get(ch.mode), tags=tuple(ch.tags) or None)

    async def _refuse(self, ctx: Ctx, exc: Refused) -> NoReturn:
        """Counted (``timeslice_agent_refused{source="grpc"}``): a process the job has not proven its own
        (``_PERMISSION``) is PERMISSION_DENIED, a malformed request INVALID_ARGUMENT."""
        self.agent.metrics.refusal("grpc", exc.code)
        code = grpc.StatusCode.PERMISSION_DENIED if exc.code in _PERMISSION else grpc.StatusCode.INVALID_ARGUMENT
        await ctx.abort(code, str(exc))

    async def _unsupported(self, ctx: Ctx, why: str) -> NoReturn:
        have = set(available_backends())
        configs = [f"BackendConfig.{c}" for c, b in _BACKENDS.items() if b and b in have]
        await ctx.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{why}. This agent supports: {', '.join(configs) or 'none'}; or leave backend_config "
            f"unset to use a registered job's own backends (available here: {', '.join(sorted(have))})",
        )

    async def _get_operation(self, req: pb.GetOperationRequest, ctx: Ctx) -> pb.GetOperationResponse:
        await authenticate(ctx, self.auth, log)
        try:
            check_op_id(req.operation_id, "operation_id")
        except Refused as exc:
            await self._refuse(ctx, exc)
        op = self.agent.operation(req.operation_id)
        if op is None:
            await ctx.abort(
                grpc.StatusCode.NOT_FOUND,
                f"operation {req.operation_id!r} is not known to the agent on node {self.agent.node!r}",
            )
        elapsed = round(op.elapsed_ms)
        if not op.done or op.result is None:
            return pb.GetOperationResponse(status=pb.OPERATION_STATUS_PENDING, elapsed_ms=elapsed)
        r = op.result
        if r.ok:
            return pb.GetOperationResponse(
                status=pb.OPERATION_STATUS_COMPLETE,
                storage_bytes=r.bytes_moved,
                snapshot_device_bytes=r.device_bytes_freed,
                elapsed_ms=elapsed,
            )
        return pb.GetOperationResponse(status=pb.OPERATION_STATUS_FAILED, elapsed_ms=elapsed, error=r.error or "failed")

    async def _status(self, req: pb.StatusRequest, ctx: Ctx) -> pb.StatusResponse:
        await authenticate(ctx, self.auth, log)
        jobs = [
            pb.JobStatus(job_id=c.job, state=_JOB_STATES[c.state])
            for c in sorted(self.agent.jobs().values(), key=lambda c: c.job)
        ]
        accelerators = [
            pb.AcceleratorStatus(
                id=d.uuid or str(d.index),
                memory_used_bytes=d.memory_used_bytes,
                memory_total_bytes=d.memory_total_bytes,
            )
            for d in await self.agent.devices()
        ]
        return pb.StatusResponse(job_statuses=jobs, accelerator_statuses=accelerators)


# ---------------------------------------------------------------------- CLI wiring


def from_args(agent: Agent, args: argparse.Namespace) -> AgentGrpcShim | None:
    port = getattr(args, "grpc_port", None)
    if port is None or port < 0:
        return None
    listen = listen_settings_from_args(args, port=port, host=args.grpc_host or "127.0.0.1")
    return AgentGrpcShim(agent, AgentGrpcConfig(**listen, **auth_settings_from_args(args)))


async def run_beside(agent: Agent, shim: AgentGrpcShim | None) -> None:
    """``agent.run()``, with the gRPC API served while the agent is ready."""
    await serve_beside(agent.run(), agent.ready, agent.shutdown, shim)
