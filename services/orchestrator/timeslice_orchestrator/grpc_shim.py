"""The documented gRPC API of the orchestrator, as a thin shim over the bus.

Serves ``timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService`` and, with the very same
handlers, its earlier name ``accelerator_orchestrator.v1alpha1.AcceleratorOrchestratorService``
(identical messages), plus the gRPC health service and server reflection. No lock logic lives here:
each (group, job) a caller names gets an :class:`~timeslice_client.AsyncTimeSliceClient`, all of them
on one NATS connection, and the calls become that client's ``acquire()`` / ``release()``, so gRPC
callers and bus clients wait in the same FIFO queue of the same group.

* **Acquire** blocks until the grant. A call that ends first (deadline, cancellation, a dropped
  connection) is cancelled by grpc, and the client's ``acquire()`` then withdraws the wait; if the
  grant crossed it, the orchestrator releases that grant (never a phantom holder). ``waited_ms`` and
  ``context_restored`` are the orchestrator's own figures. A job that already holds the group gets it
  back at once (``waited_ms`` 0): a retried Acquire is harmless.
* **Leases.** A gRPC caller holds a lease like any client: the shim's client renews it in the
  background. The caller's liveness is its connection: the shim remembers the connection (peer)
  whose Acquire got the grant and, every ``liveness_interval_s``, lists the server's open connections
  through channelz (:func:`timeslice_client._internal.grpc_server.serving.live_peers`). Once the holder's connection
  has been gone for one lease, the shim gives the group back. A caller that comes back in time on a
  new connection (any Acquire or Yield of that job) carries the hold over to it. Server keepalive
  pings drop connections whose peer vanished without closing them (host or network down). If the shim
  itself dies, nobody renews, and the orchestrator revokes the grant after the lease.
  Why the connection, not the calls: the published API has no heartbeat, and an RL step may hold the
  group for minutes without a call, so call activity cannot tell a busy caller from a dead one; the
  open HTTP/2 connection can, and grpc.aio has no connection-closed callback, hence channelz. Caveat:
  a gRPC client channel that stays idle (no calls) past its idle timeout (30 min by default in
  gRPC) closes its connection, so holds longer than that need a call in between (e.g.
  GetGroupStatus) or a larger ``grpc.client_idle_timeout_ms``.
* **Who calls.** Every call comes from an identity (``timeslice_client._internal.grpc_server.auth_config``): a
  bearer token (``timeslice auth job``), a client certificate naming a job, or the local user on loopback. Acquire
  and Yield act as the job they name, and only that job's identity may make them (PERMISSION_DENIED otherwise, also
  for a hold taken over the bus); ListGroups and GetGroupStatus take any identity. No identity: UNAUTHENTICATED.
  ``insecure`` (``--grpc-insecure``) serves anyone, and says so when it starts. docs/security.md, "Identities on the
  gRPC APIs".
* **GetGroupStatus** reads the group's stored record once it reflects every Acquire and Yield made through this shim
  to the group (read-your-writes, as ``AsyncTimeSliceClient.status``; the orchestrator stores records just after it
  answers), waiting at most ``request_timeout_s``; past that it answers the freshest record with the trailing
  metadata ``timeslice-stale: true``.
* **Errors.** Bad ids → INVALID_ARGUMENT; Yield by a job that does not hold the group →
  PERMISSION_DENIED naming the holder; a faulted job → FAILED_PRECONDITION; the bus unreachable →
  UNAVAILABLE; an unknown group in GetGroupStatus → NOT_FOUND.
"""

from __future__ import annotations

import os

# The services start subprocesses (``timeslice up`` starts the agent) with fork+exec, never using gRPC
# in a child: grpc's fork handlers would only log that they skip. Must be set before grpc loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import argparse
import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2
from nats.aio.client import Client as NATS
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue
from pydantic import Field
from pydantic_settings import SettingsConfigDict
from timeslice_client import AsyncTimeSliceClient, Grant
from timeslice_client._group_reads import read_after
from timeslice_client._grpc import accelerator_orchestrator_pb2 as legacy_pb2
from timeslice_client._grpc import timeslice_orchestrator_pb2 as pb
from timeslice_client._internal.grpc_server.auth_config import auth_settings_from_args
from timeslice_client._internal.grpc_server.beside import (
    ShimSettings,
    listen_settings_from_args,
    open_shim,
    serve_beside,
)
from timeslice_client._internal.grpc_server.guard import Authenticator, authenticate, authorize, serve_health
from timeslice_client._internal.grpc_server.serving import SERVER_OPTIONS, Handler, bind, live_peers, normalize_peer
from timeslice_client.bus import connect, kv_keys
from timeslice_client.errors import (
    AcquireTimeout,
    InvalidId,
    LockLost,
    TimeSliceError,
    Unavailable,
)
from timeslice_client.protocol import (
    GROUPS_BUCKET,
    JOBS_BUCKET,
    GroupRecord,
    decode_record,
    is_group_key,
    validate_id,
)

