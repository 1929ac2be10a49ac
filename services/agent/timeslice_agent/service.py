"""The node-local snapshot agent.

* announces itself in KV ``agents`` (a TTL makes a dead agent disappear) and keeps every job's
  context state on this node in KV ``jobs`` (key ``<node>.<job>``);
* serves registrations (``ts.rpc.agent.<node>.register.<job>`` …) and tells the orchestrator about them
  with ``JobRegistered`` events; a job proves its processes through the agent's node-local Unix socket
  (``_peer``), and a process-level backend acts only on processes so proven (``_ownership``);
* runs snapshot/restore commands from the orchestrator (``ts.v1.agent.<node>.cmd``, a durable
  consumer, so commands sent while it restarts are not lost): idempotent per op id, fenced by the
  group epoch, bounded by the command's deadline, rolled back where the backend can; every start
  and outcome goes to the event stream (``_operations`` runs them). An agent that runs in the orchestrator's
  process on its connection (``timeslice up``) is also handed its commands directly (:meth:`Agent.take`), one
  bus hop sooner; the stream's copy then only gets its acknowledgement;
* notices registered processes that died and unregisters them;
* on Kubernetes (``AgentConfig.pods``), binds the processes of this node's pods labelled with a job to that job
  (``_pod_discovery``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from timeslice_client._agent_socket import default_socket_path
from timeslice_client._internal.bus_layout import ensure_bus
from timeslice_client.bus import connect
from timeslice_client.protocol import (
    STREAM,
    AgentCommand,
    AgentReply,
    DeviceInfo,
    JobContext,
    JobState,
    OpKind,
    RegisterJob,
    Restore,
    Snapshot,
    SuspendMode,
    UnregisterJob,
    encode,
    subjects,
    validate_id,
)
from timeslice_client.workload import default_node_id

from ._config import AgentConfig
from ._heartbeat import Heartbeat
from ._host import alive
from ._job_book import JobBook, now_ms
from ._job_locks import JobLocks
from ._job_parts import without_dead
from ._nvml import GpuSource, gpu_source, gpu_source_error
from ._op_messages import refusal_result
from ._operations import Operations, OperationStatus
from ._ownership import ProcessGuard, ProcFS
from ._peer import PeerServer
from ._pod_discovery import PodDiscovery, pod_source_for
from ._pods import PodSource
from ._requests import Requests, log_refusal
from ._standalone import OpSettings, check_idle, standalone_context
from ._untrusted import Refusal, Refused, check_command, check_id, check_registration, shown
from .backends import acts_on_processes, make_backend
from .metrics import AgentMetrics

__all__ = ["Agent", "AgentConfig", "OperationStatus", "default_node_id"]

log = logging.getLogger("timeslice.agent")

_command_decoder = msgspec.json.Decoder(AgentCommand)


class Agent:
    """Run with ``await Agent(config).run()``; stop with ``shutdown()`` (idempotent)."""

    def __init__(
        self,
        config: AgentConfig | None = None,
        *,
        nc: NATS | None = None,
        metrics: AgentMetrics | None = None,
        pod_source: PodSource | None = None,
        gpus: GpuSource | None = None,
    ) -> None:
        """``pod_source``, ``gpus``: where the pod discovery (``config.pods``) lists pods and the GPUs' processes
        (None: the Kubernetes API ``config`` names, this node's NVML)."""
        self.config = config or AgentConfig()
        self.metrics = metrics if metrics is not None else AgentMetrics()
        self.node = validate_id("node", self.config.node_id)
        self._nc = nc
        self._own_nc = nc is None
        self._js: JetStreamContext | None = None
        self._heartbeat: Heartbeat | None = None  # once connected
        self._book = JobBook(  # KV ``jobs``
            self.node,
            fence=lambda group: self._ops.fence_for_new_job(group),  # noqa: PLW0108 - _ops is made below
            refused=lambda code: self.metrics.refusal("kv", code),
        )
        self._locks = JobLocks()  # one per job id, while in use
        self._guard = ProcessGuard(
            proc=ProcFS(self.config.proc_root),
            allowed_uids=self.config.allowed_uids,
            any_uid=self.config.allow_other_uids,
        )
        self._requests = Requests(
            self.node,
            self._book,
            self._locks,
            self.metrics,  # ts.rpc.agent.<node>.*
            guard=self._guard,
            default_backend=self.config.default_backend,
            unregister_wait_s=self.config.unregister_wait_s,
        )
        self._peer: PeerServer | None = None  # the agent socket, while running
        self._pods: PodDiscovery | None = None  # labelled pods' processes bound to their jobs (Kubernetes)
        if self.config.pods:
            source = pod_source or pod_source_for(self.config, self.node, self.metrics)  # raises when unusable
            gpus = gpus if gpus is not None else gpu_source()
            self._pods = PodDiscovery(
                self.node,
                source,
                config=self.config,
                book=self._book,
                locks=self._locks,
                requests=self._requests,
                guard=self._guard,
                metrics=self.metrics,
                gpus=gpus,
                nvml_error=gpu_source_error() if gpus is None else None,
            )
        self._ops = Operations(self.config, self._book, self._locks, self._guard, self.metrics)
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self._subs: list[Any] = []
        self._started_ms = now_ms()
        self._taken: collections.OrderedDict[str, None] = collections.OrderedDict()  # op ids handed over by take()

    @property
    def ready(self) -> asyncio.Event:
        return self._ready

    def jobs(self) -> dict[str, JobContext]:
        return dict(self._book.jobs)

    def leaving(self) -> frozenset[str]:  # the jobs whose unregistration waits for an operation running on them
        return self._requests.leaving

    def shutdown(self) -> None:
        self._stop.set()

    async def register(self, req: RegisterJob) -> AgentReply:
        """A registration that did not come over the bus (the gRPC ``WorkloadChannel``), on the bus's own path."""
        return await self._requests.register(req)

    def unregister_soon(self, req: UnregisterJob) -> bool:
        """End a registration whose carrier is gone (a closed ``WorkloadChannel`` stream) in a task of the agent's own,
        as a waiting unregistration does; False when the agent is not serving (or too many wait already)."""
        return self._requests.unregister_soon(req)

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        nc = self._nc
        if nc is None:
            nc = self._nc = await connect(self.config.nats_url, name=f"timeslice-agent-{self.node}")
        self._js = nc.jetstream()
        buckets = await ensure_bus(self._js, self.config.bus)
        self._book.bind(nc, self._js, buckets.jobs)
        self._requests.bind(self._js)
        self._ops.bind(nc, self._js, buckets.groups)
        heartbeat = self._heartbeat = Heartbeat(self.node, buckets.agents, self._started_ms)
        try:
            await self._serve_socket()
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._requests.serve_in(tg.create_task)
                await heartbeat.once()
                await self._book.recover()
                self._ops.seed_epochs(self._book.jobs.values())
                r, node = self._requests, self.node
                for subject, cb in (
                    (subjects.agent_rpc_jobs(node, "register"), r.on_register),
                    (subjects.agent_rpc_jobs(node, "unregister"), r.on_unregister),
                    (subjects.agent_rpc(node, "clear_fault"), r.on_clear_fault),
                    (subjects.agent_rpc(node, "status"), r.on_status),
                ):
                    self._subs.append(await nc.subscribe(subject, cb=cb))
                await self._subscribe_commands()
                tg.create_task(heartbeat.loop(self.config.heartbeat_s, self._stop))
                tg.create_task(self._pid_loop())
                if self._pods is not None:
                    tg.create_task(self._pods.run(self._stop))
                log.info("agent ready", extra={"node": self.node})
                self._ready.set()
                await self._stop.wait()
                for s in self._subs:
                    with contextlib.suppress(Exception):
                        await s.unsubscribe()
                self._subs.clear()
                raise _Stopped
        except* _Stopped:
            pass
        finally:
            self._tg = None
            self._requests.serve_in(None)
            if self._peer is not None:
                await self._peer.stop()
                self._peer = None
            if self._own_nc and nc.is_connected:
                with contextlib.suppress(Exception):
                    await nc.drain()

    @property
    def socket_path(self) -> str | None:
        """Where this agent serves its socket (None: it serves none, ``socket="off"``)."""
        configured = self.config.socket
        if configured == "off":
            return None
        return configured.replace("{node}", self.node) if configured else default_socket_path(self.node)

    async def _serve_socket(self) -> None:
        path = self.socket_path
        if path is not None:
            self._peer = PeerServer(path, self._guard, self.metrics, node=self.node)
            await self._peer.start()
        self._requests.set_proofs(self._peer.take if self._peer is not None else None, path)

    async def _subscribe_commands(self) -> None:
        js, nc = self._js, self._nc
        assert js is not None and nc is not None
        durable = f"agent-{self.node}"
        floor, exists = 0, False
        try:
            info = await js.consumer_info(STREAM, durable)
            exists = True
            floor = info.ack_floor.stream_seq if info.ack_floor and info.ack_floor.stream_seq else 0
            await js.delete_consumer(STREAM, durable)
        except NotFoundError:
            pass
        deliver = nc.new_inbox()
        self._subs.append(await nc.subscribe(deliver, cb=self._on_command))
        await asyncio.sleep(0)  # else flush() after subscribe() is no barrier (docs/nats.md)
        await nc.flush()
        if floor:
            policy, start = DeliverPolicy.BY_START_SEQUENCE, floor + 1
        else:
            policy, start = (DeliverPolicy.ALL if exists else DeliverPolicy.NEW), None
        await js.add_consumer(
            STREAM,
            ConsumerConfig(
                durable_name=durable,
                description=f"commands for agent {self.node}",
                deliver_subject=deliver,
                deliver_policy=policy,
                opt_start_seq=start,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=30,
                max_ack_pending=1024,
                filter_subject=subjects.agent_cmd(self.node),
            ),
        )

    # ------------------------------------------------------------------ operations

    def take(self, cmd: Snapshot | Restore, published: asyncio.Event) -> bool:
        """Run a command that the orchestrator this agent runs beside hands over directly, as it publishes it
        on this agent's connection. The operation writes nothing before ``published`` is set (the command is
        buffered by then), so the stream stores the command before anything this agent writes about it. The
        stream's copy, delivered later, is then only acknowledged. False when not taken (not this node's, or
        this agent is not ready or stopping: its durable consumer then delivers the command)."""
        if cmd.node != self.node or self._tg is None or not self._ready.is_set() or self._stop.is_set():
            return False
        try:
            check_command(cmd, self.node, now_ms())
        except Refused:
            return False  # its stream copy comes to this agent's consumer, which refuses it (and answers)
        self._taken[cmd.op_id] = None
        while len(self._taken) > self.config.max_results:
            self._taken.popitem(last=False)
        self.metrics.commands.labels("direct").inc()
        self._start(cmd, gate=published)
        return True

    def _start(self, cmd: Snapshot | Restore, *, gate: asyncio.Event | None = None) -> None:
        assert self._tg is not None
        # Registered before the next command is read: a restore that follows this operation (Restore.after)
        # finds it running, since commands arrive in the order the orchestrator sent them.
        owner = self._ops.running.start(cmd.op_id)
        self._tg.create_task(self._ops.run(cmd, owner, gate=gate))

    async def _on_command(self, msg: Msg) -> None:
        """A command from the durable consumer. Always acknowledged: a malformed one (poison) is refused, with an
        ``OpResult(ok=False)`` where its ids can be put in a subject, and is never delivered again."""
        try:
            if msg.subject != subjects.agent_cmd(self.node):
                # Someone's consumer pushed a stream message at this agent's deliver subject: it keeps its own subject
                # (a job's stored payload, say), and only the orchestrator publishes on the command subject.
                log_refusal(
                    self.metrics,
                    self.node,
                    "command",
                    Refusal.WRONG_SUBJECT,
                    f"refused a message delivered from {shown(msg.subject)}, not from the command subject",
                )
            else:
                await self._take_delivered(msg.data)
        except Exception:  # not expected: a command must never end the agent, nor stay unacknowledged
            self.metrics.task_error("command")
            log.exception("command handling failed", extra={"node": self.node})
        # Acknowledged after the operation's task is scheduled: that task then runs before the connection's
        # flusher, so its first writes (the TRANSITIONING mark, OpStarted, the request to the workload) leave in
        # the same socket write as this acknowledgement instead of one write later.
        with contextlib.suppress(Exception):
            await msg.ack()

    async def _take_delivered(self, data: bytes) -> None:
        try:
            cmd: Snapshot | Restore = _command_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            why = shown(str(exc), 300)
            log_refusal(self.metrics, self.node, "command", Refusal.UNDECODABLE, f"undecodable command: {why}")
            return
        if cmd.op_id in self._taken:
            del self._taken[cmd.op_id]  # handed over by take() already: only the acknowledgement is left
            return
        try:
            check_command(cmd, self.node, now_ms())
        except Refused as exc:
            await self._refuse(cmd, exc)
            return
        if self._tg is not None:
            self.metrics.commands.labels("stream").inc()
            self._start(cmd)

    async def _refuse(self, cmd: Snapshot | Restore, exc: Refused) -> None:
        """Log and count a refused command, and answer it when its group, job and op id are valid. The answer's
        message id differs from a result's: a refusal never stands in for the outcome of a real command."""
        result = refusal_result(cmd, self.node, exc)
        ids = {"group": cmd.group, "job": cmd.job, "op_id": cmd.op_id} if result is not None else {}
        log_refusal(self.metrics, self.node, "command", exc.code, f"refused a command: {exc}", **ids)
        if result is None:
            return
        assert self._js is not None
        try:
            await self._js.publish(
                subjects.agent_event(self.node, cmd.group),
                encode(result),
                timeout=5,
                headers={"Nats-Msg-Id": f"{cmd.op_id}:refused"},
            )
        except Exception as err:
            log.warning("refusal not published: %r", err, extra={"node": self.node, **ids})

    # ------------------------------------------------------------------ standalone operations

    async def run_standalone(
        self,
        job: str,
        kind: OpKind,
        *,
        group: str | None = None,
        backends: tuple[str, ...] | None = None,
        pids: tuple[int, ...] = (),
        mode: SuspendMode | None = None,
        tags: tuple[str, ...] | None = None,
        endpoints: tuple[str, ...] = (),
        timeout_s: float | None = None,
    ) -> str:
        """Start a snapshot or restore that no orchestrator asked for (the gRPC ``SnapshotAgentService``:
        services that schedule themselves). Returns the operation id at once; follow it with
        :meth:`operation`. It runs exactly as an orchestrator's command would (same state machine,
        lock, rollback, events), at the group's current epoch so it neither trips nor moves the fence.

        A registered job runs with its registered backends unless ``backends`` (and ``pids``, ``endpoints``) say
        otherwise; those then become its configuration (its restore must find the state where its snapshot put it).
        ``mode`` and ``tags`` are this operation's alone: never stored as the job's. A job this agent
        does not know is taken on for a snapshot when ``backends`` with ``pids`` or ``endpoints`` name it, with backends
        that touch no process only: a process-level backend (``cuda``, ``freeze``) acts only on processes a
        registration proved through the agent's socket (``Refused``, code ``unproven`` or ``not_owned``).
        Raises ``OperationInProgress`` (an operation on the job runs), ``LookupError`` (unknown job, nothing to
        restore), ``ValueError`` (bad ids, another group), ``BackendUnavailable`` (a backend this agent lacks),
        ``RuntimeError`` (not running).
        """
        check_id("job", job)
        if group:
            check_id("group", group)
        if self._tg is None or self._nc is None:
            raise RuntimeError(f"the agent on node {self.node!r} is not running")
        for b in backends or ():
            make_backend(b, self._nc, self.node)  # raises BackendUnavailable
        check_idle(job, self._locks.users(job), self._ops.standalone)  # OperationInProgress: answered at once
        async with self._locks.hold(job):
            current = self._book.jobs.get(job)
            ctx = standalone_context(
                current, self.node, job, kind, group=group, backends=backends, pids=pids, endpoints=endpoints
            )
            if ctx is not current:
                check_registration(ctx)  # Refused: a ValueError
                if acts_on_processes(ctx.backends):  # only processes the registration proved (Refused)
                    ctx = await asyncio.to_thread(self._guard.standalone, current, ctx)
                ctx = await self._book.save(ctx)
        op_id = f"standalone-{uuid.uuid4().hex}"
        budget_ms = int(timeout_s * 1000) if timeout_s else ctx.op_timeout_ms
        cls = Snapshot if kind is OpKind.SNAPSHOT else Restore
        cmd = cls(
            op_id=op_id,
            group=ctx.group,
            job=job,
            node=self.node,
            epoch=self._ops.epoch(ctx.group),
            deadline_ms=now_ms() + budget_ms,
        )
        run = self._ops.begin_standalone(cmd, kind, OpSettings(mode=mode, tags=tags))
        nothing_to_move = (kind is OpKind.SNAPSHOT and ctx.state is JobState.SAVED) or (
            kind is OpKind.RESTORE and ctx.state in (JobState.RUNNING, JobState.IDLE)
        )
        if nothing_to_move:
            await run  # answered at once: complete before the caller asks
        else:
            self._tg.create_task(run)
        return op_id

    def operation(self, op_id: str) -> OperationStatus | None:
        """An operation's state: running (``done`` False), finished (with its result), or None when this
        agent does not know the id (never seen, or long forgotten)."""
        return self._ops.status(op_id)

    async def devices(self) -> tuple[DeviceInfo, ...]:
        """This node's accelerators as its last heartbeat reported them."""
        return await self._heartbeat.devices() if self._heartbeat is not None else ()

    # ------------------------------------------------------------------ liveness

    async def _pid_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.pid_check_s):
                    await self._stop.wait()
            if self._stop.is_set():
                return
            for ctx in list(self._book.jobs.values()):
                try:
                    living, dropped = without_dead(ctx, alive)
                    if dropped:
                        async with self._locks.hold(ctx.job):
                            if self._book.jobs.get(ctx.job) is ctx:
                                if living is None:
                                    await self._book.unregister(ctx, "its processes are gone")
                                else:  # the job goes on in its other processes
                                    await self._book.save(living)
                except Exception as exc:  # one job's check never ends the loop (nor the agent)
                    self.metrics.task_error("pid_check")
                    log.warning(
                        "checking the job's processes failed: %r",
                        exc,
                        extra={"node": self.node, "group": ctx.group, "job": ctx.job},
                    )


class _Stopped(Exception):
    pass
