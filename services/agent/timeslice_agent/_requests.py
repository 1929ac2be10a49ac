"""The agent's request/reply subjects (``ts.rpc.agent.<node>.register|unregister|clear_fault|status``, outside
the stream). Every request is answered when it has a reply subject, and none ends the agent: a malformed one is
refused (``bad request: …``), logged and counted in ``timeslice_agent_refused``."""

from __future__ import annotations

import logging

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from timeslice_client.protocol import (
    AgentReply,
    ClearFault,
    ClearJobFault,
    JobState,
    RegisterJob,
    UnregisterJob,
    encode,
    subjects,
)

from ._job_locks import JobLocks
from ._jobbook import JobBook
from ._untrusted import Refusal, Refused, cap, check_id, shown
from .backends import BackendUnavailable
from .metrics import AgentMetrics

__all__ = ["Requests", "log_refusal"]

log = logging.getLogger("timeslice.agent")

_rpc_decoder = msgspec.json.Decoder(RegisterJob | UnregisterJob | ClearJobFault)


def log_refusal(metrics: AgentMetrics, node: str, source: str, code: Refusal, message: str, **extra: str) -> None:
    """Log and count one refused message (``extra``: its ids, where they are valid)."""
    metrics.refusal(source, code)
    log.warning(message, extra={"node": node, "refusal": str(code), **extra})


class Requests:
    """Answers one node's requests from its job book; usable once ``bind`` gave it the agent's stream context."""

    def __init__(self, node: str, book: JobBook, locks: JobLocks, metrics: AgentMetrics) -> None:
        self.node, self._book, self._locks, self._metrics = node, book, locks, metrics
        self._js: JetStreamContext | None = None

    def bind(self, js: JetStreamContext) -> None:
        self._js = js

    async def on_rpc(self, msg: Msg) -> None:
        """register / unregister / clear_fault."""
        try:
            reply = await self._answer(msg.data)
        except Refused as exc:
            log_refusal(self._metrics, self.node, "rpc", exc.code, f"refused a request: {exc}")
            reply = AgentReply(ok=False, error=f"bad request: {exc}")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            why = shown(str(exc), 300)
            log_refusal(self._metrics, self.node, "rpc", Refusal.UNDECODABLE, f"undecodable request: {why}")
            reply = AgentReply(ok=False, error=f"bad request: {why}")
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

    async def _answer(self, data: bytes) -> AgentReply:
        req = _rpc_decoder.decode(data)
        if isinstance(req, RegisterJob):
            return await self._book.register(req)  # checked there (Refused)
        if isinstance(req, UnregisterJob):
            group, job = check_id("group", req.group), check_id("job", req.job)
            ctx = self._book.jobs.get(job)
            if ctx is not None and ctx.group != group:
                return AgentReply(ok=False, error=f"job {job!r} is registered in group {ctx.group!r} on node "
                                                  f"{self.node!r}, not {group!r}: unregister it from its own group")
            if ctx is not None:
                await self._book.unregister(ctx, "unregistered by the job")
            return AgentReply(ok=True)
        return await self._clear_fault(check_id("job", req.job))

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