from ._grpc_answers import agent_states, group_status, status_code
from ._tasks import cancel_and_wait

if TYPE_CHECKING:
    from .service import Orchestrator

__all__ = [
    "LEGACY_SERVICE",
    "SERVICE",
    "STALE_METADATA",
    "GrpcConfig",
    "OrchestratorGrpcShim",
    "from_args",
    "ready",
    "run_beside",
]

log = logging.getLogger("timeslice.orchestrator.grpc")

SERVICE = pb.DESCRIPTOR.services_by_name["TimeSliceOrchestratorService"].full_name
LEGACY_SERVICE = legacy_pb2.DESCRIPTOR.services_by_name["AcceleratorOrchestratorService"].full_name

Ctx = grpc.aio.ServicerContext[Any, Any]

# GetGroupStatus answered with a record that does not yet reflect the calls made through this shim says so in its
# trailing metadata under this key; it waits for them for at most this share of the time its caller's deadline leaves.
STALE_METADATA = "timeslice-stale"
_WAIT_SHARE = 0.8


def _last_seq(rec: GroupRecord | None) -> int:
    return rec.last_seq if rec is not None else 0


class GrpcConfig(ShimSettings):
    """The orchestrator's gRPC front end (env ``TIMESLICE_GRPC_*``); who may call it: :class:`GrpcAuthSettings`."""

    model_config = SettingsConfigDict(env_prefix="TIMESLICE_GRPC_", extra="ignore")

    port: int = Field(default=50051, ge=0, le=65535)
    health_port: int | None = Field(default=None, ge=0, le=65535)  # the health service alone, plaintext (probes)
    health_host: str = "127.0.0.1"
    lease_s: float = Field(default=30.0, ge=1.0)
    max_wait_s: float = Field(default=24 * 3600.0, gt=0, le=7 * 24 * 3600.0)  # one bus wait; Acquire re-queues
    liveness_interval_s: float = Field(default=1.0, gt=0)
    idle_client_s: float = Field(default=600.0, gt=0)
    request_timeout_s: float = Field(default=5.0, gt=0)


@dataclass(slots=True)
class _Job:
    client: AsyncTimeSliceClient
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    peer: str | None = None  # the connection that holds the grant
    gone_since: float | None = None  # monotonic time its connection was first seen gone
    calls: int = 0
    last_used: float = field(default_factory=time.monotonic)

    def attach(self, peer: str) -> None:
        self.peer = normalize_peer(peer)
        self.gone_since = None


