"""The lock across real processes: job processes (tests/workers/job_worker.py) against the orchestrator
process, each job its own interpreter, killed with SIGKILL where a test says so.

What each test checks:

* several job processes handing one group around: from their logs, holds never overlap and epochs
  strictly rise (1, 2, 3, ... with nothing lost); from the stream, the invariant checker agrees and
  the orchestrator's stored record is the fold of the stream;
* a holder killed while holding loses the group within its lease (+1 s) and the waiter gets it;
* waiters that give up never get the group: one whose acquire timed out, one killed while waiting
  (dropped within its waiter TTL), and one killed just before its turn (granted, but the grant is
  revoked at the end of the confirmation window and the next waiter gets the group);
* the blocking facade reports an acquire timeout as AcquireTimeout.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from timeslice_client import GroupRecord, GroupState, TimeSliceClient
from timeslice_client.protocol import Dequeued, Granted, Released, Revoked, subjects
from timeslice_orchestrator.invariants import StreamChecker

from .helpers import all_closed, eventually_sync, group_record_sync
from .workers import Worker, check_exclusive_holds, holds, notices, read_stream

pytestmark = pytest.mark.usefixtures("orchestrator_process")

START = 30.0  # seconds a fresh interpreter may take to connect on a loaded 2-core machine

Spawn = Callable[..., Worker]


@pytest.fixture
def spawn(tmp_path: Path, nats_url: str) -> Iterator[Spawn]:
    with all_closed(functools.partial(Worker, tmp_path, nats_url)) as made:
        yield made


@pytest.fixture
def observer(nats_url: str) -> Iterator[TimeSliceClient]:
    """A client that only reads group records."""
    with TimeSliceClient("observer", "observer", nats_url) as c:
        yield c


def checked_stream(nats_url: str, group: str) -> tuple[StreamChecker, list[tuple[int, int, str, bytes]]]:
    """Read the whole stream and fold it through the invariant checker (raises on a violation)."""
    stream = asyncio.run(read_stream(nats_url))
    checker = StreamChecker()
    checker.feed_all(stream)
    assert checker.unpublished_grants() == [], "the fold decided grants the orchestrator never published"
    assert group in checker.stats
    return checker, stream


def queue_of(obs: TimeSliceClient, group: str) -> list[str]:
    return [w.job for w in group_record_sync(obs, group).queue]


def settled(obs: TimeSliceClient, group: str) -> GroupRecord | None:
    rec = group_record_sync(obs, group)
    return rec if rec.holder is None and not rec.queue and rec.switch is None else None


# --------------------------------------------------------------------------- handoffs between processes


@pytest.mark.slow
def test_job_processes_hand_the_group_around(spawn: Spawn, observer: TimeSliceClient, nats_url: str) -> None:
    group, rounds = "procs", 30
    jobs = {"p1": "sync", "p2": "async", "p3": "async"}
    workers = [
        spawn(group, job, mode="loop", rounds=rounds, hold_ms=2, client=kind, wait_start=True)
        for job, kind in jobs.items()
    ]
    eventually_sync(lambda: all(w.last("ready") for w in workers), timeout=START, what="workers connected")
    for w in workers:
        w.usr1()
    for w in workers:
        assert w.wait(60) == 0, w.describe()
        assert not w.errors(), w.describe()
        assert w.last("done") is not None

    hs = holds(workers)
    total = rounds * len(jobs)
    assert len(hs) == total
    check_exclusive_holds(hs)
    assert [h.epoch for h in hs] == list(range(1, total + 1)), "every grant reached its job, none was lost"
    switches = sum(1 for a, b in itertools.pairwise(hs) if a.job != b.job)
    assert switches >= total // 2, f"the jobs hardly took turns ({switches} switches in {total} holds)"

    eventually_sync(lambda: settled(observer, group), timeout=10, what="group idle")
    checker, _ = checked_stream(nats_url, group)
    st = checker.stats[group]
    assert st.grants == st.fold_grants == total
    assert st.grants_by_job == dict.fromkeys(jobs, rounds)
    assert (st.releases, st.revocations, st.max_epoch) == (total, 0, total)
    # The stored record is exactly the fold of the stream (once the orchestrator stored its last decision).
    eventually_sync(
        lambda: group_record_sync(observer, group) == checker.records[group],
        timeout=10,
        what="stored record equals the fold of the stream",
    )
    assert checker.records[group].state == GroupState.IDLE_YIELDED


# --------------------------------------------------------------------------- a holder that dies


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after-confirm", "right-after-grant"])
def test_killed_holder_loses_the_group_within_its_lease(
    spawn: Spawn, observer: TimeSliceClient, nats_url: str, when: str
) -> None:
    """A holder SIGKILLed while holding: the waiter gets the group within lease + 1 s of the kill.

    The holder's first deadline is ``min(confirm, lease)`` after the grant (2 s here: the client's
    confirmation window of 3 s is capped by the lease), every renewal (each lease/3) moves it to
    ``lease`` after the renewal, so the group is free at most ``lease`` after the kill, plus a tick.
    """
    group, lease = f"dead-holder-{when}", 2.0
    # The waiter connects first and acquires on SIGUSR1, so the holder can be killed right after its grant.
    waiter = spawn(group, "waiter", mode="wait", acquire_timeout=60, wait_start=True)
    eventually_sync(lambda: waiter.last("ready"), timeout=START, what="waiter connected")
    holder = spawn(
        group, "holder", mode="hold", lease_seconds=lease, client="sync" if when == "after-confirm" else "async"
    )
    grant = eventually_sync(lambda: holder.last("granted"), timeout=START, what="holder granted")
    waiter.usr1()
    if when == "after-confirm":
        eventually_sync(lambda: queue_of(observer, group) == ["waiter"], timeout=10, what="waiter queued")
        eventually_sync(
            lambda: (h := group_record_sync(observer, group).holder) is not None and h.confirmed,
            timeout=10,
            what="holder confirmed by a renewal",
        )
    t_kill = time.time()
    holder.kill()

    got = eventually_sync(lambda: waiter.last("granted"), timeout=lease + 10, what="waiter granted")
    delay = got["t"] - t_kill
    assert delay <= lease + 1.0, f"the group stayed with a dead holder for {delay:.2f} s (lease {lease} s)"
    assert got["epoch"] == grant["epoch"] + 1
    assert waiter.wait(30) == 0, waiter.describe()
    assert waiter.last("released") is not None

    eventually_sync(lambda: settled(observer, group), timeout=10, what="group idle")
    checker, stream = checked_stream(nats_url, group)
    assert checker.stats[group].revocations == 1
    revoked = [(seq, ms, n) for seq, ms, n in notices(stream, group, "holder") if isinstance(n, Revoked)]
    assert len(revoked) == 1 and revoked[0][2].epoch == grant["epoch"]
    seq_r, ms_r, rev = revoked[0]
    # When did the holder last show life (its grant, or a renewal of this epoch), in stream time?
    # (Stream times of input events are the core's "now"; a notice is stored a little after its event.)
    renew_subject = subjects.job(group, "holder", "renew")
    renewals = [ms for seq, ms, subj, data in stream if subj == renew_subject and seq < seq_r]
    seq_g, granted = next((seq, n) for seq, ms, n in notices(stream, group, "holder") if isinstance(n, Granted))
    acquire_subject = subjects.job(group, "holder", "acquire")
    acquired_ms = [ms for seq, ms, subj, data in stream if subj == acquire_subject and seq < seq_g][-1]
    # The first deadline is the confirmation window (3 s, the client's default) capped by the lease.
    assert granted.lease_deadline_ms - acquired_ms == min(3.0, lease) * 1000
    if renewals:
        assert rev.reason == "lease expired"
        assert ms_r - renewals[-1] >= lease * 1000, "revoked before the lease ran out"
    else:
        assert rev.reason == "grant not confirmed in time"
        assert ms_r >= granted.lease_deadline_ms, "revoked before the confirmation window ran out"
    if when == "after-confirm":
        assert renewals


# --------------------------------------------------------------------------- waiters that give up


@pytest.mark.slow
@pytest.mark.parametrize("behind", [True, False], ids=["waiter-behind", "nobody-behind"])
def test_timed_out_waiter_is_never_granted(
    spawn: Spawn, observer: TimeSliceClient, nats_url: str, behind: bool
) -> None:
    """A waiter whose acquire timed out leaves the queue; the group goes to the next live waiter, or idles."""
    group = f"timeout-{'behind' if behind else 'alone'}"
    holder = spawn(group, "holder", mode="hold")
    grant = eventually_sync(lambda: holder.last("granted"), timeout=START, what="holder granted")
    quitter = spawn(group, "quitter", mode="wait", acquire_timeout=4)
    eventually_sync(lambda: queue_of(observer, group) == ["quitter"], timeout=START, what="quitter queued")
    if behind:
        patient = spawn(group, "patient", mode="wait", acquire_timeout=60)
        eventually_sync(
            lambda: queue_of(observer, group) == ["quitter", "patient"],
            timeout=START,
            what="patient queued behind the quitter",
        )
    err = eventually_sync(lambda: quitter.last("error"), timeout=15, what="quitter timed out")
    # The orchestrator enforces the same deadline (from the Acquire's stream time); whichever side notices
    # first, the caller sees AcquireTimeout.
    timed_out = err["type"] == "AcquireTimeout"
    assert timed_out, quitter.describe()
    assert quitter.wait(15) == 0
    eventually_sync(
        lambda: queue_of(observer, group) == (["patient"] if behind else []), timeout=10, what="quitter left the queue"
    )

    holder.usr1()  # release
    assert holder.wait(30) == 0, holder.describe()
    if behind:
        got = eventually_sync(lambda: patient.last("released"), timeout=15, what="patient granted and done")
        assert got["epoch"] == grant["epoch"] + 1
        assert patient.wait(15) == 0
    rec = eventually_sync(lambda: settled(observer, group), timeout=10, what="group idle")
    assert rec.state == GroupState.IDLE_YIELDED
    assert rec.active_job == ("patient" if behind else "holder")
    assert rec.epoch == grant["epoch"] + (1 if behind else 0)

    checker, stream = checked_stream(nats_url, group)
    got_quitter = notices(stream, group, "quitter")
    assert not [n for _, _, n in got_quitter if isinstance(n, Granted)], f"a quitter was granted: {got_quitter}"
    assert [n for _, _, n in got_quitter if isinstance(n, Dequeued)], "the quitter was never dequeued"
    assert checker.stats[group].grants_by_job == ({"holder": 1, "patient": 1} if behind else {"holder": 1})


def test_sync_client_reports_an_acquire_timeout_as_such(spawn: Spawn, observer: TimeSliceClient) -> None:
    group = "sync-timeout"
    holder = spawn(group, "holder", mode="hold")
    eventually_sync(lambda: holder.last("granted"), timeout=START, what="holder granted")
    quitter = spawn(group, "quitter", mode="wait", acquire_timeout=0.5, client="sync")
    err = eventually_sync(lambda: quitter.last("error"), timeout=START, what="quitter gave up")
    # Whatever it is called, the wait was withdrawn on the bus.
    eventually_sync(lambda: queue_of(observer, group) == [], timeout=10, what="quitter left the queue")
    assert err["type"] == "AcquireTimeout", err


@pytest.mark.slow
def test_killed_waiter_is_dropped_and_never_granted(spawn: Spawn, observer: TimeSliceClient, nats_url: str) -> None:
    """A waiter SIGKILLed while waiting stops renewing its place and is dropped within its waiter TTL."""
    group, ttl = "dead-waiter", 1.0
    holder = spawn(group, "holder", mode="hold")
    grant = eventually_sync(lambda: holder.last("granted"), timeout=START, what="holder granted")
    doomed = spawn(group, "doomed", mode="wait", acquire_timeout=60, waiter_ttl=ttl)
    eventually_sync(lambda: queue_of(observer, group) == ["doomed"], timeout=START, what="doomed queued")
    patient = spawn(group, "patient", mode="wait", acquire_timeout=60)
    eventually_sync(
        lambda: queue_of(observer, group) == ["doomed", "patient"], timeout=START, what="patient queued behind"
    )
    t_kill = time.time()
    doomed.kill()
    eventually_sync(lambda: queue_of(observer, group) == ["patient"], timeout=ttl + 5, what="dead waiter dropped")
    dropped_after = time.time() - t_kill
    assert dropped_after <= ttl + 1.5, f"a dead waiter kept its place {dropped_after:.2f} s (ttl {ttl} s)"

    holder.usr1()
    got = eventually_sync(lambda: patient.last("released"), timeout=15, what="patient granted and done")
    assert got["epoch"] == grant["epoch"] + 1
    for w in (holder, patient):
        assert w.wait(15) == 0, w.describe()
    eventually_sync(lambda: settled(observer, group), timeout=10, what="group idle")

    checker, stream = checked_stream(nats_url, group)
    got_doomed = notices(stream, group, "doomed")
    assert not [n for _, _, n in got_doomed if isinstance(n, Granted)], f"a dead waiter was granted: {got_doomed}"
    drops = [(ms, n) for _, ms, n in got_doomed if isinstance(n, Dequeued)]
    assert len(drops) == 1 and drops[0][1].reason == "waiter lost (no renewal)", got_doomed
    assert drops[0][0] / 1000 - t_kill <= ttl + 1.0
    assert checker.stats[group].grants_by_job == {"holder": 1, "patient": 1}


@pytest.mark.slow
def test_waiter_killed_just_before_its_turn_loses_the_grant(
    spawn: Spawn, observer: TimeSliceClient, nats_url: str
) -> None:
    """A waiter that dies while still in the queue can be granted (its place had not expired yet), but
    it never confirms the grant: the grant is revoked after the waiter's confirmation window and the
    next waiter gets the group. No grant stays with nobody."""
    group, confirm = "dead-at-turn", 1.0
    holder = spawn(group, "holder", mode="hold")
    grant = eventually_sync(lambda: holder.last("granted"), timeout=START, what="holder granted")
    doomed = spawn(group, "doomed", mode="wait", acquire_timeout=60, confirm=confirm, waiter_ttl=10)
    eventually_sync(lambda: queue_of(observer, group) == ["doomed"], timeout=START, what="doomed queued")
    patient = spawn(group, "patient", mode="wait", acquire_timeout=60)
    eventually_sync(
        lambda: queue_of(observer, group) == ["doomed", "patient"], timeout=START, what="patient queued behind"
    )
    doomed.kill()
    t_release = time.time()
    holder.usr1()  # its place lives up to 10 s more: the dead waiter is next
    got = eventually_sync(lambda: patient.last("granted"), timeout=confirm + 10, what="patient granted")
    delay = got["t"] - t_release
    assert delay <= confirm + 1.0, f"a grant to a dead waiter blocked the group for {delay:.2f} s"
    assert got["epoch"] == grant["epoch"] + 2
    for w in (holder, patient):
        assert w.wait(15) == 0, w.describe()
    eventually_sync(lambda: settled(observer, group), timeout=10, what="group idle")

    checker, stream = checked_stream(nats_url, group)
    got_doomed = [n for _, _, n in notices(stream, group, "doomed")]
    granted = [n for n in got_doomed if isinstance(n, Granted)]
    ended = [n for n in got_doomed if isinstance(n, Revoked | Released)]
    assert [g.epoch for g in granted] == [grant["epoch"] + 1], got_doomed
    assert len(ended) == 1 and isinstance(ended[0], Revoked), got_doomed
    assert ended[0].reason == "grant not confirmed in time"
    assert checker.stats[group].grants_by_job == {"holder": 1, "doomed": 1, "patient": 1}
