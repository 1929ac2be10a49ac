"""Restart after a backlog: the orchestrator catches up from its durable consumer's ack floor with a fast
single-subject read, and moves the durable past what it read only once the records reflecting it are stored.

Real nats-server, orchestrators in this event loop. The backlog is published while no orchestrator runs, so
it sits after the ack floor the first orchestrator left, exactly where a killed one leaves its unacked inputs.
"""

from __future__ import annotations

from nats.aio.msg import Msg
from timeslice_client._internal.bus_layout import ensure_bus
from timeslice_client.bus import connect
from timeslice_client.protocol import (
    STREAM,
    Acquire,
    Granted,
    Release,
    Tick,
    decode_notice,
    decode_record,
    encode,
    subjects,
)
from timeslice_orchestrator.invariants import StreamChecker
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig

from .helpers import eventually, running, subscribed
from .workers import read_stream

GROUPS = 40
LONG_MS = 600_000  # leases and waits that cannot expire during the test (no ticks of our own)


def _acquire(group: str, job: str, rid: str) -> Acquire:
    return Acquire(
        group=group,
        job=job,
        request_id=rid,
        lease_ms=LONG_MS,
        timeout_ms=LONG_MS,
        waiter_ttl_ms=LONG_MS,
        confirm_ms=LONG_MS,
    )


async def test_restart_catches_up_the_backlog_then_binds_the_durable_after_it(nats_url: str) -> None:
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_bus(js)
        grants: list[Granted] = []

        async def on_notice(msg: Msg) -> None:
            n = decode_notice(msg.data)
            if isinstance(n, Granted):
                grants.append(n)

        await subscribed(nc, "ts.v1.notice.>", on_notice)

        # A first orchestrator decides one grant and stops cleanly: its ack floor is the stream's end.
        async with running(Orchestrator(OrchestratorConfig(nats_url=nats_url))):
            await js.publish(subjects.job("g0", "j0", "acquire"), encode(_acquire("g0", "j0", "r-g0-j0")))
            await eventually(lambda: any(g.group == "g0" for g in grants), what="g0's first grant")
        floor = (await js.consumer_info(STREAM, "orchestrator")).ack_floor.stream_seq

        # The backlog, published while nobody consumes: per group j0 acquires, j1 waits, j0 releases
        # (j1 takes over at epoch 2), plus a tick; a malformed input; a fact on a subject that is no input.
        for i in range(GROUPS):
            g = f"g{i}"
            if i:
                await js.publish(subjects.job(g, "j0", "acquire"), encode(_acquire(g, "j0", f"r-{g}-j0")))
            await js.publish(subjects.job(g, "j1", "acquire"), encode(_acquire(g, "j1", f"r-{g}-j1")))
            await js.publish(
                subjects.job(g, "j0", "release"), encode(Release(group=g, job="j0", request_id=f"x-{g}", epoch=1))
            )
            await js.publish(subjects.ctl(g, "tick"), encode(Tick(group=g)))
        await js.publish(subjects.job("g1", "j2", "acquire"), b"{not json")
        await js.publish(subjects.agent_op("n1"), b"an agent's operation fact, not an orchestrator input")
        head = (await js.stream_info(STREAM)).state.last_seq
        assert head > floor
        # The release is each group's last event that changes its record (the tick finds nothing due).
        releases = {m[2].split(".")[3]: m[0] for m in await read_stream(nats_url) if m[2].endswith(".release")}

        async with running(Orchestrator(OrchestratorConfig(nats_url=nats_url))) as second:
            # Ready means bound: by then every record reflecting the backlog is stored ...
            kv = await js.key_value("groups")
            assert len(releases) == GROUPS
            for g, seq in releases.items():
                rec = decode_record((await kv.get(g)).value or b"")
                assert rec.last_seq == seq, f"{g}: stored record reflects {rec.last_seq}, backlog ends at {seq}"
                assert rec.holder is not None and (rec.holder.job, rec.holder.epoch) == ("j1", 2)
            # ... and the durable starts right after the backlog it caught up on, with nothing left to ack.
            info = await js.consumer_info(STREAM, "orchestrator")
            assert info.config.opt_start_seq == head + 1
            assert info.config.filter_subjects == list(subjects.inputs)
            assert second.events_rejected == 1  # the malformed input, not the agent's fact
            await eventually(
                lambda: {(g.group, g.job, g.epoch) for g in grants} >= {(f"g{i}", "j1", 2) for i in range(GROUPS)},
                what="every j1 granted at epoch 2",
            )
            info = await js.consumer_info(STREAM, "orchestrator")
            assert info.num_ack_pending == 0 and info.num_pending == 0

        # The whole stream folds through the core without a violation, to the records that are stored.
        checker = StreamChecker()
        checker.feed_all(await read_stream(nats_url))
        assert checker.rejected == 1
        for g, rec in checker.records.items():
            assert decode_record((await kv.get(g)).value or b"") == rec
    finally:
        await nc.close()