class OrchestratorGrpcShim:
    """``port = await shim.start()`` … ``await shim.stop()``; or ``await shim.run()`` / ``shim.shutdown()``."""

    def __init__(self, config: GrpcConfig | None = None, *, nats_url: str | None = None) -> None:
        self.config = config or GrpcConfig()
        self.nats_url = nats_url
        self._nc: NATS | None = None
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self.auth = Authenticator(
            self.config, mutual_tls=self.config.tls_client_ca is not None, server_port=lambda: self.port
        )
        self.health_port: int | None = None
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._groups_kv: KeyValue | None = None
        self._jobs_kv: KeyValue | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._serving: bool | None = None
        self.port: int | None = None
        self.started = asyncio.Event()
        self.released_for_lost_connection = 0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}" if self.port is not None else "-"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        cfg = self.config
        server = grpc.aio.server(options=SERVER_OPTIONS)
        handlers: dict[str, Handler] = {
            "Acquire": self._acquire,
            "Yield": self._yield,
            "ListGroups": self._list_groups,
            "GetGroupStatus": self._group_status,
        }
        service = pb.DESCRIPTOR.services_by_name["TimeSliceOrchestratorService"]
        legacy = legacy_pb2.DESCRIPTOR.services_by_name["AcceleratorOrchestratorService"]
        names = [bind(server, service, handlers), bind(server, service, handlers, name=legacy.full_name)]
        self.port = open_shim(server, cfg, self._health, names, log)  # first: it may refuse to serve
        self._nc = await connect(self.nats_url, name="timeslice-grpc-shim")
        self._server = server
        await server.start()
        if cfg.health_port is not None:
            self._health_server, self.health_port = await serve_health(self._health, cfg.health_host, cfg.health_port)
        await self._set_serving(self._nc.is_connected)
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop(), name="timeslice-grpc-liveness")
        log.info(
            "gRPC API on %s:%d%s; %s",
            cfg.host,
            self.port,
            " (mutual TLS)" if cfg.tls_client_ca else " (TLS)" if cfg.tls_cert else "",
            self.auth.describe(),
            extra={"services": names, "health_port": self.health_port},
        )
        return self.port

    async def stop(self) -> None:
        """Stop serving. Waiting callers are cancelled (their waits withdrawn); groups held by gRPC
        callers are not released: as after a crash, each keeps its group for one lease, and a caller
        that calls again in time (on a restarted shim) keeps it."""
        self._stop.set()
        if self._server is not None:
            await self._set_serving(False)
            await self._server.stop(self.config.stop_grace_s)
        if self._health_server is not None:
            await self._health_server.stop(0)
        await cancel_and_wait(self._watch)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()  # first: a client closed on a closed connection releases nothing
        for j in self._jobs.values():
            with contextlib.suppress(Exception):
                await j.client.close()
        self._jobs.clear()

    async def run(self) -> None:
        await self.start()
        try:
            await self._stop.wait()
        finally:
            await self.stop()

    def shutdown(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ the lock

    async def _acquire(self, req: pb.AcquireRequest, ctx: Ctx) -> pb.AcquireResponse:
        group, job = await self._ids(ctx, req.group_id, req.job_id)
        await authorize(ctx, self.auth, log, job, group)
        j = self._job(group, job)
        j.calls += 1
        try:
            await self._bus_up(ctx)
            async with j.lock:  # one Acquire per job at a time; the next one finds the grant
                if j.client.holding:
                    j.attach(ctx.peer())
                    return pb.AcquireResponse(success=True, waited_ms=0, context_restored=False)
                grant = await self._wait_for_grant(j.client, ctx.time_remaining())
                left = ctx.time_remaining()
                if left is not None and left <= 0:  # the call ended as the grant arrived
                    with contextlib.suppress(TimeSliceError):
                        await j.client.release()
                    await ctx.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        "the deadline passed as the group was granted; the grant was given back",
                    )
                j.attach(ctx.peer())
                return pb.AcquireResponse(
                    success=True, waited_ms=grant.waited_ms, context_restored=grant.context_restored
                )
        except TimeSliceError as exc:
            await self._abort(ctx, exc, group, job)
        finally:
            j.calls -= 1
            j.last_used = time.monotonic()

    async def _wait_for_grant(self, client: AsyncTimeSliceClient, remaining: float | None) -> Grant:
        if remaining is not None:
            # The call's own deadline cancels this first (and the wait is withdrawn); the bus
            # timeout is a backstop a little later.
            return await client.acquire(timeout=remaining + 1.0)
        while True:  # no deadline: wait as long as it takes
            try:
                return await client.acquire(timeout=self.config.max_wait_s)
            except AcquireTimeout:
                continue

    async def _yield(self, req: pb.YieldRequest, ctx: Ctx) -> pb.YieldResponse:
        group, job = await self._ids(ctx, req.group_id, req.job_id)
        await authorize(ctx, self.auth, log, job, group)  # before anything is read: a hold taken over the bus too
        j = self._jobs.get((group, job))
        try:
            await self._bus_up(ctx)
            if j is None or (not j.client.holding and j.client.epoch is None):
                rec = await self._record(group)
                if rec is None or rec.holder is None or rec.holder.job != job:
                    await self._deny(ctx, group, job, rec)
                # The group's record names this job as holder, but this shim holds nothing for it
                # (it restarted, or the job acquired through another front end): take the hold over
                # (the holder's acquire is answered at once with the same grant), then yield it.
                j = self._job(group, job)
                await j.client.acquire(timeout=self.config.request_timeout_s)
            j.calls += 1
            try:
                r = await j.client.release()
            finally:
                j.calls -= 1
                j.peer, j.gone_since, j.last_used = None, None, time.monotonic()
            return pb.YieldResponse(
                success=True, pending_waiters=r.pending_waiters, snapshot_deferred=r.snapshot_deferred
            )
        except LockLost as exc:
            rec = None
            with contextlib.suppress(TimeSliceError):
                rec = await self._record(group)
            await self._deny(ctx, group, job, rec, str(exc))
        except AcquireTimeout:
            await self._deny(ctx, group, job, await self._record(group))
        except TimeSliceError as exc:
            await self._abort(ctx, exc, group, job)

    async def _deny(self, ctx: Ctx, group: str, job: str, rec: GroupRecord | None, why: str = "") -> NoReturn:
        if rec is not None and rec.holder is not None:
            who = f"job {rec.holder.job!r} holds it (epoch {rec.holder.epoch})"
        else:
            who = "nobody holds it"
        detail = f" ({why})" if why and "lease" in why else ""
        await ctx.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"job {job!r} does not hold group {group!r}: {who}{detail}; Acquire it first",
        )

    # ------------------------------------------------------------------ status

    async def _list_groups(self, req: pb.ListGroupsRequest, ctx: Ctx) -> pb.ListGroupsResponse:
        await authenticate(ctx, self.auth, log)
        try:
            await self._bus_up(ctx)
            assert self._nc is not None
            keys = await kv_keys(self._nc, GROUPS_BUCKET, timeout=self.config.request_timeout_s)  # not kv.keys()
            return pb.ListGroupsResponse(group_ids=[k for k in keys if is_group_key(k)])
        except TimeSliceError as exc:
            await self._abort(ctx, exc)

    async def _group_status(self, req: pb.GetGroupStatusRequest, ctx: Ctx) -> pb.GetGroupStatusResponse:
        await authenticate(ctx, self.auth, log)
        try:
            group = validate_id("group", req.group_id)
            await self._bus_up(ctx)
            rec = await self._record_after_calls(group, ctx)
            if rec is None:
                await ctx.abort(grpc.StatusCode.NOT_FOUND, f"group {group!r} not found (no job ever acquired it)")
            return pb.GetGroupStatusResponse(
                group=group_status(rec), agent_job_states=await agent_states(rec, lambda: self._kv(JOBS_BUCKET))
            )
        except TimeSliceError as exc:
            await self._abort(ctx, exc)

    async def _record_after_calls(self, group: str, ctx: Ctx) -> GroupRecord | None:
        """The group's record once it reflects every call made through this shim to the group (its jobs' clients'
        read floors: ``AsyncTimeSliceClient.status``), so that a caller's GetGroupStatus after its Acquire or Yield
        shows that call. Waited for at most ``request_timeout_s`` (and within the call's deadline); past that the
        freshest record is answered, with the trailing metadata ``timeslice-stale: true`` (the published API has no
        field for it)."""
        floor = max((j.client._read_floor for (g, _), j in list(self._jobs.items()) if g == group), default=0)
        within = self.config.request_timeout_s
        if (left := ctx.time_remaining()) is not None:
            within = min(within, left * _WAIT_SHARE)
        rec, caught_up = await read_after(lambda: self._record(group), _last_seq, floor, within)
        if not caught_up:
            log.warning(
                "group %s: its stored record does not reflect the calls made through this shim yet (stream sequence "
                "%d of %d) after %.3g s; answering it",
                group,
                _last_seq(rec),
                floor,
                within,
                extra={"group": group},
            )
            ctx.set_trailing_metadata(((STALE_METADATA, "true"),))
        return rec

    # ------------------------------------------------------------------ plumbing

    def _job(self, group: str, job: str) -> _Job:
        j = self._jobs.get((group, job))
        if j is None:
            cfg = self.config
            assert self._nc is not None
            client = AsyncTimeSliceClient(
                job,
                group,
                self.nats_url,
                lease_s=cfg.lease_s,
                acquire_timeout_s=cfg.max_wait_s,
                request_timeout_s=cfg.request_timeout_s,
                nc=self._nc,
            )
            j = self._jobs[(group, job)] = _Job(client)
        return j

    async def _ids(self, ctx: Ctx, group: str, job: str) -> tuple[str, str]:
        try:
            return validate_id("group", group), validate_id("job", job)
        except InvalidId as exc:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _bus_up(self, ctx: Ctx) -> None:
        if self._nc is None or not self._nc.is_connected:
            await ctx.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the bus is not reachable from the orchestrator's gRPC shim ({self.nats_url or 'NATS'}); "
                "retry, or check NATS",
            )

    async def _kv(self, bucket: str) -> KeyValue:
        kv = self._groups_kv if bucket == GROUPS_BUCKET else self._jobs_kv
        if kv is None:
            assert self._nc is not None
            try:
                kv = await self._nc.jetstream(timeout=self.config.request_timeout_s).key_value(bucket)
            except Exception as exc:
                raise Unavailable(
                    f"the `{bucket}` bucket is not readable ({exc.__class__.__name__})", nats_url=self.nats_url
                ) from exc
            if bucket == GROUPS_BUCKET:
                self._groups_kv = kv
            else:
                self._jobs_kv = kv
        return kv

    async def _record(self, group: str) -> GroupRecord | None:
        kv = await self._kv(GROUPS_BUCKET)
        try:
            entry = await kv.get(group)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        except Exception as exc:
            raise Unavailable(
                f"reading group {group!r} failed ({exc.__class__.__name__})", nats_url=self.nats_url
            ) from exc
        return decode_record(entry.value) if entry.value else None

    async def _abort(self, ctx: Ctx, exc: TimeSliceError, group: str = "", job: str = "") -> NoReturn:
        code = status_code(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.warning("gRPC call failed: %s", exc, extra={"group": group, "job": job})
        await ctx.abort(code, str(exc))

    async def _set_serving(self, up: bool) -> None:
        if up == self._serving:
            return
        self._serving = up
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE, LEGACY_SERVICE):
            await self._health.set(name, status)

    async def _watch_loop(self) -> None:
        """Connection liveness of holders, health, and closing clients nobody uses any more."""
        cfg = self.config
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(cfg.liveness_interval_s):
                    await self._stop.wait()
            if self._stop.is_set():
                return
            try:
                await self._check(cfg)
            except Exception:
                log.exception("gRPC liveness check failed")

    async def _check(self, cfg: GrpcConfig) -> None:
        assert self._nc is not None
        await self._set_serving(self._nc.is_connected)
        live = live_peers()
        now = time.monotonic()
        for key, j in list(self._jobs.items()):
            if j.client.holding and j.peer is not None:
                if live is None or j.peer in live:
                    j.gone_since = None
                elif j.gone_since is None:
                    j.gone_since = now
                    log.info(
                        "holder's connection is gone; the group goes back in %.3g s unless it calls again",
                        cfg.lease_s,
                        extra={"group": key[0], "job": key[1], "peer": j.peer},
                    )
                elif now - j.gone_since >= cfg.lease_s and j.calls == 0 and not j.lock.locked():
                    log.warning(
                        "holder's connection gone for a lease: giving the group back",
                        extra={"group": key[0], "job": key[1], "peer": j.peer},
                    )
                    j.peer = j.gone_since = None
                    self.released_for_lost_connection += 1
                    try:
                        await j.client.release()
                    except TimeSliceError as exc:
                        log.info("release after a lost connection: %s", exc, extra={"group": key[0], "job": key[1]})
            elif (
                not j.client.holding and j.calls == 0 and not j.lock.locked() and now - j.last_used > cfg.idle_client_s
            ):
                del self._jobs[key]
                with contextlib.suppress(Exception):
                    await j.client.close()


