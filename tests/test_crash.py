"""Crash safety (the orchestrator can be killed at any instant and restarted without double grants, lost waiters or
lost yields): the orchestrator process is SIGKILLed at random instants, again and again, while job processes hand
a group around, and restarted each time.

Clients keep waiting while it is down (their requests are durable in the stream); the new orchestrator
resumes at its consumer's ack floor and re-issues undelivered decisions with the same epochs. Afterwards:
every job finished every round (no lost waiter, no lost release, no error), the holds the jobs logged
never overlap, epochs rise one by one with no gap and no repeat, the whole stream folds through the pure
core without an invariant violation, every grant the fold decided was published, and the stored record
is the fold of the stream. Beside it, two jobs share a second group with pauses between their rounds, so
most of their re-acquires are claims (granted by the stream alone, whether the orchestrator is up or not):
their holds never overlap either, and the fold grants every claim as claimed.

The run is reproducible in its kill schedule: set ``TIMESLICE_CRASH_SEED`` to replay one.

A second test keeps the orchestrator down longer than a grant's confirmation window while the holder
releases: the waiter, renewing its wait all along, must get a grant it can use (the core keeps an
unconfirmed grant alive on the waiter's renewals).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import pytest
from timeslice_client import GroupState, TimeSliceClient
from timeslice_client.protocol import subjects

from .conftest import OrchestratorProcess
from .helpers import eventually_sync, group_record_sync, strike_point
from .workers import Worker, check_exclusive_holds, fold_checked, holds, looping_worker, read_stream

JOBS = {"c1": "sync", "c2": "async", "c3": "sync", "c4": "async"}
ROUNDS = 90  # per job: 360 handoffs, plus the slow job's
SLOW_ROUNDS = 4
# A second group where two jobs pause between rounds, for about as long as the kills go on: many releases find
# nobody waiting, so the next acquire is a claim (granted by the stream alone), and some claims lose the race to
# the other job's request.
PAIR = {"p1": ("sync", 30.0, 250), "p2": ("async", 120.0, 60)}  # job: (client, pause after a release (ms), rounds)
KILLS = 10
START = 30.0


@pytest.mark.slow
def test_orchestrator_sigkilled_repeatedly_during_handoffs(
    tmp_path: Path, nats_url: str, orchestrator_process: OrchestratorProcess
) -> None:
    seed = int(os.environ.get("TIMESLICE_CRASH_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    group = "crash"
    total = ROUNDS * len(JOBS) + SLOW_ROUNDS
    workers = [
        looping_worker(tmp_path, nats_url, group, job, client=kind, rounds=ROUNDS, hold_ms=rng.choice([0, 1, 3]))
        for job, kind in JOBS.items()
    ]
    # One job holds long enough to renew its lease (and confirm its grants) across restarts.
    slow = looping_worker(
        tmp_path,
        nats_url,
        group,
        "slow",
        client="async",
        rounds=SLOW_ROUNDS,
        hold_ms=1500,
        gap_ms=1000,
        lease_seconds=3,
    )
    workers.append(slow)
    pair = [
        looping_worker(tmp_path, nats_url, "crash-pair", job, client=kind, rounds=rounds, hold_ms=1, gap_ms=gap)
        for job, (kind, gap, rounds) in PAIR.items()
    ]
    pair_total = sum(rounds for _, _, rounds in PAIR.values())
    orch = orchestrator_process
    kills: list[tuple[str, int, float]] = []  # (where, grants logged at the kill, seconds down)

    def progress() -> int:
        return sum(len(w.events("granted")) for w in workers)

    def slow_holding() -> bool:
        last = slow.events()[-1:]
        return bool(last) and last[0]["ev"] == "granted" and time.time() - last[0]["t"] > 0.8

    def finished() -> bool:
        return all(w.proc.poll() is not None for w in workers)

    def context() -> str:
        return f"seed={seed} kills={kills} " + " | ".join(w.describe() for w in workers + pair)

    try:
        eventually_sync(lambda: all(w.last("ready") for w in workers + pair), timeout=START, what="workers connected")
        for w in workers + pair:
            w.usr1()
        # The first kill lands while the slow job holds (its lease renewals cross the restart; nobody else
        # moves meanwhile), then one at a random grant count in each of KILLS - 1 equal slices of the run.
        lo, hi = 3, total - total // 10
        width = (hi - lo) // (KILLS - 1)
        schedule = [lo + i * width + rng.randrange(width) for i in range(KILLS - 1)]
        for i, target in enumerate([0, *schedule]):
            if i == 0:
                ready, what = slow_holding, f"the slow job holds ({context()})"
            else:
                ready, what = (lambda t=target: progress() >= t), f"handoffs go on ({context()})"
            if not strike_point(ready, finished, rng, what):
                break
            at = progress()
            t0 = time.monotonic()
            orch.kill()
            orch.start()
            where = "running"
            if rng.random() < 0.3:
                # Also die while starting up: loading records, re-creating the consumer, catching up.
                time.sleep(rng.uniform(0.0, 0.6))  # a random instant to kill at, not a wait for anything
                orch.kill()
                orch.start()
                where = "running+startup"
            orch.wait_ready()
            kills.append((where, at, round(time.monotonic() - t0, 2)))

        for w in workers + pair:
            try:
                rc = w.wait(60)
            except Exception as exc:
                raise AssertionError(f"a job did not finish: {context()}") from exc
            assert rc == 0, context()
            assert not w.errors(), context()
            assert w.last("done") is not None, context()
        assert len(kills) == KILLS, f"too few kills landed during the handoffs: {context()}"
        assert orch.proc is not None and orch.proc.poll() is None, "the orchestrator died on its own"

        # The jobs' own view: every round was granted once, holds never overlapped, epochs 1..total.
        hs = holds(workers)
        assert len(hs) == total, context()
        check_exclusive_holds(hs)
        assert [h.epoch for h in hs] == list(range(1, total + 1)), context()
        pair_holds = holds(pair)
        check_exclusive_holds(pair_holds)
        assert [h.epoch for h in pair_holds] == list(range(1, pair_total + 1)), context()
        for w in workers + pair:
            epochs = [e["epoch"] for e in w.events("granted")]
            assert epochs == sorted(set(epochs)), f"{w.job}: epochs went backwards or repeated: {epochs}"

        # The stream's view, folded through the pure core.
        with TimeSliceClient("observer", "observer", nats_url) as obs:
            rec = eventually_sync(
                lambda: (r := group_record_sync(obs, group)).holder is None and not r.queue and r.switch is None and r,
                timeout=20,
                what="group idle",
            )
            assert rec.state == GroupState.IDLE_YIELDED
            stream = asyncio.run(read_stream(nats_url))
            checker = fold_checked(stream, context)
            st = checker.stats[group]
            assert st.grants == st.fold_grants == st.max_epoch == total
            assert st.grants_by_job == {**dict.fromkeys(JOBS, ROUNDS), "slow": SLOW_ROUNDS}
            assert st.revocations == 0, "a lease or confirmation window ran out during a restart"
            assert st.releases >= total  # re-issued Released notices count as well
            eventually_sync(
                lambda: group_record_sync(obs, group) == checker.records[group],
                timeout=20,
                what="the stored record is the fold of the stream",
            )
            ps = checker.stats["crash-pair"]
            assert ps.grants == ps.fold_grants == pair_total and ps.revocations == 0
            assert ps.claims > 0, "no release of the pair found the group free: no claim was tested"
        print(
            f"crash test: seed={seed} handoffs={total} kills={kills} stream={len(stream)} msgs "
            f"re-issued grants={st.repeated_grants}; pair: {ps.grants} grants, {ps.claims} of them claims"
        )
    finally:
        for w in workers:
            w.close()


@pytest.mark.slow
def test_release_during_a_long_outage_hands_over_cleanly(
    tmp_path: Path, nats_url: str, orchestrator_process: OrchestratorProcess
) -> None:
    """The orchestrator is down longer than a grant's confirmation window (3 s) while the holder releases.
    The waiter, alive and renewing its wait all along, must get a grant it can use and release."""
    group = "outage"
    orch = orchestrator_process
    holder = Worker(tmp_path, nats_url, group, "holder", mode="hold", request_timeout=60)
    waiter: Worker | None = None
    try:
        eventually_sync(lambda: holder.last("granted"), timeout=START, what="holder granted")
        waiter = Worker(tmp_path, nats_url, group, "waiter", mode="wait", acquire_timeout=60, request_timeout=60)
        with TimeSliceClient("observer", "observer", nats_url) as obs:
            eventually_sync(
                lambda: [w.job for w in group_record_sync(obs, group).queue] == ["waiter"],
                timeout=START,
                what="waiter queued",
            )
        orch.kill()
        holder.usr1()  # releases into the stream while nobody applies it
        release_subject = subjects.job(group, "holder", "release")
        renew_subject = subjects.job(group, "waiter", "renew")

        def outage_outlived_confirm_window() -> bool:
            stream = asyncio.run(read_stream(nats_url))
            released = [ms for _, ms, subj, _ in stream if subj == release_subject]
            return bool(released) and any(
                subj == renew_subject and ms > released[0] + 3000 for _, ms, subj, _ in stream
            )

        eventually_sync(
            outage_outlived_confirm_window,
            timeout=20,
            interval=0.2,
            what="the waiter renewed its wait past the confirmation window",
        )
        orch.start()
        orch.wait_ready()
        for w in (holder, waiter):
            assert w.wait(30) == 0, w.describe()
        assert waiter.last("released") is not None, waiter.describe()
        assert not waiter.errors(), waiter.describe()
    finally:
        holder.close()
        if waiter is not None:
            waiter.close()
