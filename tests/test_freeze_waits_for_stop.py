"""The freeze backend's snapshot ends only once the job's threads have stopped (not when ``kill`` returns).

Under load a SIGSTOPped thread was seen running user code up to 16 ms after ``kill`` returned; a snapshot that
reported done at once let the next job be granted while the frozen job still ran (CI: a frozen worker logged a
tick after the next job's grant). These tests signal real processes; one points the backend at a fake ``/proc``
to hold a thread "running" for as long as the test likes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeslice_agent._process_stop import group_members, running_threads
from timeslice_agent.backends import BackendError, FreezeBackend, OpContext
from timeslice_client.protocol import JobContext, JobState

from .helpers import eventually

_SPIN = """
import threading, time
def spin():
    while True:
        time.time()
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
time.sleep(600)
"""


def _op(seconds: float = 10.0) -> OpContext:
    return OpContext(op_id="g:1:snapshot:n", epoch=1, deadline=time.monotonic() + seconds)


def _ctx(pids: tuple[int, ...] = (), pgid: int | None = None) -> JobContext:
    return JobContext(node="n", job="j", group="g", state=JobState.RUNNING, backends=("freeze",), pids=pids, pgid=pgid)


@pytest.fixture
def spinner() -> Iterator[subprocess.Popen[bytes]]:
    """A process with three threads busy in user code (the case where a stop lands late)."""
    p = subprocess.Popen([sys.executable, "-c", _SPIN], start_new_session=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait(timeout=10)


def _proc_state(pid: int) -> str:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return chr(data[data.rindex(b")") + 2])


async def _threads_up(pid: int) -> None:
    await eventually(lambda: len(os.listdir(f"/proc/{pid}/task")) >= 4, what="the spinner's threads started")


async def test_every_thread_is_stopped_when_the_snapshot_returns(spinner: subprocess.Popen[bytes]) -> None:
    await _threads_up(spinner.pid)
    backend = FreezeBackend()
    for _ in range(20):
        await backend.snapshot(_ctx(pids=(spinner.pid,)), _op())
        assert running_threads([spinner.pid]) == {}, "a thread ran after the snapshot returned"
        await backend.restore(_ctx(pids=(spinner.pid,)), _op())
        await eventually(lambda: _proc_state(spinner.pid) != "T", what="the spinner continued")


async def test_the_process_group_is_waited_for_too(tmp_path: Path) -> None:
    # A leader and a child in its own session: the snapshot names only the group.
    script = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {_SPIN!r}])\ntime.sleep(600)\n"
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        members = await eventually(
            lambda: m if len(m := group_members(leader.pid)) >= 2 else None, what="the leader's child in its group"
        )
        # The child up (its spin threads started) and the leader back in its sleep: Python's subprocess forks with
        # vfork, and a leader stopped while it waits in vfork for the child's exec sits in D (uninterruptible),
        # where a SIGSTOP cannot land until the child runs again (CI froze the group in that window once).
        (child,) = members - {leader.pid}
        await _threads_up(child)
        await eventually(lambda: _proc_state(leader.pid) == "S", what="the leader asleep, past its vfork")
        backend = FreezeBackend()
        await backend.snapshot(_ctx(pgid=leader.pid), _op())
        assert running_threads(members) == {}
        await backend.restore(_ctx(pgid=leader.pid), _op())
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)


def _fake_proc(root: Path, pid: int, state: str) -> Path:
    stat = root / str(pid) / "task" / str(pid) / "stat"
    stat.parent.mkdir(parents=True, exist_ok=True)
    stat.write_text(f"{pid} (odd) name) {state} 1 {pid} {pid} 0 -1\n")
    return stat


async def test_a_thread_that_never_stops_fails_the_snapshot_and_the_job_is_continued(
    tmp_path: Path, spinner: subprocess.Popen[bytes]
) -> None:
    _fake_proc(tmp_path, spinner.pid, "R")  # the fake /proc keeps saying "running"
    backend = FreezeBackend(proc=str(tmp_path), stop_timeout=0.3)
    started = time.monotonic()
    said = rf"job 'j' did not stop: 1 thread\(s\) .* {spinner.pid}/{spinner.pid} \(R\)"
    with pytest.raises(BackendError, match=said):
        await backend.snapshot(_ctx(pids=(spinner.pid,)), _op())
    assert 0.3 <= time.monotonic() - started < 5
    # The real process was sent SIGCONT again: it runs, as the failed snapshot reports.
    await eventually(lambda: _proc_state(spinner.pid) != "T", what="the job continued after the failed snapshot")


async def test_the_snapshot_ends_as_soon_as_the_thread_reads_stopped(
    tmp_path: Path, spinner: subprocess.Popen[bytes]
) -> None:
    stat = _fake_proc(tmp_path, spinner.pid, "R")
    backend = FreezeBackend(proc=str(tmp_path), stop_timeout=30)
    task = asyncio.create_task(backend.snapshot(_ctx(pids=(spinner.pid,)), _op(60)))
    await eventually(lambda: _proc_state(spinner.pid) == "T", what="the real process got SIGSTOP")
    assert not task.done()  # the fake /proc still says running
    _fake_proc(tmp_path, spinner.pid, "t")  # traced-stop counts as stopped too
    assert stat.read_text().split(") ")[-1].startswith("t")
    await asyncio.wait_for(task, timeout=5)


async def test_the_wait_is_bounded_by_the_operation_deadline(tmp_path: Path, spinner: subprocess.Popen[bytes]) -> None:
    _fake_proc(tmp_path, spinner.pid, "D")
    backend = FreezeBackend(proc=str(tmp_path), stop_timeout=60)
    started = time.monotonic()
    with pytest.raises(BackendError, match=r"\(D\)"):
        await backend.snapshot(_ctx(pids=(spinner.pid,)), _op(0.2))
    assert time.monotonic() - started < 5


def test_gone_and_zombie_threads_count_as_stopped(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 41, "Z")
    _fake_proc(tmp_path, 42, "X")
    assert running_threads([41, 42, 43], proc=str(tmp_path)) == {}  # 43: no such process
    _fake_proc(tmp_path, 44, "S")
    assert running_threads([41, 44], proc=str(tmp_path)) == {"44/44": "S"}