# ---------------------------------------------------------------------- CLI wiring


def from_args(
    args: argparse.Namespace, nats_url: str | None, *, host: str = "127.0.0.1", auth_dir: Path | None = None
) -> OrchestratorGrpcShim:
    """The shim the flags ask for (the CLI calls it only when they turn gRPC on: ``cli._grpc_wanted``). ``auth_dir``:
    where the trusted account is when no ``--grpc-trust-account`` names one (``timeslice up``: its data dir's)."""
    extra = auth_settings_from_args(args)
    if "trust_account" not in extra and auth_dir is not None and (auth_dir / "nats-auth.conf").exists():
        extra["trust_account"] = str(auth_dir)
    listen = listen_settings_from_args(args, port=args.grpc_port, host=args.grpc_host or host)
    return OrchestratorGrpcShim(GrpcConfig(**listen, **extra), nats_url=nats_url)


async def run_beside(orch: Orchestrator, shim: OrchestratorGrpcShim | None) -> None:
    """``orch.run()``, with the gRPC API started once the orchestrator is connected and stopped when it ends. The
    API forwards every call to the bus, so a standby serves it as well as the leader does: every replica is ready
    and a load balancer may send calls to any of them."""
    started = shim.started if shim is not None else None
    await serve_beside(orch.run(), orch.connected, orch.shutdown, shim, started=started)


async def ready(orch: Orchestrator, shim: OrchestratorGrpcShim | None) -> None:
    """Wait until the orchestrator (and its gRPC API, if any) serves."""
    await orch.ready.wait()
    if shim is not None:
        await shim.started.wait()
