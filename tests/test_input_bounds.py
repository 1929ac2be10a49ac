"""No input can crash-loop the orchestrator or stop other groups: every client-chosen field is bounded when decoded,
a group's record stays far below NATS's payload limit at every limit at once, and a group whose stored record is
garbage, deleted or forged is quarantined or rebuilt while every other group keeps granting."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
import pytest
from nats.aio.client import Client as NATS
from timeslice_client import AsyncTimeSliceClient, GroupFull, GroupQuarantined
from timeslice_client.bus import connect
from timeslice_client.protocol import (
    GROUPS_BUCKET,
    MAX_PHASE_CUES,
    MAX_SHARE,
    MAX_SHARES,
    Acquire,
    Cycle,
    FairPick,
    GroupRecord,
    HolderRecord,
    OpKind,
    OpRecord,
    PhaseCue,
    Prediction,
    SwitchRecord,
    Usage,
    WaiterRecord,
    decode_notice,
    encode,
    subjects,
)
from timeslice_orchestrator.core import LIMITS
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .agent_harness import timeslice
from .helpers import eventually, group_record, running, subscribed

BIG_MS = 2**53
R = TypeVar("R", bound=msgspec.Struct)


def _id(prefix: str, i: int, n: int = 64) -> str:
    return f"{prefix}{i}".ljust(n, "x")[:n]


def _at_limits(cls: type[R], **fields: Any) -> R:
    """A ``cls`` with ``fields``, and every other number it must be given (times, epochs, durations) at ``BIG_MS``:
    as long on the wire as it can be."""
    required = {f.name: BIG_MS for f in msgspec.structs.fields(cls) if f.required and f.type is int}
    return cls(**(required | fields))


def test_a_record_at_every_limit_at_once_stays_far_below_the_payload_limit() -> None:
    """The worst record inputs can build: ``max_queue`` waiters with the longest ids, ``max_placements`` (job, node)
    pairs all saved, loaded and faulted with the longest reasons, ``max_lost_nodes`` lost nodes, a switch with a
    restore beside a snapshot on every node, ``MAX_SHARES`` fair shares and the usage of ``max_usage_jobs`` jobs, the
    cycles of ``max_cycles`` jobs with ``MAX_PHASE_CUES`` phase cues each and a predictive restore's plan."""
    rid = "r" * 128
    waiter = _at_limits(
        WaiterRecord,
        job=_id("j", 0),
        request_id=rid,
        lease_ms=LIMITS.max_lease_ms,
        waiter_ttl_ms=LIMITS.max_ttl_ms,
        confirm_ms=LIMITS.max_ttl_ms,
    )
    pairs = [(_id("j", i % 16), _id("n", i)) for i in range(LIMITS.max_placements)]
    placements: dict[str, tuple[str, ...]] = {}
    for job, node in pairs:
        placements[job] = (*placements.get(job, ()), node)
    ops = tuple(
        OpRecord(op_id="o" * 256, node=node, job=job, kind=OpKind.SNAPSHOT, deadline_ms=BIG_MS) for job, node in pairs
    )
    rec = GroupRecord(
        group=_id("g", 0),
        epoch=BIG_MS,
        holder=_at_limits(HolderRecord, job=_id("h", 0), request_id=rid, waiter_ttl_ms=BIG_MS, waited_ms=BIG_MS),
        active_job=_id("h", 0),
        loaded={node: job for job, node in pairs},
        placements=placements,
        op_timeouts={f"{node}/{job}": BIG_MS for job, node in pairs},
        queue=tuple(msgspec_replace(waiter, job=_id("j", i)) for i in range(LIMITS.max_queue)),
        switch=SwitchRecord(
            to=waiter,
            epoch=BIG_MS,
            phase=OpKind.SNAPSHOT,
            started_at_ms=BIG_MS,
            ops=ops,
            beside=tuple(node for _, node in pairs),
        ),  # (a switch and trailing snapshots never both)
        faulted={_id("f", i): "e" * LIMITS.max_reason for i in range(LIMITS.max_placements)},
        saved={job: nodes for job, nodes in placements.items()},
        lost_nodes=tuple(_id("l", i) for i in range(LIMITS.max_lost_nodes)),
        last_seq=BIG_MS,
        shares={_id("s", i): MAX_SHARE for i in range(MAX_SHARES)},
        usage={_id("u", i): Usage(held_ms=BIG_MS, at_ms=BIG_MS) for i in range(LIMITS.max_usage_jobs)},
        picked=_at_limits(FairPick, job=_id("p", 0), over=_id("o", 0)),
        predict=True,
        cycles={
            _id("c", i): Cycle(
                released_ms=BIG_MS,
                asked=False,
                gap_ms=BIG_MS,
                prev_gap_ms=BIG_MS,
                switch_in_ms=BIG_MS,
                phases={
                    _id("p", k): PhaseCue(started_ms=BIG_MS, asked=False, gap_ms=BIG_MS, prev_gap_ms=BIG_MS)
                    for k in range(MAX_PHASE_CUES)
                },
            )
            for i in range(LIMITS.max_cycles)
        },
        plan=_at_limits(Prediction, job=_id("c", 0), phase=_id("p", 0)),
        restored_ahead=_id("c", 1),
    )
    size = len(encode(rec))
    print(f"\nworst-case record: {size} bytes ({size / 2**20:.2f} MiB)")
    assert size < 768 * 1024, "a record at the limits must stay well below the 1 MiB payload limit"


