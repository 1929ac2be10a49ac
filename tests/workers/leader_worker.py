"""One ``Leadership`` as a standalone process, for the SIGSTOP and kill -9 tests of leader election.

Run as ``python -m tests.workers.leader_worker --nats-url URL --out FILE [--ttl 1] [--instance ID]``. It appends
one JSON object per line to ``FILE`` (flushed at once, so a test can read it after a SIGKILL)::

    {"ev": "ready", "pid": 123, "instance": "w1", "t": ...}
    {"ev": "elected", "term": 7, "t": ...}                 # on_change(leading=True)
    {"ev": "lost", "term": 7, "reason": "...", "t": ...}   # on_change(leading=False)
    {"ev": "believes", "term": 7, "t": ...}                # the hot path saw is_leader() True (first of a run)
    {"ev": "cont", "is_leader": false, "term": 7, "t": ...} # written by the SIGCONT handler, before anything else
    {"ev": "fenced", "ok": false, "error": "NotLeader", "t": ...}  # the fenced write tried after SIGCONT
    {"ev": "done", "t": ...}

``believes`` lines come from a task that checks ``is_leader()`` every 5 ms like a decision loop would; it
writes one line each time the answer turns True (with ``"after_cont": true`` once a SIGCONT was seen). SIGTERM
stops the worker (it resigns when leading).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import IO, Any

import nats
from timeslice_orchestrator._leadership import Leadership, LeadershipChange, NotLeader


class EventLog:
    def __init__(self, path: str) -> None:
        self._f: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def __call__(self, ev: str, **fields: Any) -> None:
        self._f.write(json.dumps({"ev": ev, **fields, "t": time.time()}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


async def _quiet(exc: Exception) -> None:
    pass


async def main(a: argparse.Namespace) -> int:
    log = EventLog(a.out)
    nc = await nats.connect(a.nats_url, error_cb=_quiet, max_reconnect_attempts=-1)
    js = nc.jetstream()
    stop = asyncio.Event()
    conted = asyncio.Event()

    def changed(c: LeadershipChange) -> None:
        log("elected" if c.leading else "lost", term=c.term, reason=c.reason)

    lead = Leadership(js, instance_id=a.instance, ttl_s=a.ttl, renew_s=a.renew, on_change=changed)
    loop = asyncio.get_running_loop()

    def on_cont() -> None:  # runs as an event-loop callback: maybe before the renewal task wakes
        log("cont", is_leader=lead.is_leader(), term=lead.term)
        conted.set()

    loop.add_signal_handler(signal.SIGCONT, on_cont)
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def decisions() -> None:  # the hot path: a decision loop that checks before each publish
        believed = False
        while not stop.is_set():
            now = lead.is_leader()
            if now and not believed:
                log("believes", term=lead.term, after_cont=conted.is_set())
            believed = now
            try:
                await asyncio.wait_for(stop.wait(), 0.005)
            except TimeoutError:
                pass

    async def fenced_after_cont() -> None:
        waiter = loop.create_task(conted.wait())
        stopper = loop.create_task(stop.wait())
        try:
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            stopper.cancel()
        if not conted.is_set():
            return
        try:
            term = await lead.confirm()
            log("fenced", ok=True, term=term)
        except NotLeader as exc:
            log("fenced", ok=False, error=type(exc).__name__, msg=str(exc))

    log("ready", pid=os.getpid(), instance=lead.instance_id)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(lead.run(stop))
            tg.create_task(decisions())
            tg.create_task(fenced_after_cont())
    finally:
        log("done")
        log.close()
        await nc.close()
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="leader_worker")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--instance", default=None)
    p.add_argument("--ttl", type=int, default=1)
    p.add_argument("--renew", type=float, default=0.25)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
