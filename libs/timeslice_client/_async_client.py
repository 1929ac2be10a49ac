"""``AsyncTimeSliceClient``: the asyncio core of the client library."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import Any, Unpack, overload

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from ._bind import Binding, bind_process
from ._grants import Grant, ReleaseResult, _Claim, _Hold, _Superseded, _WaitLost
from ._hold_scope import AsyncHold, AsyncScopes
from ._keeper import keep
from ._multi_group import AsyncMultiHold, JobGroups, MultiGroupCalls, sibling
from ._publish_rules import publish_stored, request_id
from ._refusals import refusal_error
from ._release_calls import ReleaseCalls
from ._renamed import RenamedAttribute, renamed_keywords
from ._workload_options import CLIENT_WORKLOAD_KEYS, ClientWorkloadOptions, check_options
from .bus import CredsPath, TlsOption, connect, default_nats_url, resolve_nats_url
from .errors import (
    AcquireCancelled,
    AcquireTimeout,
    InvalidRequest,
    TimeSliceError,
)
from .handlers import WorkloadHandler
from .protocol import (
    MAX_PRIORITY,
    Acquire,
    Cancel,
    Contended,
    DequeueCode,
    Dequeued,
    Granted,
    Phase,
    Refused,
    Released,
    Revoked,
    YieldRequested,
    decode_notice,
    encode,
    subjects,
    validate_id,
)
from .workload import WorkloadChannel, default_node_id

__all__ = ["AsyncTimeSliceClient", "Grant", "ReleaseResult"]

log = logging.getLogger("timeslice.client")

# The clients' constructor options renamed for their units (old -> new; docs/architecture.md, "Names and units"),
# the old names kept for one release.
RENAMED_OPTIONS = {
    "lease_seconds": "lease_s",
    "acquire_timeout": "acquire_timeout_s",
    "request_timeout": "request_timeout_s",
    "waiter_ttl_seconds": "waiter_ttl_s",
    "confirm_seconds": "confirm_s",
    "connect_timeout": "connect_timeout_s",
}


# A grant's minimum hold is counted from its stream time; this much is taken off it for the notice's way here, so the
# client never skips an early suspend for a release the orchestrator no longer keeps the group for.
_KEPT_MARGIN_S = 0.05


class AsyncTimeSliceClient(ReleaseCalls, MultiGroupCalls):
    """One job's handle on one group.

    ``acquire()`` waits (without polling: the grant arrives by subscription) until the orchestrator
    grants the group; while waiting and while holding, a background keeper renews the waiter's place
    and the holder's lease, so a process that dies loses its place or the group within seconds.

    ``nats_url`` (default: ``$TIMESLICE_NATS_URL``, else the URL ``timeslice up`` advertises, else
    ``nats://127.0.0.1:4222``; see ``bus.resolve_nats_url``) is checked here: a malformed one raises
    ``InvalidNatsUrl``. ``connect_timeout_s`` bounds the connection; a server that refuses it fails it at once
    (``BusUnreachable``, saying where the URL came from).

    ``bind_process`` (on by default): the first acquire binds this process to its node's agent (``node_id``:
    ``$TIMESLICE_NODE_ID`` or the host name) when one runs here, so a job without a handler gets its GPU state
    moved by the node's default backend (the driver checkpoint); a registered handler stays the job's.

    ``priority``: this job's class among the group's waiters, 0 (default) to ``MAX_PRIORITY``, higher first, each
    waiter's rising by one per minute waited (``docs/scheduling.md``, "Priorities"; cooperative: any job may ask any).

    Durations are in seconds, named so (``lease_s``, ``acquire_timeout_s``, ...); the options' old names
    (``lease_seconds``, ``acquire_timeout``, ``request_timeout``, ``waiter_ttl_seconds``, ``confirm_seconds``,
    ``connect_timeout``) and the attributes' (``acquire_timeout``, ``request_timeout``, ``connect_timeout``) still
    work for one release, with a ``DeprecationWarning``.
    """

    # the attributes' old names (docs/architecture.md, "Names and units")
    acquire_timeout = RenamedAttribute[float]("acquire_timeout_s")
    request_timeout = RenamedAttribute[float]("request_timeout_s")
    connect_timeout = RenamedAttribute[float]("connect_timeout_s")

    @renamed_keywords(**RENAMED_OPTIONS)
    def __init__(
        self,
        job_id: str,
        group_id: str,
        nats_url: str | None = None,
        lease_s: float = 30.0,
        *,
        acquire_timeout_s: float = 600.0,
        request_timeout_s: float = 5.0,
        waiter_ttl_s: float = 5.0,
        confirm_s: float = 3.0,
        connect_timeout_s: float = 5.0,
        fast_reacquire: bool = True,
        nc: NATS | None = None,
        creds: CredsPath | None = None,
        tls: TlsOption | None = None,
        bind_process: bool = True,
        node_id: str | None = None,
        priority: int = 0,
    ) -> None:
        self.job_id, self.priority = validate_id("job", job_id), priority
        if not 0 <= priority <= MAX_PRIORITY:
            raise InvalidRequest(f"priority must be a class from 0 to {MAX_PRIORITY}, not {priority}")
        self.group_id = validate_id("group", group_id)
        # Checked now (InvalidNatsUrl), and where it came from kept for the error when nobody answers there.
        self._url = resolve_nats_url(nats_url) if nc is None or nats_url else None
        self.nats_url = self._url.text if self._url else default_nats_url()
        if lease_s < 1:
            raise InvalidRequest(f"lease_s must be at least 1, not {lease_s}")
        self.lease_ms = int(lease_s * 1000)
        self.acquire_timeout_s = acquire_timeout_s
        self.request_timeout_s = request_timeout_s
        self.waiter_ttl_ms = int(waiter_ttl_s * 1000)
        self.confirm_ms = int(confirm_s * 1000)
        self.connect_timeout_s = connect_timeout_s
        self.fast_reacquire = fast_reacquire
        self._nc = nc
        self._own_nc = nc is None
        self._identity: dict[str, Any] = {"creds": creds, "tls": tls}  # a .creds file, TLS (None: bus.connect finds)
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None
        self._sub: Any = None
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._waiting: dict[str, float] = {}  # request id -> next renewal (monotonic s)
        self._hold: _Hold | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._connect_lock = asyncio.Lock()
        self._closed = False
        self._notice_subject = subjects.notice(self.group_id, self.job_id)
        self._subjects: dict[str, str] = {}  # message tag -> subject (ids validated once, not per publish)
        self._channels: list[WorkloadChannel] = []
        self._withdrawn: set[str] = set()  # waits already withdrawn (cleared when acquire() returns)
        self._claim: _Claim | None = None
        self._claims: bool | None = fast_reacquire  # and the stream checks a claim exactly (None: ask it once)
        self._published = 0  # job inputs published (a claim is only offered when none came after the release)
        self._read_floor = 0  # the stream sequence status() waits for the record to reflect (_status_calls)
        self._claim_filter = subjects.job_inputs(self.group_id)
        self._contended_epoch = 0  # the latest epoch of this job's at which another job was seen waiting
        self._yield_epoch = 0  # the latest epoch of this job's it was asked to yield at (YieldRequested)
        self._renew_now = False  # the keeper renews every wait and the hold at once (set on reconnect)
        self._scopes = AsyncScopes()  # the open on_accelerators() scopes
        self.node_id = validate_id("node", node_id) if node_id else None  # None: default_node_id() when binding
        self._bind_pending = bind_process  # bind this process at the first acquire (see _bind)
        self._binding: Binding | None = None
        self._groups = JobGroups(self, lambda g: sibling(self, g))  # its other groups' clients (MultiGroupCalls)

    # ------------------------------------------------------------------ lifecycle

    async def connect(self) -> AsyncTimeSliceClient:
        async with self._connect_lock:
            if self._closed:
                raise TimeSliceError("this client is closed; make a new one")
            if self._sub is not None:
                return self
            if self._nc is None:
                self._nc = await connect(
                    self._url,
                    name=f"timeslice-job-{self.job_id}",
                    **self._identity,
                    connect_timeout_s=self.connect_timeout_s,
                    reconnected_cb=self._on_reconnected,
                )
            self._js = self._nc.jetstream(timeout=self.request_timeout_s)
            v = self._nc.connected_server_version
            # The sequence check's -Subject header came with nats-server 2.11; an older server would check the
            # acquire's own subject and refuse every claim (safe, but a wasted round trip each time; docs/nats.md).
            self._claims = None if self.fast_reacquire and (v.major, v.minor) >= (2, 11) else False
            self._sub = await self._nc.subscribe(self._notice_subject, cb=self._on_notice)
            await asyncio.sleep(0)  # else flush() after subscribe() is no barrier (docs/nats.md)
            await self._nc.flush(timeout=max(1, math.ceil(self.request_timeout_s)))
            self._keeper = asyncio.get_running_loop().create_task(keep(self), name=f"timeslice-keeper-{self.job_id}")
            return self

    async def close(self) -> None:
        """Cancel waits, release a held group (best effort), stop the keeper, disconnect. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._groups.close()  # the other groups' clients first: they share this one's connection
        if self._hold is not None and self._hold.alive() and self._nc is not None and self._nc.is_connected:
            with contextlib.suppress(Exception):
                await self._send_release(self._hold)
        for rid in list(self._waiting):
            with contextlib.suppress(Exception):
                await self._publish(Cancel(group=self.group_id, job=self.job_id, request_id=rid, reason="closed"))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(AcquireCancelled(self.group_id, self.job_id, "the client was closed"))
        for ch in self._channels:
            with contextlib.suppress(Exception):
                await ch.close()
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self._nc is not None and self._own_nc:
            with contextlib.suppress(Exception):
                await self._nc.drain()

    async def __aenter__(self) -> AsyncTimeSliceClient:
        return await self.connect()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def holding(self) -> bool:
        return self._hold is not None and self._hold.alive()

    @property
    def contended(self) -> bool:
        """Another job waits for the group this job holds (as the orchestrator has said): a good moment to
        release. False when this job does not hold the group."""
        hold = self._hold
        return hold is not None and hold.alive() and self._contended_epoch == hold.epoch

    @property
    def yield_requested(self) -> bool:
        """This hold ran past the group's quantum while another job waits (``timeslice set-policy``): release at the
        next phase boundary. A request only: the hold stays valid. False when this job does not hold the group."""
        hold = self._hold
        return hold is not None and hold.alive() and self._yield_epoch == hold.epoch

    @property
    def epoch(self) -> int | None:
        return self._hold.epoch if self._hold else None

    # ------------------------------------------------------------------ the lock

    async def acquire(self, timeout: float | None = None) -> Grant:
        """Wait for the group. Raises AcquireTimeout (the wait is withdrawn), JobFaulted, Unavailable, and
        HandlerError when a workload suspended at this job's last release could not be resumed (the group is
        released again then).

        A workload channel that suspended early at the release (``release()``) and was not switched out is
        resumed before this returns; the first acquire binds this process to its node's agent (``bind_process``).
        A copy of the state a channel made after the last release (``precopy``) is dropped at the grant.
        Right after a release that nobody waited for, the acquire is a *claim* (unless ``fast_reacquire`` is
        off): it is published with the stream's sequence check (the group's last job input must still be that
        release), and once the stream has stored it the grant is certain (the orchestrator decides it from the
        stream alone), so it returns at the PubAck, one round trip to the server, without waiting for the
        orchestrator. When another job's request came in between, the stream refuses it and the acquire
        waits for its turn as usual. A job's acquires take turns, in one order (LockOrderError; docs/multi-pool.md)."""
        grant = await self._groups.acquire(self, timeout)
        try:
            for ch in self._channels:
                ch.cancel_precopy()  # the job may change its state from now on: a copy made while idle is stale
                await ch.settle()
            if self._bind_pending and self._nc is not None:  # once; never fails the acquire (_bind.py)
                self._bind_pending = False
                self._binding = await bind_process(
                    self._nc,
                    self.group_id,
                    self.job_id,
                    self.node_id or default_node_id(),
                    timeout=self.request_timeout_s,
                )
        except BaseException:
            hold, self._hold = self._hold, None
            if hold is not None:
                with contextlib.suppress(Exception):
                    await self._send_release(hold)
            raise
        return grant

    async def _acquire(self, timeout: float | None) -> Grant:
        if self._sub is None or self._closed:
            await self.connect()
        for ch in self._channels:
            ch.disarm()  # armed since this job's release (its main thread waits here now)
        timeout = self.acquire_timeout_s if timeout is None else timeout
        claim, self._claim = self._claim, None
        if claim is not None:
            grant = await self._try_claim(claim)
            if grant is not None:
                return grant
        deadline = time.monotonic() + timeout
        while True:  # a wait the orchestrator dropped for want of renewals (a bus outage) is made again
            rid = request_id()
            with contextlib.suppress(_WaitLost):
                g = await self._wait_for_grant(rid, timeout, deadline)
                break
            log.warning(
                "the orchestrator dropped this wait (no renewal reached it in time); waiting again",
                extra={"group": self.group_id, "job": self.job_id},
            )
        now = time.monotonic()
        self._hold = _Hold.granted(g.epoch, rid, lease_ms=self.lease_ms, confirm_ms=self.confirm_ms, now=now)
        if g.min_hold_ms:
            self._hold.kept_until = now + g.min_hold_ms / 1000 - _KEPT_MARGIN_S
        if g.waiters:
            self._contended_epoch = max(self._contended_epoch, g.epoch)
        self._wake.set()
        return Grant(self.group_id, self.job_id, g.epoch, g.waited_ms, g.context_restored)

    async def _wait_for_grant(self, rid: str, timeout: float, deadline: float) -> Granted:
        """Publish one acquire and wait for its grant until ``deadline``. Raises ``_WaitLost`` when the orchestrator
        dropped the wait for want of renewals (the caller asks again), AcquireTimeout at the deadline."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Granted] = loop.create_future()
        self._pending[rid] = fut
        renew_in = self.waiter_ttl_ms / 3000
        # The keeper renews this wait once it is due; an alarm wakes it then, rather than now: waking it at
        # once would put its work in the window where the orchestrator is answering (most grants come first).
        alarm = loop.call_later(renew_in, self._wake.set)
        granted = False
        try:
            if (left := deadline - time.monotonic()) <= 0:
                raise AcquireTimeout(self.group_id, self.job_id, timeout, await self._holder_or_none())
            await self._publish(self._acquire_msg(rid, int(left * 1000), priority=self.priority), msg_id=rid)
            # Renewed only once the stream stored the acquire: a renewal stored before it (the acquire's publish
            # retried through a cluster's election) would find no such wait and end it ("not waiting").
            self._waiting[rid] = time.monotonic() + renew_in
            timed_out = False
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    g = await fut
            except TimeoutError:
                timed_out = True
            except AcquireCancelled as exc:
                # The orchestrator counts the deadline from the request's stream time and may drop the
                # waiter a moment before our own timer fires: that is still a timeout.
                if exc.code is not DequeueCode.TIMEOUT:
                    raise
                timed_out = True
            if timed_out:
                await self._withdraw(rid)
                holder = await self._holder_or_none()
                raise AcquireTimeout(self.group_id, self.job_id, timeout, holder) from None
            granted = True
            return g
        finally:
            alarm.cancel()
            self._pending.pop(rid, None)
            self._waiting.pop(rid, None)
            if not granted:
                await self._withdraw(rid)
            self._withdrawn.discard(rid)

    async def _try_claim(self, claim: _Claim) -> Grant | None:
        """Publish the acquire as a claim; the grant if the stream stored it, None if it was superseded.

        The stream checks the sequence before duplicates (docs/nats.md), so a retry of a claim that was stored
        (its PubAck lost) is refused too; the plain acquire that follows then finds this job holding and gets the same
        epoch back, so that case ends right as well."""
        rid, sent = request_id(), time.monotonic()
        check = {
            "Nats-Expected-Last-Subject-Sequence": str(claim.after_seq),
            "Nats-Expected-Last-Subject-Sequence-Subject": self._claim_filter,
        }
        try:
            await self._publish(self._acquire_msg(rid, 0, claim_epoch=claim.epoch), msg_id=rid, headers=check)
        except _Superseded:
            log.debug(
                "claim of epoch %d superseded: another request for the group came first",
                claim.epoch,
                extra={"group": self.group_id, "job": self.job_id, "epoch": claim.epoch},
            )
            return None
        # A claim is granted at its stream time, after its send: the window counts from the send.
        self._hold = _Hold.granted(claim.epoch, rid, lease_ms=self.lease_ms, confirm_ms=self.confirm_ms, now=sent)
        self._wake.set()
        return Grant(self.group_id, self.job_id, claim.epoch, 0, False)

    def _acquire_msg(self, rid: str, timeout_ms: int, *, priority: int = 0, claim_epoch: int | None = None) -> Acquire:
        """This job's ``Acquire`` of its group, with the client's lease, liveness and confirmation windows."""
        return Acquire(
            group=self.group_id,
            job=self.job_id,
            request_id=rid,
            lease_ms=self.lease_ms,
            timeout_ms=timeout_ms,
            waiter_ttl_ms=self.waiter_ttl_ms,
            confirm_ms=self.confirm_ms,
            priority=priority,
            claim_epoch=claim_epoch,
        )

    async def _withdraw(self, rid: str) -> None:
        """Withdraw a wait (once); if the grant crossed it, the orchestrator releases that grant."""
        if self._closed or rid in self._withdrawn:
            return
        self._withdrawn.add(rid)
        with contextlib.suppress(Exception):
            await asyncio.shield(
                self._publish(Cancel(group=self.group_id, job=self.job_id, request_id=rid, reason="timeout or cancel"))
            )

    async def register_workload(
        self, handler: WorkloadHandler, *, group_id: str | None = None, **options: Unpack[ClientWorkloadOptions]
    ) -> WorkloadChannel:
        """Register this process with its node's agent so a switch moves its state (see ``handlers``); in group
        ``group_id`` (default: the client's own), which may be another of this job's (docs/multi-pool.md).
        ``options``: :class:`~timeslice_client.workload.ClientWorkloadOptions`. The channel is closed
        (unregistered) with the client."""
        check_options(options, CLIENT_WORKLOAD_KEYS, "register_workload")
        c = self if group_id is None or group_id == self.group_id else await self._groups.member(group_id)
        await c.connect()
        assert c._nc is not None
        channel = WorkloadChannel(
            c._nc, self.job_id, c.group_id, handler, request_timeout_s=self.request_timeout_s, **options
        )
        await channel.start()
        c._channels.append(channel)
        return channel

    @overload
    def on_accelerators(self, timeout: float | None = None) -> AsyncHold: ...
    @overload
    def on_accelerators(self, timeout: float | None = None, *, groups: Iterable[str]) -> AsyncMultiHold: ...
    def on_accelerators(self, timeout: float | None = None, *, groups: Iterable[str] | None = None) -> Any:
        """``async with client.on_accelerators():`` or ``@client.on_accelerators()`` on an async function. Scopes
        nest: only the outermost acquires and releases (an inner one keeps the outer hold; see ``_hold_scope``).
        ``groups``: several at once, as ``acquire_all``; it yields the grants by group."""
        return AsyncHold(self, timeout) if groups is None else AsyncMultiHold(self._groups, groups, timeout)

    @contextlib.asynccontextmanager
    async def phase(self, name: str) -> AsyncIterator[None]:
        """Publish phase start/end events around a block (for ``timeslice replay``; with the group's predictive
        restore on, a start made while the job is away is the core's cue for its next ask: docs/scheduling.md)."""
        await self.connect()
        await self._publish_fast(Phase(group=self.group_id, job=self.job_id, name=name, edge="start", epoch=self.epoch))
        error: str | None = None
        try:
            yield
        except BaseException as exc:
            error = f"{exc.__class__.__name__}: {exc}"[:500]
            raise
        finally:
            with contextlib.suppress(Exception):
                await self._publish_fast(
                    Phase(group=self.group_id, job=self.job_id, name=name, edge="end", epoch=self.epoch, error=error)
                )

    # ------------------------------------------------------------------ plumbing

    async def _publish(
        self, msg: msgspec.Struct, msg_id: str | None = None, headers: dict[str, str] | None = None
    ) -> int:
        """Publish into the stream and wait for its PubAck, retrying with the same message id
        (the stream drops duplicates within its window); returns the message's stream sequence.
        Raises ``_Superseded`` when the stream refuses it for a sequence check in ``headers``."""
        assert self._js is not None
        subject = self._subject(msg)
        data = encode(msg)
        if msg_id:
            headers = {**(headers or {}), "Nats-Msg-Id": msg_id}
        self._claim = None  # a job input after the release: the stream would refuse the claim
        self._published += 1
        seq = await publish_stored(
            self._js, subject, data, headers=headers, timeout=self.request_timeout_s, nats_url=self.nats_url
        )
        self._stored_input(msg, seq)
        return seq

    def _subject(self, msg: msgspec.Struct) -> str:
        tag: str = msg.__struct_config__.tag  # type: ignore[assignment]
        subject = self._subjects.get(tag)
        if subject is None:
            subject = self._subjects[tag] = subjects.job(self.group_id, self.job_id, tag)
        return subject

    async def _publish_fast(self, msg: msgspec.Struct) -> None:
        """Publish without waiting for the stream's answer (phase facts: losing one loses no decision)."""
        assert self._nc is not None
        subject = self._subject(msg)
        self._claim = None  # stored after the release like any job input
        self._published += 1
        await self._nc.publish(subject, encode(msg))

    async def _on_notice(self, msg: Msg) -> None:
        try:
            n = decode_notice(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("undecodable notice on %s", msg.subject)
            return
        self._heard(msg)  # before the answer wakes its caller: a status() read after the call waits for its record
        if isinstance(n, Contended | YieldRequested):
            self._contended_epoch = max(self._contended_epoch, n.epoch)
            if isinstance(n, YieldRequested):
                self._yield_epoch = max(self._yield_epoch, n.epoch)
                log.info(
                    "asked to yield group %s at epoch %d: held %d ms, past its quantum, while %d wait",
                    self.group_id,
                    n.epoch,
                    n.held_ms,
                    n.waiters,
                    extra={"group": self.group_id, "job": self.job_id, "epoch": n.epoch},
                )
            return
        if isinstance(n, Revoked):
            if self._hold is not None and self._hold.epoch == n.epoch:
                self._hold.lost = n.reason
                log.warning(
                    "lost group %s at epoch %d: %s",
                    self.group_id,
                    n.epoch,
                    n.reason,
                    extra={"group": self.group_id, "job": self.job_id, "epoch": n.epoch},
                )
            return
        fut = self._pending.get(n.request_id)
        if fut is None or fut.done():
            hold = self._hold
            if isinstance(n, Refused) and hold is not None and n.request_id in hold.renew_ids:
                hold.lost = n.message  # a renewal was refused: the lease is gone
            return  # a duplicate (re-issued after an orchestrator restart) or a late answer
        if isinstance(n, Granted | Released):
            fut.set_result(n)
        elif isinstance(n, Refused):
            fut.set_exception(refusal_error(n, self._hold.epoch if self._hold else None))
        elif isinstance(n, Dequeued) and n.lost:
            fut.set_exception(_WaitLost(n.reason))  # dropped for want of renewals: _acquire asks again
        elif isinstance(n, Dequeued):
            fut.set_exception(AcquireCancelled(self.group_id, self.job_id, n.reason, code=n.code))

    async def _on_reconnected(self) -> None:
        """Back after a cut, during which notices were lost (core NATS): renew every wait and the hold now. A wait
        granted meanwhile is answered with the grant again, a hold revoked meanwhile with a refusal."""
        self._renew_now = True
        self._wake.set()
        await self._groups.reconnected()