def msgspec_replace(w: WaiterRecord, **kw: object) -> WaiterRecord:
    return msgspec.structs.replace(w, **kw)


@pytest.fixture
async def orch(nats_url: str) -> AsyncIterator[Orchestrator]:
    async with running(Orchestrator(OrchestratorConfig(nats_url=nats_url))) as o:
        yield o


async def _notices(nc: NATS, group: str) -> list[object]:
    got: list[object] = []

    async def cb(msg: object) -> None:
        got.append(decode_notice(msg.data))  # type: ignore[attr-defined]

    await subscribed(nc, f"ts.v1.notice.{group}.>", cb)
    return got


async def _still_grants(nats_url: str, group: str, job: str = "healthy") -> None:
    async with AsyncTimeSliceClient(job, group, nats_url) as c:
        await c.acquire(timeout=10)
        await c.release()


async def test_oversized_request_ids_are_refused_and_every_group_goes_on(nats_url: str, orch: Orchestrator) -> None:
    """Two acquires with a 600 KB request id used to push the record past 1 MiB: the orchestrator exited after 8
    store attempts, and again on every restart. Now they are refused when decoded."""
    nc = await connect(nats_url)
    js = nc.jetstream()
    try:
        got = await _notices(nc, "big")
        for i in range(2):
            raw = b'{"type":"acquire","group":"big","job":"j%d","request_id":"' % i + b"x" * 600_000 + b'"}'
            await js.publish(subjects.job("big", f"j{i}", "acquire"), raw)
        await eventually(lambda: len(got) >= 2, what="both refused")
        assert all(getattr(n, "code", None) == "INVALID" for n in got), got
        await _still_grants(nats_url, "big")
        await _still_grants(nats_url, "other")
        assert orch._fatal is None
    finally:
        await nc.close()


