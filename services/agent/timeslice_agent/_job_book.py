"""This node's job contexts: the agent's table of them, stored in KV ``jobs`` (key ``<node>.<job>``), and the
events that tell the orchestrator a job came (``JobRegistered``) or went (``JobUnregistered``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from timeslice_client.bus import kv_keys
from timeslice_client.protocol import (
    JOBS_BUCKET,
    AgentReply,
    JobContext,
    JobRegistered,
    JobState,
    JobUnregistered,
    ProcessOwner,
    RegisterJob,
    Restore,
    encode,
    subjects,
)

from . import _stored as stored
from ._app_endpoint import check_endpoints
from ._host import alive
from ._job_parts import all_backends, put_part, registered, same_part, views, without_channel, without_dead
from ._untrusted import MAX_JOBS, Refusal, Refused, check_processes, check_registration, shown
from ._workload_stream import is_stream_channel
from .backends import make_backend

__all__ = ["JobBook", "now_ms"]

log = logging.getLogger("timeslice.agent")

_ctx_decoder = msgspec.json.Decoder(JobContext)


def now_ms() -> int:
    return int(time.time() * 1000)


class JobBook:
    """The job contexts of one node (``jobs``, by job id); usable once ``bind`` gave it the agent's connection."""

    def __init__(
        self,
        node: str,
        *,
        fence: Callable[[str], Awaitable[int]],
        refused: Callable[[Refusal], None] = lambda code: None,
    ) -> None:
        self.node = node
        self._fence = fence  # the epoch a job registering afresh in a group starts at (Operations.fence_for_new_job)
        self._refused = refused  # counts a context read back from KV that is not used (see ``recover``)
        self.jobs: dict[str, JobContext] = {}
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None

    def bind(self, nc: NATS, js: JetStreamContext, kv: KeyValue) -> None:
        self._nc, self._js, self._kv = nc, js, kv

    async def save(self, ctx: JobContext, *, wait: bool = True) -> JobContext:
        """Store a job's state. ``wait=False`` publishes the write without waiting for JetStream's answer
        (it is stored in order with this connection's later writes): for the TRANSITIONING mark on the
        switch's critical path."""
        assert self._kv is not None and self._nc is not None
        ctx = msgspec.structs.replace(ctx, updated_ms=now_ms())
        self.jobs[ctx.job] = ctx
        key = f"{self.node}.{ctx.job}"
        if wait:
            await stored.kv_put(self._kv, key, encode(ctx))  # through an election
        else:
            await self._nc.publish(f"$KV.{JOBS_BUCKET}.{key}", encode(ctx))
        return ctx

    async def register(self, req: RegisterJob, owner: ProcessOwner | None = None) -> AgentReply:
        """A job registers (again): the same process keeps its state, another one starts IDLE. ``owner``: the
        process that proved the registration (``_ownership``), None when unproven."""
        check_registration(req, processes=False)  # Refused: bad ids, sizes out of bounds
        assert self._nc is not None
        if req.job not in self.jobs and len(self.jobs) >= MAX_JOBS:
            raise Refused(
                Refusal.TOO_LARGE,
                f"node {self.node!r} has {len(self.jobs)} jobs registered (at most "
                f"{MAX_JOBS}); unregister jobs that are gone",
            )
        self.check_backends(req.backends)
        check_processes(req.pids, req.pgid, req.backends)  # Refused: a process the agent must not act on
        if "app_endpoint" in req.backends:
            check_endpoints(req.endpoints)  # ValueError: which endpoint is wrong and how to write it
        old = self.jobs.get(req.job)
        if old is not None and old.group != req.group:
            return AgentReply(ok=False, error=f"job {req.job!r} is registered in group {old.group!r} on this node")
        new = registered(self.node, req, owner)
        if old is not None and not any(same_part(v, new) for v in views(old)):
            living, dropped = without_dead(old, alive)
            if living is None:
                # Other processes take the job's place on this node, and the registered ones are gone (a job killed
                # and started again before the agent's check saw it): their context went with them. Said first, so
                # the orchestrator ends what it had pending for them as "job gone" rather than charge the newcomer.
                await self.unregister(old, "its processes are gone; other processes registered as the job")
                old = None
            elif dropped:
                log.info(
                    "dropped %d registrations of the job whose processes are gone",
                    dropped,
                    extra={"node": self.node, "job": req.job, "group": req.group},
                )
                old = living
        ctx, _ = put_part(old, new)  # Refused: too many parts, or a process another part's backend acts on
        if old is None:  # afresh: the commands of the job's earlier lives here are stale, after a restart too
            ctx = msgspec.structs.replace(ctx, epoch=await self._fence(req.group))
        ctx = await self.save(ctx)
        await self.announce(ctx)
        log.info(
            "registered job (%s)",
            f"proven by pid {owner.pid}, uid {owner.uid}" if owner else "unproven",
            extra={"node": self.node, "job": req.job, "group": req.group},
        )
        return AgentReply(ok=True, state=ctx.state)

    def check_backends(self, backends: tuple[str, ...]) -> None:
        """Raises BackendUnavailable for a backend this node does not have (unknown, or unusable here)."""
        assert self._nc is not None
        for b in backends:
            make_backend(b, self._nc, self.node)

    async def announce(self, ctx: JobContext) -> None:
        assert self._js is not None
        ev = JobRegistered(
            group=ctx.group,
            job=ctx.job,
            node=self.node,
            backend="+".join(all_backends(ctx)),
            op_timeout_ms=max(v.op_timeout_ms for v in views(ctx)),
        )
        await stored.publish(self._js, subjects.agent_event(self.node, ctx.group), encode(ev))  # through an election

    async def unregister(self, ctx: JobContext, why: str) -> None:
        assert self._js is not None and self._kv is not None
        self.jobs.pop(ctx.job, None)
        with contextlib.suppress(Exception):
            await self._kv.delete(f"{self.node}.{ctx.job}")
        # Through an election: the orchestrator ends the job's pending operations on this node only when it hears.
        await stored.publish(
            self._js,
            subjects.agent_event(self.node, ctx.group),
            encode(JobUnregistered(group=ctx.group, job=ctx.job, node=self.node)),
        )
        log.info("unregistered job: %s", why, extra={"node": self.node, "job": ctx.job, "group": ctx.group})

    def in_doubt(self, cmd: Restore) -> list[str]:
        """The snapshots ``cmd`` follows that a restart of this agent left in doubt: another job of its group is
        TRANSITIONING in one of them (its ``last_op_id``, set when an operation begins: its own process may still be
        moving its state off the device) until the orchestrator sends that snapshot again and it ends."""
        return [
            j.last_op_id
            for j in self.jobs.values()
            if j.group == cmd.group
            and j.job != cmd.job
            and j.state is JobState.TRANSITIONING
            and j.last_op_id is not None
            and j.last_op_id in cmd.after
        ]

    def registration(self, ctx: JobContext) -> JobContext | None:
        """The job's registration now, when it is still the one ``ctx`` was taken from: the same group and at least
        one part in common (parts may have registered again, come or gone meanwhile, as ``register`` keeps the
        job's state). None when the job unregistered, or registered again in another group or as other processes
        only: an operation that ends then must not write its outcome over that."""
        current = self.jobs.get(ctx.job)
        if current is None or current.group != ctx.group:
            return None
        if not any(same_part(a, b) for a in views(ctx) for b in views(current)):
            return None
        return current

    async def recover(self) -> None:
        """Read this node's job states back. A job whose operation a restart cut short stays TRANSITIONING: its
        state is unknown (its own process may still be suspending it), and the orchestrator sends the operation
        again when this agent announces the job; running it again asks the job's backends once more (a workload
        answers a repeated op id with the outcome of the call it is running or ran), which tells."""
        kv, nc = self._kv, self._nc
        assert kv is not None and nc is not None
        for key in await kv_keys(nc, JOBS_BUCKET, under=self.node):  # not kv.keys(): it can miss keys
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:  # unregistered (deleted) since
                continue
            if entry.value and (ctx := self._readable(key, entry.value)) is not None:
                self.jobs[ctx.job] = ctx
        for found in list(self.jobs.values()):
            living, dropped = without_dead(found, alive)
            for v in views(found):  # no WorkloadChannel stream outlives the agent that served it, nor its registration
                if is_stream_channel(v.channel) and living is not None and v.channel is not None:
                    living, dropped = without_channel(living, v.channel), dropped + 1
            if living is None:
                await self.unregister(found, "its processes are gone")
                continue
            ctx = await self.save(living) if dropped else found
            if ctx.state is JobState.TRANSITIONING:
                await self.save(
                    msgspec.structs.replace(
                        ctx,
                        reason="the agent restarted during an operation; it runs again when the orchestrator "
                        "sends it again",
                    )
                )
            await self.announce(ctx)
        if self.jobs:
            log.info("recovered %d jobs", len(self.jobs), extra={"node": self.node})

    def _readable(self, key: str, value: bytes) -> JobContext | None:
        """A job context read back from KV, when it is one this agent can use: decodable, this node's, under its
        own key, with valid ids and processes (the checks of a registration). Else logged, counted and skipped,
        never a reason not to start."""
        try:
            ctx = _ctx_decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            problem: Refused = Refused(Refusal.UNDECODABLE, f"undecodable: {shown(str(exc), 300)}")
        else:
            try:
                if ctx.node != self.node or key != f"{self.node}.{ctx.job}":
                    raise Refused(Refusal.WRONG_NODE, f"it names node {shown(ctx.node)} and job {shown(ctx.job)}")
                for v in views(ctx):
                    check_registration(v)
                return ctx
            except Refused as exc:
                problem = exc
        self._refused(problem.code)
        log.warning(
            "job context %s in KV %s not recovered: %s; delete the key or register the job again",
            key,
            JOBS_BUCKET,
            problem,
            extra={"node": self.node, "refusal": str(problem.code)},
        )
        return None
