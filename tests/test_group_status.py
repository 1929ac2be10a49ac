"""``status()``'s public view of a group (``GroupStatus``) made from the orchestrator's stored record: every field a
user reads, under its documented name, and none of the record's bookkeeping."""

from __future__ import annotations

import msgspec
from timeslice_client import GroupState, GroupStatus, HolderStatus, WaiterStatus
from timeslice_client._group_status import group_status
from timeslice_client.protocol import GroupRecord, HolderRecord, OpKind, SwitchRecord, WaiterRecord


def _waiter(job: str, *, priority: int = 0, at: int = 2_000) -> WaiterRecord:
    return WaiterRecord(
        job=job,
        request_id=f"rid-{job}",
        enqueued_at_ms=at,
        deadline_ms=at + 60_000,
        alive_until_ms=at + 5_000,
        lease_ms=30_000,
        waiter_ttl_ms=5_000,
        confirm_ms=3_000,
        priority=priority,
    )


def test_a_fresh_group_reads_as_idle_at_epoch_zero() -> None:
    st = group_status(GroupRecord(group="g"))
    assert st == GroupStatus(
        group="g",
        epoch=0,
        state=GroupState.IDLE,
        state_since_ms=0,
        holder=None,
        active_job=None,
        switching_to=None,
        waiters=(),
        faulted_jobs={},
        lost_nodes=(),
        quantum_ms=0,
    )


def test_a_held_group_shows_its_holder_waiters_and_faults_under_the_public_names() -> None:
    granted_at, lease = 1_000, 30_000
    holder = HolderRecord(
        job="a",
        request_id="rid-a",
        epoch=7,
        granted_at_ms=granted_at,
        lease_ms=lease,
        lease_deadline_ms=granted_at + lease,
        confirmed=True,
        restored=True,
    )
    rec = GroupRecord(
        group="g",
        epoch=7,
        state=GroupState.LOCKED,
        since_ms=granted_at,
        holder=holder,
        active_job="a",
        queue=(_waiter("b"), _waiter("c", priority=3, at=2_500)),
        faulted={"d": "snapshot failed"},
        lost_nodes=("n2",),
        quantum_ms=120_000,
        placements={"a": ("n1",)},
    )
    st = group_status(rec)
    assert st.holder == HolderStatus(
        job="a",
        epoch=7,
        granted_at_ms=1_000,
        lease_ms=30_000,
        lease_expires_at_ms=31_000,
        confirmed=True,
        context_restored=True,
    )
    assert st.waiters == (
        WaiterStatus(job="b", priority=0, enqueued_at_ms=2_000, gives_up_at_ms=62_000),
        WaiterStatus(job="c", priority=3, enqueued_at_ms=2_500, gives_up_at_ms=62_500),
    )
    assert (st.group, st.epoch, st.state, st.state_since_ms, st.active_job) == ("g", 7, GroupState.LOCKED, 1_000, "a")
    assert (st.faulted_jobs, st.lost_nodes, st.quantum_ms, st.switching_to) == (
        {"d": "snapshot failed"},
        ("n2",),
        120_000,
        None,
    )
    shown = set(msgspec.structs.asdict(st)) | set(msgspec.structs.asdict(st.waiters[0]))
    assert not shown & {"request_id", "placements", "queue", "switch", "trailing", "last_seq"}, shown


def test_a_switching_group_names_the_job_it_hands_to() -> None:
    switch = SwitchRecord(to=_waiter("b"), epoch=8, phase=OpKind.SNAPSHOT, started_at_ms=5_000)
    rec = GroupRecord(group="g", epoch=8, state=GroupState.SWITCHING, active_job="a", switch=switch)
    assert group_status(rec).switching_to == "b"
    assert (
        group_status(msgspec.structs.replace(rec, switch=msgspec.structs.replace(switch, to=None))).switching_to is None
    )
