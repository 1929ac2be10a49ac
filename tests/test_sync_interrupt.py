"""Ctrl-C during a blocking ``TimeSliceClient.acquire()`` withdraws the wait before ``KeyboardInterrupt`` reaches
the job: a real job process (tests/workers/interrupted_waiter.py) waits behind a holder and gets SIGINT.

Its waiter TTL is 60 s, so a wait that was not withdrawn would stay queued (and be granted at the holder's release,
to a dead process) for a minute: right after the process has exited the queue must be empty, and the holder's
release must find nobody waiting.

The ``exit`` case (the process ends at once after the interrupt) is the one a facade that raised at once, leaving the
withdrawal to its loop thread, loses; the ``uncaught`` case gives that thread the interpreter's shutdown to do it in.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeslice_client import TimeSliceClient

from .helpers import eventually_sync, group_record_sync

pytestmark = pytest.mark.usefixtures("orchestrator_process")

ROOT = Path(__file__).resolve().parents[1]
START = 30.0  # seconds a fresh interpreter may take to connect on a loaded 2-core machine
GONE_S = 1.0  # how soon after the process's exit its withdrawal must show in the record (TTL: 60 s)


@pytest.fixture
def holder(nats_url: str) -> Iterator[TimeSliceClient]:
    with TimeSliceClient("holder", "interrupted", nats_url) as c:
        c.acquire(timeout=10)
        yield c


@pytest.mark.parametrize("how", ["exit", "uncaught"])
def test_ctrl_c_withdraws_the_wait_before_the_process_exits(
    holder: TimeSliceClient, nats_url: str, tmp_path: Path, how: str
) -> None:
    log = tmp_path / "waiter.log"
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.workers.interrupted_waiter", nats_url, "interrupted", "doomed", str(log), how],
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        eventually_sync(
            lambda: [w.job for w in group_record_sync(holder).queue] == ["doomed"],
            timeout=START,
            what="the child waits behind the holder",
        )
        child.send_signal(signal.SIGINT)
        code = child.wait(15)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
    # 130: os._exit in the KeyboardInterrupt handler; -SIGINT: the interpreter ended by the uncaught interrupt
    assert code == (130 if how == "exit" else -signal.SIGINT), f"exit status {code}"
    lines = ["ready"] if how == "exit" else ["ready", "interrupted"]
    assert log.read_text().splitlines() == lines, "the acquire did not raise KeyboardInterrupt"
    eventually_sync(
        lambda: not group_record_sync(holder).queue,
        timeout=GONE_S,
        what="the interrupted waiter is gone from the queue right after its process exited",
    )
    released = holder.release()
    assert released.pending_waiters == 0, "the release found the dead waiter still queued"
    # the record is stored a moment after the release is answered: wait until it no longer shows the holder's hold
    eventually_sync(
        lambda: (h := group_record_sync(holder).holder) is None or h.job != "holder",
        timeout=GONE_S,
        what="the record shows the release",
    )
    rec = group_record_sync(holder)
    assert rec.holder is None and rec.switch is None and not rec.queue, f"granted to somebody after all: {rec}"
