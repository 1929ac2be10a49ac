"""The orchestrator's shell: consume events, apply the pure core, publish decisions, persist records.

Order of work for one event (the pure ``core.apply`` decides; this shell does all the I/O around it):

1. the push consumer delivers it (stream order, one group's events in order);
2. ``core.apply`` decides, and the decisions (grants, notices, agent commands) are published at once
   (``_decisions``; an input is checked before, ``_inputs``);
3. a per-group writer stores the new record, fenced by the leader's term (``_records``; no per-key
   compare-and-swap), and only then acknowledges the events the record reflects.

After a crash the orchestrator catches up from the durable consumer's ack floor before it binds the
durable again: an ordered consumer with the stream's single subject reads the backlog (a consumer with
several filter subjects reads stored messages ~10x slower, see ``_catch_up``); events already reflected
in a record are skipped by sequence number, the others are applied again and re-issue the same
decisions with the same epochs (clients treat a repeated grant as a duplicate). Only once every record
that reflects the caught-up events is stored does the durable move past them (that is their ack).

Expiries enter as ``Tick`` events this shell publishes at each record's next deadline, so ``now`` is
always an event's stream timestamp.

A node agent can run in this process on the orchestrator's connection (``local_agent``; ``timeslice up``
does this). Its node's commands are then handed to it directly as they are published, instead of reaching
it through the stream one bus hop later. Sharing the connection keeps the stream's order: a command is
stored before anything the agent writes about it. Everything else about the agent is unchanged: it still
has its durable consumer (a command published before it was ready, or during a restart, arrives that way),
its results still reach this orchestrator only through the stream, and it answers a command delivered twice
once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from timeslice_client._internal.bus_layout import ensure_bus
from timeslice_client.bus import connect
from timeslice_client.protocol import GroupRecord, InputEvent, encode, subjects

from ._agents_watch import watch_agents
from ._catch_up import ack_floor, bind_durable, catch_up, failure, fill_gap
from ._config import OrchestratorConfig
from ._decisions import publish_decisions
from ._delivery import delivery_with_consumer_seq, first, route
from ._errors import OrchestratorError, ServiceFailed
from ._in_process_agent import LocalAgent, ready_beside, run_beside
from ._inputs import checked_input, malformed_refusal
from ._leadership import Leadership, LeadershipChange
from ._lease_guard import confirm_lease
from ._quarantine import Quarantine
from ._records import Deposed, RecordStore, Unusable, beyond_stream_end, fresh_record, load_all
from ._timers import Timers
from .core import apply, new_record
from .metrics import OrchestratorMetrics

__all__ = ["LocalAgent", "Orchestrator", "OrchestratorConfig", "OrchestratorError"]

log = logging.getLogger("timeslice.orchestrator")


@dataclass(slots=True)
class _Entry:
    rec: GroupRecord
    rev: int | None  # KV revision of the stored record; None while it was never stored
    acks: list[Msg] = field(default_factory=list)
    dirty: bool = False
    queued: bool = False
    quarantined: str | None = None  # why this group is not served (its record is unusable)


class Orchestrator:
    """Run with ``await Orchestrator(config).run()``; stop with ``shutdown()`` (idempotent)."""

    def __init__(
        self,
        config: OrchestratorConfig | None = None,
        *,
        nc: NATS | None = None,
        metrics: OrchestratorMetrics | None = None,
        local_agent: Callable[[NATS], LocalAgent] | None = None,
    ) -> None:
        """``local_agent``: builds the node agent this orchestrator runs beside itself, on the connection it
        is given (the orchestrator's); it starts once the orchestrator consumes and stops before it drains."""
        self.config = config or OrchestratorConfig()
        self.metrics = metrics if metrics is not None else OrchestratorMetrics()
        self._nc = nc
        self._own_nc = nc is None
        self._local_factory = local_agent
        self.local_agent: LocalAgent | None = None
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None
        self._store: RecordStore | None = None
        self._quarantined: Quarantine | None = None
        self._agents_kv: KeyValue | None = None
        self._groups: dict[str, _Entry] = {}
        self._write_q: asyncio.Queue[str] = asyncio.Queue(self.config.write_queue)
        self._timers = Timers(self.config.tick_retry_ms)
        self._stop = asyncio.Event()
        self._halt = asyncio.Event()  # set by shutdown() or the end of a term: whatever runs in the term ends
        self._term_over = asyncio.Event()  # this term's lease is lost: nothing more is published or stored
        self._term_over.set()  # no term yet
        self._ready = asyncio.Event()
        self._connected = asyncio.Event()
        self.leadership: Leadership | None = None
        self._fatal: BaseException | None = None
        self._sub: Any = None
        self._last_cseq = self._last_sseq = 0  # the consumer's and the stream's sequence of the latest live delivery
        self._queued = 0  # groups waiting for (or in) a write
        self._writes_idle = asyncio.Event()
        self._writes_idle.set()
        self.events_rejected = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def ready(self) -> asyncio.Event:
        """Set while this instance leads and serves (its durable consumer bound, its records caught up)."""
        return self._ready

    @property
    def connected(self) -> asyncio.Event:
        """Set while this instance is connected and campaigning or leading: a standby has it, and not ``ready``."""
        return self._connected

    async def run(self) -> None:
        """Connect, stand by until elected, lead (``_term``) until the lease is lost or ``shutdown()``; a lost lease
        makes this instance a standby again. On ``shutdown()`` a leader stores what it decided, then resigns, so
        that a standby takes over at once."""
        nc = self._nc
        if nc is None:
            nc = self._nc = await connect(self.config.nats_url, name="timeslice-orchestrator", **self.config.identity())
        self._js = nc.jetstream()
        buckets = await ensure_bus(self._js, self.config.bus)
        self._kv = buckets.groups
        self._agents_kv = buckets.agents
        # A record stays far below the server's payload limit (core.Limits); a larger one is never written.
        self._store = RecordStore(
            self._js,
            self._kv,
            attempts=self.config.write_attempts,
            timeout_s=self.config.write_timeout_s,
            max_bytes=min(self.config.max_record_bytes, nc.max_payload * 3 // 4),
        )
        self._quarantined = Quarantine(nc, self.metrics)
        cfg = self.config
        self.leadership = leader = Leadership(
            self._js,
            instance_id=cfg.instance_id,
            ttl_s=cfg.leader_ttl_s,
            renew_s=cfg.leader_renew_s,
            replicas=cfg.bus.replicas or 1,
            resign_on_stop=False,
            on_change=self._on_leadership,
            metrics=self.metrics.leadership,
        )
        lead_stop = asyncio.Event()
        local: asyncio.Task[None] | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._run_leadership(leader, lead_stop))
                if self._local_factory is not None:
                    self.local_agent = self._local_factory(nc)
                    local = tg.create_task(run_beside(self.local_agent, self._stop, self._die))
                self._connected.set()
                log.info("connected as %s: campaigning (a standby until elected)", leader.instance_id)
                while not self._stop.is_set():
                    await first(leader.wait_leader(3600.0), self._stop.wait())
                    if self._stop.is_set():
                        break
                    if leader.is_leader():
                        try:
                            await self._term()
                        except Exception as exc:  # the bus failed under the term's start (a cluster electing)
                            log.warning("the term could not go on (%s); starting it over", failure(exc))
                            self._end_term(f"failed: {exc!r}")
                            with contextlib.suppress(TimeoutError):
                                async with asyncio.timeout(0.5):  # back off before the next try; a stop ends it
                                    await self._stop.wait()
                if local is not None:
                    assert self.local_agent is not None
                    self.local_agent.shutdown()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(30):
                            await asyncio.wait({local})
                if leader.is_leader():
                    with contextlib.suppress(Exception):
                        await leader.resign(timeout=2.0)  # a standby takes over now, not at the lease's expiry
                lead_stop.set()
        finally:
            self._connected.clear()
            if self._own_nc and nc.is_connected:
                with contextlib.suppress(Exception):
                    await nc.drain()
        if self._fatal is not None:
            raise ServiceFailed(str(self._fatal)) from self._fatal

    async def _run_leadership(self, leader: Leadership, stop: asyncio.Event) -> None:
        try:
            await leader.run(stop)
        except Exception as exc:
            self._die(exc)

    def _on_leadership(self, change: LeadershipChange) -> None:
        self.metrics.leading = int(change.leading)
        if not change.leading:
            self._end_term(f"leadership lost: {change.reason}")

    def _end_term(self, why: str) -> None:
        """Stop acting as the leader at once: nothing more is published or stored in this term."""
        if not self._term_over.is_set():
            log.warning("orchestrator term ends: %s", why)
            self._term_over.set()
            self._halt.set()
            self._timers.wake()

    async def _deposed(self, exc: Deposed) -> None:
        """The server refused this term's writes: another leader's term began (this one was paused past its lease,
        or lost it). Stop, give the lease up if it is still held, and stand by."""
        log.error("%s", exc)
        self._end_term(str(exc))
        if self.leadership is not None:
            with contextlib.suppress(Exception):
                await self.leadership.resign(rejoin=True)

    async def _still_leading(self) -> bool:
        """Whether this instance may publish or store a decision now (``_lease_guard.confirm_lease``). Events wait
        meanwhile (this runs inside the consumer's callback), so the term goes on with nothing skipped."""
        leader = self.leadership
        if leader is None or self._term_over.is_set():
            return False
        why = await confirm_lease(
            leader, ttl_s=self.config.leader_ttl_s, wait_s=self.config.leader_confirm_wait_s, halt=self._halt
        )
        if why is None:
            return True
        self._end_term(why)
        return False

    async def _term(self) -> None:
        """One term as the leader: load the records, catch up from the ack floor, consume, until the lease is lost
        or ``shutdown()``. A standby that takes over does exactly what a restarted orchestrator does."""
        self._term_over = asyncio.Event()
        self._halt = asyncio.Event()
        if self._stop.is_set():
            return
        self._groups, self._timers, self._queued = {}, Timers(self.config.tick_retry_ms), 0
        self._write_q = asyncio.Queue(self.config.write_queue)
        self._writes_idle.set()
        assert self._quarantined is not None and self._store is not None and self._js is not None
        self._quarantined.groups.clear()
        leader = self.leadership
        assert leader is not None
        term = leader.term
        log.info("orchestrator leads", extra={"term": term})
        try:
            if term is None:
                return  # lost again already
            try:
                await self._store.begin_term(term, leader.instance_id)
            except Deposed as exc:
                await self._deposed(exc)
                return
            for loaded in await load_all(self._store.kv):
                self._groups[loaded.group] = _Entry(rec=loaded.record or new_record(loaded.group), rev=loaded.revision)
                if loaded.record is None:
                    await self._quarantine(loaded.group, loaded.unusable or "unusable")
                else:
                    self._timers.arm(loaded.group, loaded.record)
                    self.metrics.loaded(loaded.record)
            await self._quarantined.lift_stale({g for g, e in self._groups.items() if e.quarantined is None})
            async with asyncio.TaskGroup() as tg:
                for _ in range(self.config.writers):
                    tg.create_task(self._writer())
                tg.create_task(self._timers.run(self._js, lambda g: self._groups[g].rec, self._halt))
                agents_known = asyncio.Event()
                tg.create_task(self._watch_agents(agents_known))
                await first(agents_known.wait(), self._halt.wait())
                floor = await ack_floor(self._js, self.config.durable)  # every input up to it is acknowledged
                await self._distrust_future_records(floor)
                caught_up = await self._catch_up(floor)
                if not self._done() and await self._stored_all() and await self._still_leading():
                    await self._subscribe(caught_up)
                    if await self._local_ready():
                        log.info("orchestrator ready", extra={"groups": len(self._groups)})
                        self._ready.set()
                await first(self._stop.wait(), self._term_over.wait())
                if not self._term_over.is_set():
                    await self._drain()
                raise _Stopped
        except* _Stopped:
            pass
        finally:
            self._ready.clear()
            self._term_over.set()
            if self._sub is not None:
                with contextlib.suppress(Exception):
                    await self._sub.unsubscribe()
                self._sub = None

    def _done(self) -> bool:
        return self._halt.is_set()

    async def _local_ready(self) -> bool:
        """Until the agent beside this orchestrator (if any) is ready; False when stopping instead."""
        agent = self.local_agent
        return agent is None or await ready_beside(agent, self.config.local_agent_ready_s, self._halt, self._die)

    def shutdown(self) -> None:
        """Ask ``run()`` to finish: stop consuming, store what was decided, return. Safe to call twice."""
        self._stop.set()
        self._halt.set()
        self._timers.wake()

    def _die(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
            log.error("orchestrator stopping on a fatal error: %s", exc)
        self.shutdown()

    async def _drain(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await self._writes_idle.wait()  # writers store what was decided
        assert self._nc is not None
        with contextlib.suppress(Exception):
            await self._nc.flush(timeout=2)

    # ------------------------------------------------------------------ startup

    async def _distrust_future_records(self, floor: int) -> None:
        """Records from beyond the stream's end are caught up from the ack floor (``_records.beyond_stream_end``)."""
        assert self._js is not None
        for group, rec in (
            await beyond_stream_end(self._js, {g: e.rec for g, e in self._groups.items()}, floor)
        ).items():
            self._groups[group].rec = rec

    async def _catch_up(self, floor: int) -> int:
        """Apply the inputs after ``floor`` up to the stream's current end (``_catch_up.catch_up``); returns the
        last sequence read. Nothing is acknowledged: the durable stays at ``floor`` until ``_subscribe`` moves it
        past what this read, after the records are stored; a crash before that catches up from ``floor`` again."""
        assert self._js is not None
        return await catch_up(
            self._js,
            floor,
            functools.partial(self._on_input, live=False),
            self._halt,
            idle_s=self.config.catch_up_idle_s,
            pending_limit=self.config.write_queue,
        )

    async def _stored_all(self) -> bool:
        """Wait until every decided record is stored; False when stopping instead (or a write failed)."""
        while not self._writes_idle.is_set() and not self._halt.is_set():
            await first(self._writes_idle.wait(), self._halt.wait())
        return self._fatal is None and not self._halt.is_set()

    async def _subscribe(self, after: int) -> None:
        """(Re)create the durable consumer at ``after + 1``: everything up to ``after`` is acknowledged."""
        assert self._js is not None and self._nc is not None
        self._last_cseq, self._last_sseq = 0, after
        self._sub = await bind_durable(
            self._js,
            self._nc,
            self.config.durable,
            after,
            self._on_msg,
            ack_wait_s=self.config.ack_wait_s,
            max_ack_pending=self.config.max_ack_pending,
        )

    # ------------------------------------------------------------------ the hot path

    async def _on_msg(self, msg: Msg) -> None:
        await self._on_input(msg, live=True)

    async def _on_input(self, msg: Msg, *, live: bool) -> None:
        """One input; ``live``: from the durable consumer (acknowledged once its record is stored), else
        from the catch-up read (acknowledged by moving the durable past it)."""
        if self._fatal is not None or self._term_over.is_set():
            return  # not leading: the next leader applies it (it is not acknowledged)
        try:
            seq, now_ms, pending, cseq = delivery_with_consumer_seq(msg.reply)
        except (ValueError, IndexError):
            return  # not a JetStream delivery (flow control or a stray publish)
        if live:
            # Deliveries in between never arrived (a clustered consumer's leader failed over with them in flight):
            # applying this one first would apply the stream out of order. What they carried is read from the
            # stream and applied first; failing that, the term starts over from the ack floor, in stream order.
            if cseq > self._last_cseq + 1 and not await self._fill_gap(seq):
                self._end_term(
                    f"deliveries {self._last_cseq + 1}..{cseq - 1} of the durable consumer never "
                    "arrived; catching up again from the ack floor"
                )
                return
            self._last_cseq, self._last_sseq = max(self._last_cseq, cseq), max(self._last_sseq, seq)
        try:
            group, job = route(msg.subject)
        except ValueError as exc:
            log.warning("rejected event on %s: %s", msg.subject, exc)
            self.events_rejected += 1
            self.metrics.rejected += 1
            if live:
                await msg.ack()
            return
        try:
            ev = checked_input(msg.subject, msg.data, job)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            await self._reject(msg, group, job, exc, live=live)
            return
        # More inputs behind this one: still at the server, or already read and queued in this subscription.
        backlog = pending > 0 or (self._sub is not None and self._sub.pending_msgs > 0)
        await self._apply(msg, group, ev, now_ms, seq, live=live, backlog=backlog)

    async def _fill_gap(self, before: int) -> bool:
        assert self._js is not None and self._nc is not None
        inputs = functools.partial(self._on_input, live=False)
        return await fill_gap(self._js, self._nc, self._last_sseq, before, inputs)

    async def _apply(
        self, msg: Msg, group: str, ev: InputEvent, now_ms: int, seq: int, *, live: bool, backlog: bool = False
    ) -> None:
        """Apply one input; ``backlog``: the consumer has more inputs waiting behind this one."""
        entry = self._groups.get(group)
        if entry is None:
            rec = await fresh_record(self._js, group, timeout_s=self.config.write_timeout_s)
            entry = self._groups[group] = _Entry(rec=rec, rev=None)
        if entry.quarantined is not None:
            await self._refuse_quarantined(msg, group, ev, entry.quarantined, live=live)
            return
        t0 = time.perf_counter()
        try:
            new, actions = apply(entry.rec, ev, now_ms, seq)
        except Exception as exc:  # a bug in the core must not take down every other group
            log.exception("apply failed", extra={"group": group, "seq": seq})
            await self._reject(msg, group, getattr(ev, "job", None), exc, live=live)
            return
        elapsed = time.perf_counter() - t0
        if actions:
            leader = self.leadership
            if not (leader is not None and leader.is_leader()) and not await self._still_leading():
                return  # deposed: decides nothing more (the next leader applies this event again)
            assert self._nc is not None
            await publish_decisions(self._nc, self.local_agent, group, actions, seq)
            if live and not backlog:
                # nats-py's publish only buffers; its flusher task writes. Yield once so it writes the decisions
                # now, not after the bookkeeping below. Not when more inputs wait behind this one (nor in a
                # catch-up): then the decisions of several inputs go out in one write, and their records are
                # stored together, which is what keeps a busy orchestrator's cost per input flat. Events are
                # applied by this one callback, so the yield reorders nothing.
                await asyncio.sleep(0)
        self.metrics.applied(ev, entry.rec, new, actions, now_ms, elapsed)
        if new is entry.rec:
            if live:
                await msg.ack()
            return
        entry.rec = new
        if live:
            entry.acks.append(msg)
        entry.dirty = True
        self._timers.arm(group, new)
        if not entry.queued:
            entry.queued = True
            self._queued += 1
            self._writes_idle.clear()
            await self._write_q.put(group)

    async def _reject(self, msg: Msg, group: str, job: str | None, exc: BaseException, *, live: bool) -> None:
        self.events_rejected += 1
        self.metrics.rejected += 1
        log.warning("rejected event %s: %s", msg.subject, exc, extra={"group": group, "job": job})
        if job is not None:
            assert self._nc is not None
            refusal = malformed_refusal(msg.subject, msg.data, group, job, exc)
            await self._nc.publish(subjects.notice(group, job), encode(refusal))
        if live:
            await msg.ack()

    # ------------------------------------------------------------------ quarantine

    async def _quarantine(self, group: str, reason: str) -> None:
        """Stop serving ``group`` alone: its record cannot be loaded, decoded or stored. Its inputs are refused
        (``ErrorCode.QUARANTINED``) until an operator repairs the record and restarts the orchestrator; the fact is
        in the stream, in the metrics and in ``timeslice status``; every other group goes on."""
        entry = self._groups[group]
        if entry.quarantined is not None:
            return
        entry.quarantined = reason
        entry.dirty = False
        assert self._quarantined is not None
        await self._quarantined.add(group, reason)

    async def _refuse_quarantined(self, msg: Msg, group: str, ev: InputEvent, reason: str, *, live: bool) -> None:
        assert self._quarantined is not None
        await self._quarantined.refuse(group, ev, reason)
        self.events_rejected += 1
        self.metrics.rejected += 1
        if live:
            await msg.ack()

    # ------------------------------------------------------------------ persistence

    async def _writer(self) -> None:
        store = self._store
        assert store is not None
        while True:
            group = await self._write_q.get()
            entry = self._groups[group]
            try:
                while entry.dirty:
                    entry.dirty = False
                    rec, acks = entry.rec, entry.acks
                    entry.acks = []
                    if not await self._still_leading():
                        return  # deposed: nothing more is stored or acknowledged in this term
                    try:
                        entry.rev = await store.store(group, rec)
                    except Unusable as exc:
                        await self._quarantine(group, exc.reason)
                    except Deposed as exc:
                        await self._deposed(exc)
                        return
                    for m in acks:
                        await m.ack()
            except Exception as exc:
                self._die(exc)
                return
            finally:
                entry.queued = False
                self._queued -= 1
                if self._queued == 0:
                    self._writes_idle.set()

    # ------------------------------------------------------------------ agents

    async def _watch_agents(self, known: asyncio.Event) -> None:
        """An agent whose key expired (TTL) or was deleted and that does not answer is lost: its pending operations
        are resolved and its placements dropped, through ``AgentLost`` events in the stream (``_agents_watch``)."""
        assert self._agents_kv is not None and self._js is not None and self._nc is not None
        await watch_agents(
            self._agents_kv,
            self._js,
            self._nc,
            lambda: {g: e.rec for g, e in self._groups.items()},
            self._halt,
            known,
            probe_s=self.config.agent_probe_s,
            recheck_s=self.config.agent_probe_s,
            start_grace_s=self.config.agent_probe_s,
            counts=self.metrics.agents,
        )


class _Stopped(Exception):
    pass
