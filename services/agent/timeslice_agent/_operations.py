"""How the agent runs one snapshot or restore, once its command is taken (``Agent``, in ``service``, takes it).

Every operation, an orchestrator's or a standalone one (the gRPC ``SnapshotAgentService``), runs here through
the same steps: answered from memory when its op id ran already, fenced by the group's epoch (``_op_rules``), in
its turn behind the snapshots a restore follows (``_restore_overlap``), under the job's lock, with ``OpStarted``
before and the ``OpResult`` after on the bus, the job's backends run while its processes are watched, and the
outcome stored in KV ``jobs``. Apart from ``Agent`` because this is the agent's one long path, and what the
agent's lifecycle and command intake need of it is small: ``run``, ``begin_standalone``, ``status``, ``epoch``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from timeslice_client.protocol import (
    JobContext,
    JobState,
    OpKind,
    OpResult,
    Restore,
    Snapshot,
    encode,
    subjects,
)

from . import _stored as stored
from ._backend_chain import Step, perform_parts
from ._config import AgentConfig
from ._group_fence import record_epoch
from ._job_book import JobBook, now_ms
from ._job_locks import JobLocks
from ._job_parts import all_backends, views
from ._op_messages import kind_of, naming, op_result, op_started
from ._op_rules import Answer, decide, settle
from ._ownership import ProcessGuard
from ._requests import log_refusal
from ._restore_overlap import RestoreOrder
from ._running_ops import RunningOps
from ._standalone import OpSettings, run_context
from ._untrusted import Refused
from .backends import OpContext, Outcome, acts_on_processes, make_backend
from .metrics import AgentMetrics

__all__ = ["OperationStatus", "Operations"]

log = logging.getLogger("timeslice.agent")


@dataclass(frozen=True, slots=True)
class OperationStatus:
    """An operation this agent ran or runs (see ``Agent.operation``)."""

    op_id: str
    done: bool
    result: OpResult | None  # set once done
    elapsed_ms: float


class Operations:
    """The operations of one agent: those running, the results it remembers, each group's newest epoch."""

    def __init__(
        self,
        config: AgentConfig,
        book: JobBook,
        locks: JobLocks,
        guard: ProcessGuard,
        metrics: AgentMetrics,
    ) -> None:
        self.node = book.node  # the book's node: this agent's
        self.config = config
        self.metrics = metrics
        self._book = book
        self._locks = locks
        self._guard = guard
        self._nc: NATS | None = None  # once bound
        self._js: JetStreamContext | None = None
        self._groups: KeyValue | None = None  # KV ``groups``: a group's epoch for a job registering afresh
        self._epochs: dict[str, int] = {}
        self._results: collections.OrderedDict[str, OpResult] = collections.OrderedDict()
        self._incarnation = secrets.token_hex(4)  # in the results' message ids: this agent's life, not the last one's
        self.running = RunningOps()  # a restore waits for the snapshots it follows (Restore.after)…
        self._order = RestoreOrder(  # …unless the node has room for both
            self.running,
            doubt=book.in_doubt,
            enabled=config.overlap_restores,
            margin_bytes=config.overlap_margin_bytes,
            margin_fraction=config.overlap_margin_fraction,
        )
        self.standalone: dict[str, tuple[str, float]] = {}  # running standalone op id -> job, start (monotonic s)

    def bind(self, nc: NATS, js: JetStreamContext, groups: KeyValue) -> None:
        self._nc, self._js, self._groups = nc, js, groups

    def epoch(self, group: str) -> int:
        """The group's newest epoch this agent has seen (0: none): a standalone operation runs at it."""
        return self._epochs.get(group, 0)

    async def fence_for_new_job(self, group: str) -> int:
        """The epoch a job registering afresh in ``group`` starts at (its context's, stored): the group's newest epoch,
        from its record (KV ``groups``) or from this agent's commands, whichever is newer. A command for the job older
        than that was decided before it registered, for an earlier life of a job of that id; the job's stored epoch
        keeps it stale after a restart of this agent too, when the group's fence in memory is gone (``seed_epochs``
        finds nothing for a group whose jobs all left). The group's own fence stays the newest command's: the record's
        epoch does not refuse another job's older operation still pending, which the orchestrator sends again
        unchanged to a restarted agent (a snapshot trailing a grant on restore)."""
        assert self._groups is not None
        data = await stored.kv_get(self._groups, group)
        epoch = record_epoch(data, group, self.node, lambda code: self.metrics.refusal("kv", code))
        return max(self._epochs.get(group, 0), epoch)

    def seed_epochs(self, contexts: Iterable[JobContext]) -> None:
        """After a restart, each group's fence from its jobs' last operations (their stored contexts), so that the
        commands the durable consumer delivers again from before the restart (its ack floor can lag the acks by
        seconds, across a NATS restart by more) are stale, not run a second time. A job that never ran an operation
        here (IDLE) adds nothing: its epoch is where it registered (``fence_for_new_job``), not a command's."""
        for ctx in contexts:
            if ctx.state is not JobState.IDLE and ctx.epoch > self._epochs.get(ctx.group, 0):
                self._epochs[ctx.group] = ctx.epoch

    def begin_standalone(self, cmd: Snapshot | Restore, kind: OpKind, asked: OpSettings) -> Coroutine[Any, Any, None]:
        """Count a standalone operation as running (``status``) and return what runs it (``asked``: its own
        settings)."""
        self.standalone[cmd.op_id] = (cmd.job, time.monotonic())
        return self._standalone_op(cmd, kind, asked)

    async def run(self, cmd: Snapshot | Restore, owner: bool, gate: asyncio.Event | None = None) -> None:
        """``gate``: the command's publish by the orchestrator this agent runs beside (see ``take``)."""
        if gate is not None and not gate.is_set():  # normally set already
            with contextlib.suppress(TimeoutError):  # set in a finally by the orchestrator: this bound is never hit
                async with asyncio.timeout(10):
                    await gate.wait()
        kind = kind_of(cmd)
        fresh = cmd.op_id not in self._results  # a redelivered command is answered from memory: not counted again
        ids = {"node": self.node, "group": cmd.group, "job": cmd.job, "op_id": cmd.op_id}
        try:
            try:
                result, published = await self._execute(cmd, kind)
            except Exception as exc:  # never leave the orchestrator waiting on an answer
                log.exception("operation crashed", extra=ids)
                self.metrics.task_error("operation")
                result, published = op_result(cmd, self.node, "?", ok=False, error=f"agent error: {exc!r}"), False
                fresh = False
                self.metrics.operation(result, "failed")
                self._remember(result)  # the same op id gets the same answer: a command sent again does not run again
            if fresh:
                self._count(result, performed=published)
            if not published:
                await self._publish_result(result)
        except Exception:  # an operation never ends the agent (its task group): logged, counted, dropped
            log.exception("operation not answered", extra=ids)
            self.metrics.task_error("operation")
        finally:
            if owner:
                self.running.finish(cmd.op_id)

    def _count(self, result: OpResult, *, performed: bool) -> None:
        """Metrics of an answered operation (``performed``: the backends ran, see ``_execute``)."""
        if not performed:
            outcome = "noop" if result.ok else "refused"
        elif result.ok:
            outcome = "ok"
        else:
            ctx = self._book.jobs.get(result.job)
            outcome = "failed" if ctx is None or ctx.state is JobState.FAULTED else "rolled_back"
        self.metrics.operation(result, outcome)

    async def _execute(
        self, cmd: Snapshot | Restore, kind: OpKind, asked: OpSettings | None = None
    ) -> tuple[OpResult, bool]:
        """Run one operation (``asked``: a request's own settings); returns its result and whether it was
        published already."""
        if (done := self._results.get(cmd.op_id)) is not None:
            return done, False  # the same op id gets the same answer
        if not isinstance(cmd, Restore) or not cmd.after:
            return await self._execute_now(cmd, kind, overlapped=False, asked=asked)
        others = [j for j in self._book.jobs.values() if j.group == cmd.group and j.job != cmd.job]
        async with self._order.turn(cmd, self._book.jobs.get(cmd.job), others) as turn:
            if turn.error is not None:
                return self._remember(op_result(cmd, self.node, "none", ok=False, error=turn.error)), False
            return await self._execute_now(cmd, kind, overlapped=turn.overlapped, asked=asked)

    async def _execute_now(
        self, cmd: Snapshot | Restore, kind: OpKind, *, overlapped: bool, asked: OpSettings | None
    ) -> tuple[OpResult, bool]:
        """``_execute`` once the operation's turn has come (``overlapped``: a restore beside its snapshots)."""
        async with self._locks.hold(cmd.job):
            if (done := self._results.get(cmd.op_id)) is not None:
                return done, False
            ctx = self._book.jobs.get(cmd.job)
            backend = "+".join(all_backends(ctx)) if ctx is not None and ctx.group == cmd.group else "none"
            verdict, fence = decide(
                ctx,
                **naming(cmd, self.node),
                deadline_ms=cmd.deadline_ms,
                newest_epoch=self._epochs.get(cmd.group, 0),
                now_ms=now_ms(),
            )
            if fence is not None:
                self._epochs[cmd.group] = fence
            if isinstance(verdict, Answer):
                if verdict.stale:  # e.g. delivered again after a restart of this agent: nothing moves
                    self.metrics.stale_commands.inc()
                    log.warning(
                        "stale command answered without running: %s",
                        verdict.error,
                        extra={"node": self.node, "group": cmd.group, "job": cmd.job, "op_id": cmd.op_id},
                    )
                if verdict.save is not None:
                    await self._book.save(verdict.save)
                answer = op_result(cmd, self.node, backend, ok=verdict.ok, error=verdict.error)
                return (self._remember(answer) if verdict.remember else answer), False
            assert ctx is not None
            remaining = cmd.deadline_ms / 1000 - time.time()
            op = OpContext(op_id=cmd.op_id, epoch=cmd.epoch, deadline=time.monotonic() + max(0.001, remaining))
            before = verdict.before
            ctx = await self._book.save(verdict.marked, wait=False)
            assert self._nc is not None
            await self._nc.publish(
                subjects.agent_op(self.node), encode(op_started(cmd, self.node, backend, overlapped=overlapped))
            )
            if overlapped:
                self.metrics.overlapped.labels(backend).inc()
            t0 = time.perf_counter()
            ran = run_context(ctx, kind, asked)  # the request's own settings, never stored as the job's
            performed = await self._perform_watched(ctx, op, kind, before, asked)
            elapsed = (time.perf_counter() - t0) * 1000
            if performed is None:
                # The job's processes ended mid-operation: nothing is left to move. Unregister it first, so
                # the orchestrator ends the operation as "job gone" (no fault), then answer the command.
                error = f"the job's processes exited during the {kind}"
                if (current := self._book.registration(ctx)) is not None:
                    await self._book.unregister(current, error)
                result = op_result(cmd, self.node, backend, ok=False, error=error, elapsed_ms=elapsed)
                await self._publish_result(result)
                return self._remember(result), True
            state, failure, outcome = performed
            result = op_result(
                cmd,
                self.node,
                backend,
                ok=failure is None,
                error=failure,
                outcome=outcome,
                elapsed_ms=elapsed,
                overlapped=overlapped,
            )  # beside: the core may grant on it
            # A restore that follows this operation (Restore.after) may start now: its first publish comes
            # after this result's on the connection, so the stream shows the result first. Neither waits for
            # the stream's answer to the result, nor for the KV write below.
            self.running.answered(cmd.op_id)
            await self._publish_result(result)  # the orchestrator waits on this; the KV write can follow
            if (current := self._book.registration(ctx)) is None:  # unregistered meanwhile: not brought back
                log.info(
                    "job unregistered during the %s: its outcome is not stored",
                    kind,
                    extra={"node": self.node, "job": cmd.job, "group": cmd.group, "op_id": cmd.op_id},
                )
                return self._remember(result), True
            await self._book.save(
                settle(
                    current,
                    ran,
                    op_id=cmd.op_id,
                    state=state,
                    failure=failure,
                    outcome=outcome,
                    elapsed_ms=elapsed,
                )
            )
            return self._remember(result), True

    async def _perform_watched(
        self, ctx: JobContext, op: OpContext, kind: OpKind, before: JobState, asked: OpSettings | None
    ) -> tuple[JobState, str | None, Outcome] | None:
        """Run the job's composed backends (``_backend_chain.perform``), every part of it at once (``_job_parts``), with
        the request's own settings (``asked``), while watching its processes: ``None`` when they all exited before
        the operation finished (it is cancelled then, not waited out)."""
        assert self._nc is not None
        nc, node, guard = self._nc, self.node, self._guard
        steps: list[Step] = []
        for part in views(ctx):
            part_op = op
            if acting := acts_on_processes(part.backends):
                try:
                    guard.verify(part)  # the processes are still the ones the job proved to own
                except Refused as exc:
                    log_refusal(
                        self.metrics,
                        node,
                        "command",
                        exc.code,
                        f"refused to act on the job's processes: {exc}",
                        job=ctx.job,
                        op_id=op.op_id,
                    )
                    if kind is OpKind.RESTORE:
                        return JobState.FAULTED, f"refused ({exc.code}): {exc}", Outcome()
                    state = JobState.IDLE if before is JobState.IDLE else JobState.RUNNING  # nothing was done
                    return state, f"{'+'.join(acting)} refused ({exc.code}): {exc} (nothing done)", Outcome()
                part_op = dataclasses.replace(op, may_act=functools.partial(guard.may_act, part))
            backends = [make_backend(b, nc, node) for b in part.backends]
            steps.append(Step(backends, run_context(part, kind, asked), part_op))
        outcome = await perform_parts(steps, kind, before, self.config.pid_check_s)  # watching each part's processes
        if outcome is None:
            log.warning(
                "job's processes exited during a %s", kind, extra={"node": node, "job": ctx.job, "op_id": op.op_id}
            )
        return outcome

    def _remember(self, result: OpResult) -> OpResult:
        self._results[result.op_id] = result
        while len(self._results) > self.config.max_results:
            self._results.popitem(last=False)
        return result

    async def _publish_result(self, result: OpResult) -> None:
        """The outcome, to the orchestrator: retried through an election (``_stored``), deduplicated by op id within
        this agent's life. An operation run again after a restart (its stored state still TRANSITIONING, its command
        delivered again) publishes its start again, so its answer must reach the stream again too: a start without an
        end reads as a context that may still be on the device. The orchestrator takes the first answer only."""
        assert self._js is not None
        await stored.publish(
            self._js,
            subjects.agent_event(self.node, result.group),
            encode(result),
            headers={"Nats-Msg-Id": f"{result.op_id}:result:{self._incarnation}"},
        )

    async def _standalone_op(self, cmd: Snapshot | Restore, kind: OpKind, asked: OpSettings) -> None:
        ids = {"node": self.node, "group": cmd.group, "job": cmd.job, "op_id": cmd.op_id}
        try:
            result, published = await self._execute(cmd, kind, asked)
            self._count(result, performed=published)
        except Exception as exc:
            log.exception("standalone operation crashed", extra=ids)
            self.metrics.task_error("standalone")
            result, published = op_result(cmd, self.node, "?", ok=False, error=f"agent error: {exc!r}"), False
            self.metrics.operation(result, "failed")
        self._remember(result)
        self.standalone.pop(cmd.op_id, None)
        if not published:
            try:
                await self._publish_result(result)  # a fact for replay; the orchestrator ignores it
            except Exception as exc:
                log.warning("standalone result not published: %r", exc, extra=ids)

    def status(self, op_id: str) -> OperationStatus | None:
        """An operation's state: running (``done`` False), finished (with its result), or None when this
        agent does not know the id (never seen, or long forgotten)."""
        if (result := self._results.get(op_id)) is not None:
            return OperationStatus(op_id, True, result, result.elapsed_ms)
        if (running := self.standalone.get(op_id)) is not None:
            return OperationStatus(op_id, False, None, (time.monotonic() - running[1]) * 1000)
        return None
