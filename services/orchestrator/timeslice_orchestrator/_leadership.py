"""Leader election for a hot-standby orchestrator: one lease key in the KV bucket ``leader``.

The leader holds ``$KV.leader.orchestrator``: a ``LeaderRecord`` written with a per-message TTL
(``Nats-TTL``, whole seconds) and renewed every ``renew_s`` by a compare-and-swap on its own revision.
A standby watches the key. When the record disappears (the leader resigned: a PURGE; it died: the
server expires the record after ``ttl_s`` and, with ``limit_marker_ttl``, writes a ``MaxAge`` marker
that watchers see at once) the standby campaigns: a write that succeeds only if nothing at all was
written to the bucket since it looked.

The term rule. A term is the stream sequence of the write that won the election: the campaign
publishes with ``Nats-Expected-Last-Sequence: S`` (the bucket's last sequence when it looked) and the
record says ``term = S + 1``, which is then exactly that write's sequence. JetStream sequences only
grow and each is given to one message, so terms are unique and strictly increasing, across expiries,
purges and markers (which a value-derived ``previous + 1`` would lose: an expired record takes its
term with it). Terms are therefore increasing but not consecutive. They restart only if the bucket
itself is deleted (see ``LeadershipError``).

Safety. ``is_leader()`` is true only while a local validity window holds:
``valid_until = (clock when the last successful write was SENT) + ttl_s - margin_s``. The server
stores that write no earlier than it was sent and expires it ``ttl_s`` after storing it (measured:
1.001-1.002 s for a 1 s TTL; docs/nats.md), so nobody else can win before the window has closed. The clock is
``CLOCK_BOOTTIME`` where there is one (it keeps counting through SIGSTOP and through a suspend of
the machine), else ``time.monotonic``. A paused process that resumes sees the window closed before
any other callback can publish, and its next write (a CAS on its old revision) is refused.

The key itself (its bucket, its record, reading it, the clock) is ``_lease_key``'s; this module holds the
election: campaigning, renewing, resigning and following.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, Header
from nats.js.errors import APIError, NotFoundError

from ._errors import LeadershipError, LeaderWaitTimeout, NotLeader
from ._lease_key import (
    LEADER_BUCKET,
    LEADER_KEY,
    STREAM,
    STREAM_NOT_FOUND,
    SUBJECT,
    UNANSWERED,
    LeaderRecord,
    Seen,
    clock,
    default_instance_id,
    ensure_leader_bucket,
    holder_pid,
    is_wrong_last,
    read_key,
    read_leader,
    seen_from,
)
from ._lease_timing import LeaseTiming
from ._tasks import cancel_and_wait

__all__ = [
    "LEADER_BUCKET",
    "LEADER_KEY",
    "LeaderRecord",
    "LeaderWaitTimeout",
    "Leadership",
    "LeadershipChange",
    "LeadershipError",
    "NotLeader",
    "ensure_leader_bucket",
    "holder_pid",
    "read_leader",
]

log = logging.getLogger("timeslice.orchestrator.leadership")


@dataclass(frozen=True, slots=True)
class LeadershipChange:
    """What ``on_change`` receives: ``leading`` True when elected, False when the lease is lost."""

    leading: bool
    term: int
    instance: str
    reason: str


class Leadership:
    """Campaign for, hold and give up the orchestrator lease. Run ``run(stop)`` as one task.

    ``is_leader()`` is the hot-path check. ``on_change`` (called in the event loop, must not block) and
    ``wait_leader`` report elections and losses; ``metrics(name, value)`` receives ``elected`` (term),
    ``lost`` (term), ``renew_s`` (latency of a renewal), ``renew_unknown``, ``window_lapsed``,
    ``campaign_lost`` and ``takeover_s`` (from seeing the key gone to holding it).
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        instance_id: str | None = None,
        label: str = "",
        ttl_s: int = 1,
        renew_s: float = 0.25,
        margin_s: float = 0.2,
        op_timeout_s: float = 0.5,
        replicas: int = 1,
        resign_on_stop: bool = True,
        on_change: Callable[[LeadershipChange], None] | None = None,
        metrics: Callable[[str, float], None] | None = None,
    ) -> None:
        self._js = js
        self.instance_id = instance_id or default_instance_id()
        self.label = label
        self.timing = LeaseTiming(ttl_s, renew_s, margin_s, op_timeout_s)
        self.replicas = replicas
        self.resign_on_stop = resign_on_stop
        self._on_change = on_change
        self._metrics = metrics
        self._lock = asyncio.Lock()  # one write to the key at a time
        self._wake = asyncio.Event()  # the watch saw something, resign() ran or stop was set
        self._waiters: list[asyncio.Future[None]] = []  # wait_leader()s, woken on every change of state
        self._leading = False
        self._term: int | None = None
        self._since_ms = 0
        self._rev = 0  # revision of our last confirmed write
        self._valid_until = 0.0
        self._last_sent = 0.0
        self._unconfirmed_since: float | None = None  # first send of a renewal whose outcome is unknown
        self._seen: Seen | None = None
        self._gone_at: float | None = None  # when this standby first saw the key empty
        self._holdoff_until = 0.0
        self._retired = False
        self._running = False

    def is_leader(self) -> bool:
        """True only while this instance holds the lease and its validity window has not passed."""
        return self._leading and clock() < self._valid_until

    @property
    def term(self) -> int | None:
        """The term held (None when not leading)."""
        return self._term if self._leading else None

    @property
    def holder(self) -> LeaderRecord | None:
        """The latest record this instance saw (its own when leading)."""
        return self._seen.record if self._seen else None

    def _extra(self) -> dict[str, Any]:
        return {"term": self._term, "instance": self.instance_id}

    def _metric(self, name: str, value: float = 1.0) -> None:
        if self._metrics is not None:
            try:
                self._metrics(name, value)
            except Exception:
                log.exception("leadership metrics hook failed", extra=self._extra())

    def _become_leader(self, term: int, rev: int, sent: float, record: LeaderRecord, gone_at: float | None) -> None:
        self._leading = True
        self._term = term
        self._rev = rev
        self._valid_until = self.timing.valid_until(sent)
        self._last_sent = sent
        self._unconfirmed_since = None
        self._since_ms = record.since_ms
        self._seen = Seen(rev, record, float(self.timing.ttl_s), clock())
        self._pulse()
        self._gone_at = None
        if gone_at is not None:
            self._metric("takeover_s", clock() - gone_at)
        log.info("became leader", extra=self._extra())
        self._metric("elected", term)
        self._notify(True, term, "elected")

    def _step_down(self, reason: str) -> None:
        if not self._leading:
            return
        term = self._term or 0
        self._leading = False
        self._valid_until = 0.0
        self._unconfirmed_since = None
        self._pulse()
        log.log(
            logging.INFO if reason in ("resigned", "stopped") else logging.WARNING,
            "lost leadership: %s",
            reason,
            extra=self._extra(),
        )
        self._metric("lost", term)
        self._notify(False, term, reason)

    def _notify(self, leading: bool, term: int, reason: str) -> None:
        if self._on_change is not None:
            try:
                self._on_change(LeadershipChange(leading, term, self.instance_id, reason))
            except Exception:
                log.exception("leadership on_change callback failed", extra=self._extra())

    def _pulse(self) -> None:
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    def _observe(self, seen: Seen) -> None:
        """A newer state of the key (from the watch or a read)."""
        old = self._seen
        if old is not None and seen.rev == old.rev and seen.record == old.record:
            return  # the same state again: keep when it was first seen (its expiry runs from then)
        if old is not None and 0 < seen.rev < old.rev:
            return  # stale (rev 0 is a read that found no message at all: an expiry without a marker)
        self._seen = seen
        if seen.record is None:
            if self._gone_at is None:
                self._gone_at = seen.at
        else:
            self._gone_at = None
        if self._leading and (seen.rev > self._rev or seen.rev == 0):
            r = seen.record
            if r is None or r.holder != self.instance_id or r.term != self._term:
                self._step_down(
                    f"the key changed under us at revision {seen.rev}: "
                    f"{'gone' if r is None else f'held by {r.holder} term {r.term}'}"
                )
        self._wake.set()

    def _record(self) -> LeaderRecord:
        assert self._term is not None
        return LeaderRecord(self.instance_id, self._term, self._since_ms, self.label)

    async def _publish(self, data: bytes, headers: dict[str, str]) -> int:
        pa = await self._js.publish(SUBJECT, data, timeout=self.timing.op_timeout_s, headers=headers)
        return int(pa.seq)

    async def _campaign(self) -> None:
        async with self._lock:
            if self._leading or self._retired:
                return
            async with asyncio.timeout(self.timing.op_timeout_s):
                last_seq = int((await self._js.stream_info(STREAM)).state.last_seq)
            seen = await read_key(self._js, self.timing.op_timeout_s)
            self._observe(seen)
            if seen.record is not None:
                return
            term = last_seq + 1
            record = LeaderRecord(self.instance_id, term, int(time.time() * 1000), self.label)
            headers = {
                Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(seen.rev),
                Header.EXPECTED_LAST_SEQUENCE.value: str(last_seq),
                Header.MSG_TTL.value: f"{self.timing.ttl_s}s",
            }
            gone_at = self._gone_at  # (the watch may show our record before the answer comes)
            sent = clock()
            try:
                rev = await self._publish(msgspec.json.encode(record), headers)
            except APIError as exc:
                if not is_wrong_last(exc):
                    raise
                log.debug("campaign for term %d lost: %s", term, exc.description, extra=self._extra())
                self._metric("campaign_lost")
                return
            except UNANSWERED:  # the record, if it landed, says whether we won
                seen = await read_key(self._js, self.timing.op_timeout_s)
                if seen.record == record:
                    rev = seen.rev
                else:
                    self._observe(seen)
                    return
            if rev != term:  # pragma: no cover - the expected-last-sequence header makes this impossible
                raise LeadershipError(
                    f"campaign write landed at revision {rev}, expected {term}: "
                    "the server ignored Nats-Expected-Last-Sequence; upgrade nats-server"
                )
            self._become_leader(term, rev, sent, record, gone_at)

    async def _renew(self) -> None:
        async with self._lock:
            if not self._leading:
                return
            if clock() >= self._valid_until:
                self._metric("window_lapsed")
            sent = clock()
            if self._unconfirmed_since is None:
                self._unconfirmed_since = sent
            self._last_sent = sent
            headers = {
                Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(self._rev),
                Header.MSG_TTL.value: f"{self.timing.ttl_s}s",
            }
            try:
                rev = await self._publish(msgspec.json.encode(self._record()), headers)
            except APIError as exc:
                if not is_wrong_last(exc):
                    raise
                # Deposed, unless an earlier renewal whose answer we never got had landed: the key says which.
                await self._reconcile(refused=f"renewal of revision {self._rev} refused ({exc.description})")
                return
            except UNANSWERED:
                self._metric("renew_unknown")
                await self._reconcile()
                return
            self._confirmed(rev, self._unconfirmed_since)
            self._metric("renew_s", clock() - sent)

    def _confirmed(self, rev: int, sent: float) -> None:
        self._rev = rev
        self._valid_until = self.timing.valid_until(sent)
        self._unconfirmed_since = None
        self._pulse()

    async def _reconcile(self, refused: str | None = None) -> None:
        """After a renewal that was refused or not answered: read the key and believe what it says."""
        try:
            seen = await read_key(self._js, self.timing.op_timeout_s)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning(
                "leader key unreadable after a renewal (%s): %r", refused or "unanswered", exc, extra=self._extra()
            )
            if refused:
                self._step_down(refused)
            return  # unanswered: the window runs out unless a later renewal succeeds
        r = seen.record
        if r is not None and r.holder == self.instance_id and r.term == self._term and seen.rev >= self._rev:
            if seen.rev > self._rev and self._unconfirmed_since is not None:
                self._confirmed(seen.rev, self._unconfirmed_since)  # the write landed; its earliest send counts
            return
        self._observe(seen)
        self._step_down(refused or f"after an unanswered renewal the key is at revision {seen.rev}, not ours")

    async def confirm(self) -> int:
        """A fenced write: renew now and return the term, or raise ``NotLeader``."""
        await self._renew()
        if not self.is_leader():
            raise NotLeader(self.instance_id, self._term, "the renewal was refused or the lease lapsed")
        assert self._term is not None
        return self._term

    async def resign(self, *, rejoin: bool = False, timeout: float = 2.0) -> bool:
        """Give up the lease at once (a PURGE, CAS on our revision) so a standby takes over.

        Without ``rejoin`` this instance never campaigns again and ``run`` returns; with it, it becomes a
        standby that holds off for ``ttl_s``. True when the purge was written."""
        self._retired = self._retired or not rejoin
        if rejoin:
            self._holdoff_until = clock() + self.timing.ttl_s
        self._wake.set()
        async with asyncio.timeout(timeout), self._lock:
            if not self._leading:
                return False
            rev, term = self._rev, self._term
            self._step_down("resigned")  # believe it before telling anyone
            headers = {
                "KV-Operation": "PURGE",
                Header.ROLLUP.value: "sub",
                Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(rev),
            }
            try:
                await self._publish(b"", headers)
            except APIError as exc:
                if not is_wrong_last(exc):
                    raise
                log.info("resign: the lease was already gone", extra={"term": term, "instance": self.instance_id})
                return False
            log.info("resigned", extra={"term": term, "instance": self.instance_id})
            return True

    async def wait_leader(self, timeout: float) -> int:
        """Wait until this instance leads; its term. ``LeaderWaitTimeout`` after ``timeout`` s."""
        deadline = clock() + timeout
        while not self.is_leader():
            left = deadline - clock()
            if left <= 0:
                raise LeaderWaitTimeout(self.instance_id, timeout, self.holder.holder if self.holder else None)
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(left):
                    await waiter
            except TimeoutError:
                pass
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        assert self._term is not None
        return self._term

    async def _sleep_until(self, at: float) -> None:
        """Wait for the watch, resign or stop, at most until ``at`` on ``clock()``."""
        left = at - clock()
        if left <= 0 or self._wake.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await self._wake.wait()

    async def _on_msg(self, msg: Any) -> None:
        self._observe(seen_from(msg.metadata.sequence.stream, msg.headers, msg.data))

    async def run(self, stop: asyncio.Event) -> None:
        """Campaign, lead and stand by until ``stop`` is set (then resign if leading) or ``resign()``."""
        if self._running:
            raise LeadershipError(f"Leadership.run() of {self.instance_id} is already running; run it once")
        self._running = True
        try:
            await ensure_leader_bucket(self._js, replicas=self.replicas)
            sub = await self._js.subscribe(
                SUBJECT,
                stream=STREAM,
                cb=self._on_msg,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                inactive_threshold=60.0,
            )
        except BaseException:
            self._running = False
            raise

        async def relay_stop() -> None:
            await stop.wait()
            self._wake.set()

        stopper = asyncio.get_running_loop().create_task(relay_stop())
        try:
            while not stop.is_set() and not self._retired:
                self._wake.clear()
                try:
                    if self._leading:
                        await self._lead_once()
                    else:
                        await self._follow_once()
                except (TimeoutError, *UNANSWERED) as exc:
                    log.warning("leader key unreachable: %r", exc, extra=self._extra())
                    await self._sleep_until(clock() + min(self.timing.renew_s, 0.1))
                except NotFoundError as exc:
                    if exc.err_code != STREAM_NOT_FOUND:
                        raise
                    self._step_down("the leader bucket was deleted")
                    raise LeadershipError(
                        f"the KV bucket {LEADER_BUCKET!r} was deleted while running: terms would restart from 1. "
                        "Stop every orchestrator, then start them again"
                    ) from exc
        except nats.errors.ConnectionClosedError as exc:
            self._step_down("the NATS connection closed")
            raise LeadershipError(
                f"instance {self.instance_id}: the NATS connection closed; Leadership.run() needs an open connection"
            ) from exc
        finally:
            await cancel_and_wait(stopper)
            if self._leading and self.resign_on_stop:
                try:
                    await self.resign(timeout=self.timing.op_timeout_s * 2)
                except (TimeoutError, nats.errors.Error) as exc:
                    log.warning(
                        "resign on stop failed: %r (the lease expires in %d s)",
                        exc,
                        self.timing.ttl_s,
                        extra=self._extra(),
                    )
            self._step_down("stopped")
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timing.op_timeout_s):
                    await sub.unsubscribe()
            self._running = False

    async def _lead_once(self) -> None:
        await self._sleep_until(self._last_sent + self.timing.renew_s)
        if self._wake.is_set() or not self._leading:
            return  # the watch or stop woke us: the loop looks again
        await self._renew()

    async def _follow_once(self) -> None:
        now = clock()
        seen = self._seen
        if now < self._holdoff_until:
            await self._sleep_until(self._holdoff_until)
            return
        if seen is None or seen.record is None:
            await self._campaign()
            if not self._leading:  # lost the race: the winner's record arrives on the watch
                await self._sleep_until(clock() + self.timing.renew_s)
            return
        # Held by someone: the watch tells us when it goes; re-read if nothing came by its expiry.
        ttl = seen.ttl_s if seen.ttl_s is not None else float(self.timing.ttl_s)
        await self._sleep_until(max(seen.at + ttl + 0.1, now + 0.05))
        if not self._wake.is_set():
            self._observe(await read_key(self._js, self.timing.op_timeout_s))
