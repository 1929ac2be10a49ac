"""The agent's request/reply subjects, outside the stream: ``ts.rpc.agent.<node>.register.<job>`` and
``.unregister.<job>`` (the subject's job is the one acted for: permissions let only that job publish there, and a
payload naming another job is refused, ``wrong_job``), ``.clear_fault`` (admin) and ``.status`` (reader). Each
subject takes its own message type only. Every request is answered when it has a reply subject, and none ends the
agent: a malformed one is refused (``bad request: …``, with the refusal's ``code``), logged and counted in
``timeslice_agent_refused``.

An unregistration waits for an operation running on its job (a snapshot still moving the job's state off the
device): answered at once, ``JobUnregistered`` would make the orchestrator end that operation as "job gone" and grant
the next job while the copy ran. It waits in a task of the agent's own (one subscription's callbacks run in order,
so the other jobs' unregistrations are not held up), at most ``unregister_wait_s``; past that it is answered
``busy`` and the job stays registered. A job has at most one such wait, the node ``MAX_WAITING_UNREGISTERS``; a
registration of a job whose unregistration waits is answered ``busy`` too (it would be undone, or undo the other).

A registration proves its processes with the token of the agent's socket (``RegisterJob.proof``, see ``_peer``):
its pids and group must then be the proving process's own (``_ownership``). Without a proof only backends that touch
no process are accepted (``backends.acts_on_processes``); their pids only tell when the job is gone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from timeslice_client.protocol import (
    AgentReply,
    ClearFault,
    ClearJobFault,
    JobState,
    ProcessOwner,
    RegisterJob,
    UnregisterJob,
    encode,
    subjects,
)

from ._job_book import JobBook
from ._job_locks import JobLocks
from ._job_parts import part_count, views, without_channel
from ._ownership import Peer, ProcessGuard
from ._pods import is_pod_channel
from ._untrusted import Refusal, Refused, cap, check_id, check_processes, shown
from .backends import BackendUnavailable, acts_on_processes, node_default_backend
from .metrics import AgentMetrics

__all__ = ["BUSY", "MAX_WAITING_UNREGISTERS", "Requests", "log_refusal"]

log = logging.getLogger("timeslice.agent")

_register_decoder = msgspec.json.Decoder(RegisterJob)
_unregister_decoder = msgspec.json.Decoder(UnregisterJob)
_clear_decoder = msgspec.json.Decoder(ClearJobFault)

Proofs = Callable[[str, str], Peer]  # (token, job) -> the process that asked for it; Refused when it is no proof
Spawn = Callable[[Coroutine[Any, Any, None]], object]  # the agent's TaskGroup.create_task

BUSY: Final = "busy"  # AgentReply.code: an operation on the job still runs; ask again later
MAX_WAITING_UNREGISTERS: Final = 256  # unregistrations waiting for their job's operation, per node


def log_refusal(metrics: AgentMetrics, node: str, source: str, code: Refusal, message: str, **extra: str) -> None:
    """Log and count one refused message (``extra``: its ids, where they are valid)."""
    metrics.refusal(source, code)
    log.warning(message, extra={"node": node, "refusal": str(code), **extra})


class Requests:
    """Answers one node's requests from its job book; usable once ``bind`` gave it the agent's stream context.
    ``proofs``: the agent socket's tokens (None: it serves none, at ``socket_path``)."""

    def __init__(
        self,
        node: str,
        book: JobBook,
        locks: JobLocks,
        metrics: AgentMetrics,
        *,
        guard: ProcessGuard,
        proofs: Proofs | None = None,
        socket_path: str | None = None,
        default_backend: str = "auto",
        unregister_wait_s: float = 600.0,
    ) -> None:
        self.node, self._book, self._locks, self._metrics = node, book, locks, metrics
        self._unregister_wait_s = unregister_wait_s  # AgentConfig.unregister_wait_s
        self._spawn: Spawn | None = None  # while serving: where an unregistration waits for its job's operation
        self._leaving: set[str] = set()  # jobs whose unregistration waits so
        self._ending = 0  # unregistrations running for registrations whose carrier is gone (``unregister_soon``)
        self._default_backend = default_backend  # AgentConfig.default_backend: what a bound process gets
        self._guard, self._proofs, self._socket_path = guard, proofs, socket_path
        self._js: JetStreamContext | None = None

    def bind(self, js: JetStreamContext) -> None:
        self._js = js

    @property
    def leaving(self) -> frozenset[str]:
        """The jobs whose unregistration waits for their operation now."""
        return frozenset(self._leaving)

    def serve_in(self, spawn: Spawn | None) -> None:
        """Where unregistrations wait for their job's operation (the agent's TaskGroup; None: stopped)."""
        self._spawn = spawn

    def set_proofs(self, proofs: Proofs | None, socket_path: str | None) -> None:
        self._proofs, self._socket_path = proofs, socket_path

    async def on_register(self, msg: Msg) -> None:
        await self._answered(msg, lambda: self._register(self._job_of(msg.subject, "register"), msg.data))

    async def on_unregister(self, msg: Msg) -> None:
        def unregister() -> Awaitable[AgentReply]:
            return self._unregister(self._job_of(msg.subject, "unregister"), msg.data)

        try:
            job = self._job_of(msg.subject, "unregister")
        except Refused:
            job = None  # refused below, by the same call
        if job is None or self._spawn is None or not self._locks.users(job):
            await self._answered(msg, unregister)
        elif job in self._leaving or len(self._leaving) >= MAX_WAITING_UNREGISTERS:
            await self._answered(
                msg,
                lambda: self._busy(
                    job,
                    "its unregistration already waits for it"
                    if job in self._leaving
                    else f"too many unregistrations wait on this node ({MAX_WAITING_UNREGISTERS})",
                ),
            )
        else:
            self._leaving.add(job)
            self._spawn(self._unregister_after(msg, job, unregister))

    async def _unregister_after(self, msg: Msg, job: str, unregister: Callable[[], Awaitable[AgentReply]]) -> None:
        try:
            await self._answered(msg, unregister)
        finally:
            self._leaving.discard(job)

    async def _busy(self, job: str, why: str) -> AgentReply:
        return AgentReply(
            ok=False,
            code=BUSY,
            error=f"an operation on job {job!r} still runs on node {self.node!r} ({why}): ask again once it ended",
        )

    async def on_clear_fault(self, msg: Msg) -> None:
        def clear() -> Awaitable[AgentReply]:
            # A stream message pushed here by someone's consumer keeps its own subject: only a request is obeyed.
            if msg.subject != subjects.agent_rpc(self.node, "clear_fault"):
                raise Refused(Refusal.WRONG_SUBJECT, f"a fault clear on {shown(msg.subject)}")
            return self._clear_fault(check_id("job", _clear_decoder.decode(msg.data).job))

        await self._answered(msg, clear)

    def _job_of(self, subject: str, verb: str) -> str:
        prefix = subjects.agent_rpc_jobs(self.node, verb)[:-1]
        if not subject.startswith(prefix):  # never: the subscription's filter
            raise Refused(Refusal.INVALID_ID, f"a {verb} request on {shown(subject)}")
        return check_id("job", subject[len(prefix) :])

    async def _answered(self, msg: Msg, answer: Callable[[], Awaitable[AgentReply]]) -> None:
        try:
            reply = await answer()
        except Refused as exc:
            log_refusal(self._metrics, self.node, "rpc", exc.code, f"refused a request: {exc}")
            reply = AgentReply(ok=False, error=f"bad request: {exc}", code=str(exc.code))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            why = shown(str(exc), 300)
            log_refusal(self._metrics, self.node, "rpc", Refusal.UNDECODABLE, f"undecodable request: {why}")
            reply = AgentReply(ok=False, error=f"bad request: {why}", code=str(Refusal.UNDECODABLE))
        except (ValueError, BackendUnavailable) as exc:  # e.g. an endpoint written wrong, a backend not here: the
            reply = AgentReply(ok=False, error=f"bad request: {exc}")  # message says what to write or install
        except Exception as exc:
            self._metrics.task_error("rpc")
            log.exception("request failed", extra={"node": self.node})
            reply = AgentReply(ok=False, error=f"{exc.__class__.__name__}: {exc}")
        if msg.reply:
            if reply.error:
                reply = msgspec.structs.replace(reply, error=cap(reply.error))
            try:
                await msg.respond(encode(reply))
            except Exception as exc:  # the connection is closing: nobody is left to answer
                log.warning("request not answered: %r", exc, extra={"node": self.node})

    async def on_status(self, msg: Msg) -> None:
        if msg.reply:  # the payload is not read
            try:
                await msg.respond(msgspec.json.encode(sorted(self._book.jobs.values(), key=lambda c: c.job)))
            except Exception as exc:
                log.warning("status not answered: %r", exc, extra={"node": self.node})

    async def _register(self, job: str, data: bytes) -> AgentReply:
        req = _register_decoder.decode(data)
        if req.job != job:
            raise Refused(
                Refusal.WRONG_JOB,
                f"a registration on the subject of job {job!r} names job {shown(req.job)}; a job registers itself only",
            )
        return await self.register(req)

    async def register(self, req: RegisterJob) -> AgentReply:
        """A registration of job ``req.job``, whoever carried it (the bus, or the gRPC ``WorkloadChannel`` for which
        the caller was authorized as that job). Raises ``Refused``, ``BackendUnavailable``, ``ValueError``."""
        job = req.job
        if job in self._leaving:  # requests are obeyed in their order: this one comes after the job asked to leave
            return await self._busy(job, "its unregistration waits for it")
        if req.bind:
            backend = node_default_backend(self._default_backend)
            if backend is None:
                return AgentReply(ok=True, backends=())  # the lock alone: nothing to move for it here
            req = msgspec.structs.replace(req, backends=(backend,))
        self._book.check_backends(req.backends)  # a backend this node lacks is said first
        acting = acts_on_processes(req.backends)
        owner: ProcessOwner | None = None
        pids, pgid = req.pids, req.pgid
        if req.proof is not None:
            if self._proofs is None:
                raise Refused(Refusal.UNPROVEN, "this agent serves no socket (--socket off), so a proof is none")
            peer = self._proofs(req.proof, job)
            current = self._book.jobs.get(job)
            mine = (
                next(
                    (
                        v
                        for v in views(current)
                        if v.pids == (peer.pid,) or (req.bind and is_pod_channel(v.channel) and peer.pid in v.pids)
                    ),
                    None,
                )
                if current is not None
                else None
            )
            if req.bind and current is not None and current.group == req.group and mine is not None:
                # The process's own registration (a handler, or a bind before: its pid as this agent sees it; or its
                # pod's, which the agent found through the pod's labels, ``_pod_discovery``) stays.
                return AgentReply(ok=True, state=current.state, backends=mine.backends, kept=True)
            if peer.own_pid == peer.pid:  # the agent's pid namespace: what no job may name is said first
                check_processes(req.pids, req.pgid, req.backends)
            try:
                pids, pgid, owner = await asyncio.to_thread(self._guard.prove, peer, req.pids, req.pgid)  # reads /proc
            except Refused as exc:
                if acting:
                    raise
                # Backends that touch no process: registered unproven (their pids only tell when the job is gone;
                # none when they are of another pid namespace, which the agent could not translate).
                log.info("registered unproven: %s", exc, extra={"node": self.node, "job": job})
                if peer.own_pid != peer.pid:
                    pids, pgid = (), None
        elif acting:
            check_processes(req.pids, req.pgid, req.backends)  # what no job may name is said first
            where = self._socket_path or "(none: the agent runs with --socket off)"
            raise Refused(
                Refusal.UNPROVEN,
                f"backend {'+'.join(acting)} acts on the job's processes, which the job "
                f"did not prove: register from the job's process through the agent's "
                f"socket {where} (register_workload does when it finds it; "
                "$TIMESLICE_AGENT_SOCKET names it)",
            )
        reply = await self._book.register(msgspec.structs.replace(req, pids=pids, pgid=pgid, proof=None), owner)
        return msgspec.structs.replace(reply, backends=req.backends) if req.bind else reply

    def unregister_soon(self, req: UnregisterJob) -> bool:
        """Run ``unregister(req)`` in the agent's TaskGroup, where the end of whoever asked cannot cut it short, its
        outcome logged; False when not serving, or when ``MAX_WAITING_UNREGISTERS`` such ends are running."""
        if self._spawn is None or self._ending >= MAX_WAITING_UNREGISTERS:
            return False
        self._ending += 1
        self._spawn(self._unregister_logged(req))
        return True

    async def _unregister_logged(self, req: UnregisterJob) -> None:
        ids = {"node": self.node, "job": req.job, "group": req.group}
        try:
            reply = await self.unregister(req)
        except Exception as exc:  # the agent is stopping, say: its next start drops what is left
            log.warning("a registration did not end: %r", exc, extra=ids)
            return
        finally:
            self._ending -= 1
        if not reply.ok:
            log.warning("a registration did not end: %s", reply.error, extra=ids)

    async def _unregister(self, job: str, data: bytes) -> AgentReply:
        req = _unregister_decoder.decode(data)
        if req.job != job:
            raise Refused(
                Refusal.WRONG_JOB,
                f"an unregistration on the subject of job {job!r} names job "
                f"{shown(req.job)}; a job unregisters itself only",
            )
        return await self.unregister(req)

    async def unregister(self, req: UnregisterJob) -> AgentReply:
        """An unregistration of job ``req.job`` (of its part ``req.channel`` only, when given), whoever carried it;
        waits for an operation running on the job, at most ``unregister_wait_s`` (then answered ``busy``)."""
        job = check_id("job", req.job)
        group = check_id("group", req.group)
        ctx = self._book.jobs.get(job)
        if ctx is not None and ctx.group != group:
            return AgentReply(
                ok=False,
                error=f"job {job!r} is registered in group {ctx.group!r} on node "
                f"{self.node!r}, not {group!r}: unregister it from its own group",
            )
        if ctx is None:
            return AgentReply(ok=True)
        try:
            async with asyncio.timeout(self._unregister_wait_s) as waited, self._locks.hold(job):
                waited.reschedule(None)  # the bound is on the wait; the unregistration's writes have their own
                ctx = self._book.jobs.get(job)  # what the operation left (it may have ended the registration)
                if ctx is not None and ctx.group == group:
                    rest = without_channel(ctx, req.channel) if req.channel is not None else None
                    if rest is None:
                        await self._book.unregister(ctx, "unregistered by the job")
                    elif rest is not ctx:  # one of its processes leaves; the job goes on in the others
                        await self._book.save(rest)
                        log.info(
                            "a registration of the job left (channel %s); %d stay",
                            req.channel,
                            part_count(rest),
                            extra={"node": self.node, "job": job, "group": group},
                        )
        except TimeoutError:
            return await self._busy(job, f"waited {self._unregister_wait_s:g} s for it")
        return AgentReply(ok=True)

    async def _clear_fault(self, job: str) -> AgentReply:
        ctx = self._book.jobs.get(job)
        if ctx is None:
            return AgentReply(ok=False, error=f"job {job!r} is not registered on node {self.node!r}")
        async with self._locks.hold(job):
            if ctx.state is JobState.FAULTED:
                # Its state is unknown: treat it as saved, so the next grant resumes it (resume is idempotent).
                ctx = await self._book.save(msgspec.structs.replace(ctx, state=JobState.SAVED, reason=None))
        assert self._js is not None
        await self._js.publish(subjects.ctl(ctx.group, "clear_fault"), encode(ClearFault(group=ctx.group, job=job)))
        return AgentReply(ok=True, state=ctx.state)
