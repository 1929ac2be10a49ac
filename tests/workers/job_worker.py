"""A job as a standalone process, for multi-process and crash tests.

Run as ``python -m tests.workers.job_worker --nats-url URL --group G --job J --out FILE [...]``. It appends
one JSON object per line to ``FILE`` for everything it does and flushes each line at once, so a test can
read what it did even after a SIGKILL::

    {"ev": "ready", "job": "j1", "pid": 123, "t": 1700000000.1}
    {"ev": "acquiring", "round": 0, "t": ...}
    {"ev": "granted", "round": 0, "epoch": 7, "waited_ms": 3, "t": ...}
    {"ev": "releasing", "round": 0, "epoch": 7, "t": ...}    # the hold ends here (before the release is sent)
    {"ev": "released", "round": 0, "epoch": 7, "pending": 1, "t": ...}
    {"ev": "error", "round": 0, "where": "acquire", "type": "AcquireTimeout", "msg": "...", "t": ...}
    {"ev": "done", "rounds": 30, "t": ...}

``t`` is ``time.time()``: all processes of a test share the clock, so the hold intervals
``[granted.t, releasing.t]`` of different jobs can be compared. They lie inside the orchestrator's own
hold intervals (the grant is decided before it is received, the release is applied after it is sent), so
they never overlap if the lock is exclusive.

Modes:

* ``loop``: ``--rounds`` times acquire, hold ``--hold-ms``, release (then pause ``--gap-ms``). Exit 0 when
  every round finished, 1 after the first error.
* ``hold``: acquire once, then hold until SIGUSR1 (then release and exit) or until killed.
* ``wait``: acquire once with ``--acquire-timeout``; on a grant hold ``--hold-ms`` and release. An
  acquire error is an expected outcome here: it is recorded and the exit status is 0.

With ``--wait-start`` the worker connects, writes ``ready`` and waits for SIGUSR1 before its first
acquire, so a test can start several workers at once. ``--client`` picks the blocking facade
(``TimeSliceClient``) or the asyncio client.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from timeslice_client import AsyncTimeSliceClient, TimeSliceClient

from .event_log import EventLog
from .job_flags import job_parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = job_parser("job_worker", __doc__, out_help="JSON-lines event log (appended)")
    p.add_argument("--mode", choices=("loop", "hold", "wait"), default="loop")
    p.add_argument("--client", choices=("sync", "async"), default="async")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--hold-ms", type=float, default=0.0)
    p.add_argument("--gap-ms", type=float, default=0.0, help="pause after each release (loop mode)")
    p.add_argument("--acquire-timeout", type=float, default=120.0)
    p.add_argument("--lease-seconds", type=float, default=30.0)
    p.add_argument("--waiter-ttl", type=float, default=5.0, help="seconds (client default 5)")
    p.add_argument("--confirm", type=float, default=3.0, help="seconds (client default 3)")
    p.add_argument("--request-timeout", type=float, default=5.0, help="seconds (client default 5)")
    p.add_argument("--wait-start", action="store_true", help="wait for SIGUSR1 before the first acquire")
    return p.parse_args(argv)


def _client_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "job_id": a.job,
        "group_id": a.group,
        "nats_url": a.nats_url,
        "lease_s": a.lease_seconds,
        "acquire_timeout_s": a.acquire_timeout,
        "request_timeout_s": a.request_timeout,
        "waiter_ttl_s": a.waiter_ttl,
        "confirm_s": a.confirm,
    }


def _rounds(a: argparse.Namespace) -> int:
    return a.rounds if a.mode == "loop" else 1


# --------------------------------------------------------------------------- the blocking facade


def _wait_usr1(usr1: threading.Event) -> None:
    """Block until SIGUSR1 (short waits: the handler runs between them, never inside a lock wait)."""
    while not usr1.wait(0.05):
        pass
    usr1.clear()


def run_sync(a: argparse.Namespace, log: EventLog, usr1: threading.Event) -> int:
    client = TimeSliceClient(**_client_kwargs(a))
    try:
        client.connect()
        log("ready", job=a.job, pid=os.getpid(), client="sync")
        if a.wait_start:
            _wait_usr1(usr1)
        for i in range(_rounds(a)):
            log("acquiring", round=i)
            try:
                g = client.acquire(a.acquire_timeout)
            except Exception as exc:
                log.failure("acquire", exc, round=i)
                return 0 if a.mode == "wait" else 1
            log("granted", round=i, epoch=g.epoch, waited_ms=g.waited_ms)
            if a.mode == "hold":
                _wait_usr1(usr1)
            elif a.hold_ms:
                time.sleep(a.hold_ms / 1000)  # the "work" done while holding
            log("releasing", round=i, epoch=g.epoch)
            try:
                r = client.release()
            except Exception as exc:
                log.failure("release", exc, round=i, epoch=g.epoch)
                return 1
            log("released", round=i, epoch=r.epoch, pending=r.pending_waiters)
            if a.gap_ms:
                time.sleep(a.gap_ms / 1000)
        log("done", rounds=_rounds(a))
        return 0
    finally:
        client.close()


# --------------------------------------------------------------------------- the asyncio client


async def run_async(a: argparse.Namespace, log: EventLog) -> int:
    usr1 = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, usr1.set)
    async with AsyncTimeSliceClient(**_client_kwargs(a)) as client:
        log("ready", job=a.job, pid=os.getpid(), client="async")
        if a.wait_start:
            await usr1.wait()
            usr1.clear()
        for i in range(_rounds(a)):
            log("acquiring", round=i)
            try:
                g = await client.acquire(a.acquire_timeout)
            except Exception as exc:
                log.failure("acquire", exc, round=i)
                return 0 if a.mode == "wait" else 1
            log("granted", round=i, epoch=g.epoch, waited_ms=g.waited_ms)
            if a.mode == "hold":
                await usr1.wait()
            elif a.hold_ms:
                await asyncio.sleep(a.hold_ms / 1000)  # the "work" done while holding
            log("releasing", round=i, epoch=g.epoch)
            try:
                r = await client.release()
            except Exception as exc:
                log.failure("release", exc, round=i, epoch=g.epoch)
                return 1
            log("released", round=i, epoch=r.epoch, pending=r.pending_waiters)
            if a.gap_ms:
                await asyncio.sleep(a.gap_ms / 1000)
        log("done", rounds=_rounds(a))
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    # SIGUSR1 terminates by default: catch it before anything else, a test may send it early.
    usr1 = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: usr1.set())
    log = EventLog(a.out)
    return log.run(lambda: run_sync(a, log, usr1) if a.client == "sync" else asyncio.run(run_async(a, log)))


if __name__ == "__main__":
    sys.exit(main())
