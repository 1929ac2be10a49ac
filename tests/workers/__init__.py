"""Job processes for the multi-process and crash tests, and what the tests need around them.

* :class:`Worker` starts ``python -m tests.workers.job_worker`` and reads its JSON-lines event log;
* :func:`worker_command` is the command line of a ``job_worker`` or ``workload_worker`` process;
* :func:`holds` / :func:`check_exclusive_holds` turn the logs into hold intervals and check them;
* :func:`read_stream` reads the whole ``TIMESLICE`` stream as ``(seq, now_ms, subject, data)``, with
  ``now_ms`` computed exactly as the orchestrator computes it (the delivery's nanosecond timestamp);
* :func:`fold_checked` folds it it through the invariant checker;
* :func:`notices` decodes the notices published in it for one job;
* :func:`looping_worker` starts a job that hands a group around through orchestrator restarts.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.errors
from timeslice_client.bus import connect
from timeslice_client.protocol import STREAM, Notice, decode_notice, subjects
from timeslice_orchestrator.invariants import InvariantViolation, StreamChecker

from .event_log import log_events

ROOT = Path(__file__).resolve().parents[2]

__all__ = [
    "Hold",
    "Worker",
    "check_exclusive_holds",
    "fold_checked",
    "holds",
    "log_events",
    "looping_worker",
    "notices",
    "read_stream",
    "worker_command",
]


def worker_command(module: str, nats_url: str, group: str, job: str, out: Path, **opts: Any) -> list[str]:
    """The argv of ``python -m tests.workers.<module>`` (``job_worker``, ``workload_worker``) for ``job`` in ``group``,
    its event log ``out``, then ``opts`` as flags: ``some_opt=v`` is ``--some-opt v``, ``True`` the flag alone,
    ``False`` or ``None`` no flag."""
    args = [sys.executable, "-m", f"tests.workers.{module}", "--nats-url", nats_url, "--group", group, "--job", job]
    args += ["--out", str(out)]
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            args.append(flag)
        elif v is not False and v is not None:
            args += [flag, str(v)]
    return args


class Worker:
    """One job process. ``events()`` re-reads its log (complete lines only)."""

    def __init__(self, tmp: Path, nats_url: str, group: str, job: str, **opts: Any) -> None:
        self.job = job
        self.group = group
        self.out = tmp / f"worker-{group}-{job}.jsonl"
        self.stderr_path = tmp / f"worker-{group}-{job}.stderr"
        args = worker_command("job_worker", nats_url, group, job, self.out, **opts)
        self._stderr = open(self.stderr_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self._stderr,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    def events(self, ev: str | None = None) -> list[dict[str, Any]]:
        return log_events(self.out, ev)

    def last(self, ev: str) -> dict[str, Any] | None:
        found = self.events(ev)
        return found[-1] if found else None

    def errors(self) -> list[dict[str, Any]]:
        return self.events("error")

    def usr1(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)

    def kill(self) -> None:
        """SIGKILL (no cleanup: no release, no cancel)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def describe(self) -> str:
        err = self.stderr_path.read_text(errors="replace")[-3000:] if self.stderr_path.exists() else ""
        return f"worker {self.job} rc={self.proc.poll()} events={self.events()[-6:]} output={err!r}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._stderr.close()


def looping_worker(tmp: Path, nats_url: str, group: str, job: str, *, client: str, **opts: Any) -> Worker:
    """A ``client`` ("sync" or "async") worker that takes ``group`` in a loop (``opts``: ``rounds``, ``hold_ms``, ...),
    started when told, whose calls outwait an orchestrator's restart (about a second) rather than fail."""
    return Worker(
        tmp,
        nats_url,
        group,
        job,
        mode="loop",
        client=client,
        wait_start=True,
        request_timeout=30,
        acquire_timeout=120,
        **opts,
    )


@dataclass(frozen=True)
class Hold:
    job: str
    epoch: int
    start: float  # granted (received by the job)
    end: float  # releasing (before the release was sent); inf while still held