async def test_a_full_queue_refuses_with_a_typed_error_and_the_record_stays_small(
    nats_url: str, orch: Orchestrator
) -> None:
    """~4,900 waiters used to push the record past the payload limit (the old ``max_queue`` of 10,000 could never
    be reached). Now the queue stops at ``max_queue`` with QUEUE_FULL, which the client raises as ``GroupFull``."""
    nc = await connect(nats_url)
    js = nc.jetstream()
    try:
        async with AsyncTimeSliceClient("holder", "full", nats_url) as holder:
            await holder.acquire(timeout=10)
            long_ms = 600_000
            for i in range(LIMITS.max_queue + 20):
                job = f"w{i}"
                ev = Acquire(
                    group="full",
                    job=job,
                    request_id=os.urandom(16).hex(),
                    timeout_ms=long_ms,
                    waiter_ttl_ms=long_ms,
                    confirm_ms=long_ms,
                )
                await js.publish(subjects.job("full", job, "acquire"), encode(ev))

            async def queue_len() -> int:
                return len((await group_record(holder)).queue)

            await eventually(
                lambda: _at_least(queue_len, LIMITS.max_queue), timeout=60, interval=0.2, what="the queue filled up"
            )
            async with AsyncTimeSliceClient("late", "full", nats_url) as late:
                with pytest.raises(GroupFull) as info:
                    await late.acquire(timeout=10)
                assert info.value.max_waiters == LIMITS.max_queue
            kv = await js.key_value(GROUPS_BUCKET)
            size = len((await kv.get("full")).value or b"")
            print(f"\nrecord with {LIMITS.max_queue} waiters: {size} bytes")
            assert size < 512 * 1024
            assert await queue_len() == LIMITS.max_queue
            await _still_grants(nats_url, "other")
            await holder.release()
        assert orch._fatal is None
    finally:
        await nc.close()


async def _epoch(nats_url: str, group: str) -> int:
    async with AsyncTimeSliceClient("reader", group, nats_url) as c:
        return (await c.status()).epoch


async def _at_least(f: object, n: int) -> bool:
    return await f() >= n  # type: ignore[operator,no-any-return]


async def test_garbage_deleted_and_forged_records_never_stop_the_orchestrator(nats_url: str) -> None:
    """A ``kv del`` of a group's key, garbage written into one, and a forged record claiming stream sequence 10^12
    used to make the orchestrator exit (and exit again on every restart) or freeze the group. Now: the deleted
    record is written again from the orchestrator's copy, the garbage group is quarantined (its clients get
    ``GroupQuarantined``) and the others go on, and a record from beyond the stream's end is caught up."""
    nc = await connect(nats_url)
    js = nc.jetstream()
    try:
        async with running(Orchestrator(OrchestratorConfig(nats_url=nats_url))) as orch:
            for g in ("deleted", "garbage", "forged", "other"):
                await _still_grants(nats_url, g)
            kv = await js.key_value(GROUPS_BUCKET)
            epoch_before = await _epoch(nats_url, "deleted")
            await kv.delete("deleted")
            await _still_grants(nats_url, "deleted")  # its record was deleted under the running orchestrator
            await kv.put("garbage", b"\x00not a record")
            await _still_grants(nats_url, "other")
            assert orch._fatal is None
        stored = (await kv.get("deleted")).value
        assert stored, "the deleted record was written again"
        # Restart with garbage and a forged record in the bucket.
        forged = GroupRecord(group="forged", epoch=100, last_seq=10**12)
        await kv.put("forged", encode(forged))
        async with running(Orchestrator(OrchestratorConfig(nats_url=nats_url))) as orch:
            assert orch._groups["garbage"].quarantined is not None
            async with AsyncTimeSliceClient("q", "garbage", nats_url) as q:
                with pytest.raises(GroupQuarantined):
                    await q.acquire(timeout=10)
            async with AsyncTimeSliceClient("f", "forged", nats_url) as f:
                g = await f.acquire(timeout=10)  # not frozen: the record's last_seq is beyond the stream's end
                assert g.epoch == 101
                await f.release()
            await _still_grants(nats_url, "other")
            await _still_grants(nats_url, "deleted")
            assert await _epoch(nats_url, "deleted") > epoch_before
            assert orch._fatal is None
            assert orch.metrics.quarantined == 1
            rc, out = await timeslice(nats_url, "status")
            assert rc == 0 and "QUARANTINED garbage:" in out and "UNREADABLE record garbage" in out, out
    finally:
        await nc.close()
