"""The release of ``AsyncTimeSliceClient`` (a base class of it, so that the client's module keeps the acquire): giving
the group back, beginning the workload channels' suspend early when another job was seen waiting, and leaving a
claim for the next acquire when nobody waited."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ._grants import ReleaseResult, _checks_claims, _Claim, _Hold
from ._publish_rules import request_id
from ._status_calls import StatusCalls
from .errors import LeaseExpired, NotHolder, Unavailable
from .protocol import Release, Released
from .workload import WorkloadChannel

__all__ = ["ReleaseCalls"]

# Loop turns a contended release waits for its bytes to be written before its workloads' suspend begins (the send
# queues it, the flusher writes it a turn later); bounded, so a connection that cannot write delays it a little.
_WRITE_TURNS = 4


class ReleaseCalls(StatusCalls):
    """``release()`` and what it needs of the client (declared here and by ``StatusCalls``, whose read of the record
    names the holder in ``NotHolder``; set by ``AsyncTimeSliceClient``)."""

    _hold: _Hold | None
    _pending: dict[str, asyncio.Future[Any]]
    _channels: list[WorkloadChannel]
    _published: int
    _contended_epoch: int
    _claims: bool | None
    _claim: _Claim | None
    _publish: Callable[..., Awaitable[int]]

    async def release(self) -> ReleaseResult:
        """Give the group back. Raises NotHolder, StaleEpoch or LeaseExpired when you no longer hold it.

        When another job was seen waiting (the orchestrator says so: ``Contended``, ``Granted.waiters``), this
        job's workload channels begin their suspend as soon as the release has left for the stream, instead of
        when the agent's command arrives a few bus hops later (``WorkloadChannel.suspend_early``). If the release
        then fails (raises), they stay suspended until this job's next ``acquire()`` resumes them."""
        hold = self._hold
        if hold is None:
            rec = await self._record_or_none()  # the group's holder and epoch now, to say so
            raise NotHolder(
                self.group_id,
                self.job_id,
                holder=rec.holder.job if rec and rec.holder else None,
                epoch=rec.epoch if rec else None,
            )
        self._hold = None
        if not hold.alive():
            assert hold.lost is not None
            raise LeaseExpired(self.group_id, self.job_id, hold.epoch, hold.lost)
        before = self._published
        for ch in self._channels:
            ch.arm()  # the suspend may come while this job's main thread runs Python (see WorkloadChannel.arm)
        # Not when the group stays this job's (a release within its minimum hold keeps it: no switch follows).
        early = self._contended_epoch == hold.epoch and bool(self._channels) and time.monotonic() >= hold.kept_until
        try:
            r, seq = await (self._release_suspending(hold) if early else self._send_release(hold))
        except BaseException:
            for ch in self._channels:
                ch.disarm()
            raise
        if r.pending_waiters == 0 and r.snapshot_deferred:
            for ch in self._channels:
                ch.precopy_idle()  # when a switch is expected, the next one then only frees device memory
        if self._claims is None and r.pending_waiters == 0 and self._js is not None:
            self._claims = await _checks_claims(self._js)  # once: the stream exists now (it stored the release)
        # (Not when the group's predictive restore expects another job next: its switch may come before the claim.)
        if self._claims and r.pending_waiters == 0 and r.ahead is None and self._published == before + 1:
            self._claim = _Claim(after_seq=seq, epoch=r.epoch + 1)  # nothing else was published after it
        return ReleaseResult(self.group_id, self.job_id, r.epoch, r.pending_waiters, r.snapshot_deferred, r.ahead)

    def _settle_budget(self) -> float:
        """The longest ``acquire()`` may spend after the grant, resuming what suspended early (seconds)."""
        return sum(ch.op_timeout_s for ch in self._channels if ch.early_suspend)

    def _suspend_early(self) -> None:
        for ch in self._channels:
            ch.suspend_early()

    async def _release_suspending(self, hold: _Hold) -> tuple[Released, int]:
        """``_send_release``, beginning the workload channels' suspend once the release is written to the
        socket: a round trip before the stream's answer, and after the release's own way out, which the copy
        would otherwise hold up on a machine with few cores (bench/NOTES.md, "Early suspend at the release's
        write")."""
        assert self._nc is not None
        nc, sent = self._nc, self._nc.stats["out_msgs"]
        send = asyncio.ensure_future(self._send_release(hold))
        try:
            for _ in range(_WRITE_TURNS):
                if send.done() or (nc.stats["out_msgs"] > sent and nc.pending_data_size == 0):
                    break
                await asyncio.sleep(0)  # one loop turn: the send queues the release, the connection's flusher writes it
            if not send.done() or (not send.cancelled() and send.exception() is None):
                self._suspend_early()
            return await send
        except BaseException:
            if not send.done():
                send.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await send
            raise

    async def _send_release(self, hold: _Hold) -> tuple[Released, int]:
        """The answer, and the release's stream sequence."""
        rid = request_id()
        fut: asyncio.Future[Released] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            seq = await self._publish(
                Release(group=self.group_id, job=self.job_id, request_id=rid, epoch=hold.epoch), msg_id=rid
            )
            try:
                async with asyncio.timeout(self.request_timeout_s):
                    return await fut, seq
            except TimeoutError:
                raise Unavailable(
                    "release was not answered (is the orchestrator running?)",
                    nats_url=self.nats_url,
                    after_s=self.request_timeout_s,
                ) from None
        finally:
            self._pending.pop(rid, None)