def holds(workers: list[Worker]) -> list[Hold]:
    """Every hold the workers logged, sorted by start."""
    out: list[Hold] = []
    for w in workers:
        start: dict[str, Any] | None = None
        for e in w.events():
            if e["ev"] == "granted":
                assert start is None, f"{w.job}: granted twice without releasing: {start} then {e}"
                start = e
            elif e["ev"] == "releasing":
                assert start is not None and e["epoch"] == start["epoch"], f"{w.job}: releasing {e}, holding {start}"
                out.append(Hold(w.job, start["epoch"], start["t"], e["t"]))
                start = None
        if start is not None:
            out.append(Hold(w.job, start["epoch"], start["t"], float("inf")))
    out.sort(key=lambda h: h.start)
    return out


def check_exclusive_holds(hs: list[Hold]) -> None:
    """No two holds overlap, and epochs strictly rise from one hold to the next."""
    for prev, nxt in itertools.pairwise(hs):
        assert nxt.start > prev.end, f"holds overlap: {prev} and {nxt}"
        assert nxt.epoch > prev.epoch, f"epoch did not rise: {prev} then {nxt}"


def fold_checked(stream: list[tuple[int, int, str, bytes]], context: Callable[[], str]) -> StreamChecker:
    """``stream`` (as :func:`read_stream` reads it) folded through the invariant checker: a violation, or a grant
    the fold decided that the orchestrator never published, fails the test with ``context()`` besides."""
    checker = StreamChecker()
    try:
        checker.feed_all(stream)
    except InvariantViolation as exc:
        raise AssertionError(f"{exc}\n({context()})") from exc
    assert checker.unpublished_grants() == [], context()
    return checker


def _seq_and_time(reply: str) -> tuple[int, int]:
    t = reply.split(".")
    if len(t) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(t[5]), int(t[7]) // 1_000_000
    return int(t[7]), int(t[9]) // 1_000_000


async def read_stream(nats_url: str, timeout: float = 30.0) -> list[tuple[int, int, str, bytes]]:
    """The whole TIMESLICE stream, first to last message as of the call, in order. A JetStream request that
    times out (a cluster electing the stream's leader does not answer for a while) is tried again, within
    ``timeout`` in all."""
    deadline = asyncio.get_running_loop().time() + timeout
    for _ in range(9):
        left = deadline - asyncio.get_running_loop().time()
        if left <= 1.0:
            break
        try:
            return await _read_stream_once(nats_url, left)
        except nats.errors.TimeoutError:
            continue
    return await _read_stream_once(nats_url, 1.0)  # the last try: its error is the caller's


async def _read_stream_once(nats_url: str, timeout: float) -> list[tuple[int, int, str, bytes]]:
    nc = await connect(nats_url, name="test-stream-reader")
    try:
        js = nc.jetstream(timeout=min(timeout, 10.0))
        info = await js.stream_info(STREAM)
        first, last = info.state.first_seq, info.state.last_seq
        out: list[tuple[int, int, str, bytes]] = []
        if last == 0 or last < first:
            return out
        sub = await js.subscribe(subjects.all_events, stream=STREAM, ordered_consumer=True)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    msg = await sub.next_msg(timeout=timeout)
                    seq, ms = _seq_and_time(msg.reply)
                    if seq > last:
                        break
                    out.append((seq, ms, msg.subject, msg.data))
                    if seq == last:
                        break
        finally:
            await sub.unsubscribe()
        return out
    finally:
        await nc.close()


def notices(stream: list[tuple[int, int, str, bytes]], group: str, job: str) -> list[tuple[int, int, Notice]]:
    """(seq, stream time ms, notice) of every notice published to ``job`` in ``group``."""
    subject = subjects.notice(group, job)
    return [(seq, ms, decode_notice(data)) for seq, ms, subj, data in stream if subj == subject]
