"""Load generator for scale.py and recovery.py: many jobs speaking the wire protocol, in one process.

Not the client library: one NATS connection, one subscription per group for the notices
(``ts.v1.notice.<group>.*``), and raw publishes of ``protocol.Acquire``/``Release`` into the stream
subjects, each with its ``Nats-Msg-Id`` (as ``AsyncTimeSliceClient`` sends them) and a reply subject
for the stream's PubAck, which is counted (errors too) but not waited on, so thousands of jobs cost
one event loop and what is measured is the orchestrator and the bus, not 4,000 client objects.
Acquires ask for 10-minute leases, waiter and confirmation windows, so no renewals are needed during
a run (the real client renews in the background; renewals change no decision here).

Modes (``--mode``):

* ``handoff``: G groups x J jobs; every job acquires; a job that is granted releases at once (or after
  ``--hold-ms``; the groups then start spread over one hold time, so the offered load is even) and
  acquires again (joining the back of the queue), so each group hands off continuously. Records the
  handoff latency (the holder's release published → the next job's grant arrives, both in this
  process) and, with ``--timeline``, the time of every grant;
* ``baseline``: G chains, each publishing a message into a scratch stream and, when its PubAck comes,
  the next one: the bus's publish + ack rate at the same concurrency, no orchestrator involved;
* ``populate``: one job per group acquires and releases once (groups created by real use).

It starts when the driver publishes the go message on ``bench.go`` (JSON: window start, window end
and stop time, all ``time.monotonic()`` on this host), stops then, or earlier when told on
``bench.stop`` (empty: now; ``{"after_next_grant": s}``: s seconds after the next new grant), and writes
its result as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import msgspec
from _common import GO_SUBJECT, STOP_SUBJECT, loop_run
from nats.aio.msg import Msg
from timeslice_client.bus import connect
from timeslice_client.protocol import (
    Acquire,
    Dequeued,
    Granted,
    Refused,
    Release,
    Released,
    Revoked,
    decode_notice,
    encode,
    subjects,
)

BASELINE_SUBJECT = "bench.base"
LONG_MS = 600_000


def group_ids(prefix: str, first: int, count: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(first, first + count)]


class _Counters(msgspec.Struct):
    acks: int = 0
    ack_errors: int = 0
    duplicates: int = 0
    refused: int = 0
    revoked: int = 0
    dequeued: int = 0
    released: int = 0


class LoadGen:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.groups = group_ids(args.prefix, args.first, args.count)
        self.jobs = [f"j{k}" for k in range(args.jobs)]
        self.c = _Counters()
        self.pending: dict[tuple[str, str], str | None] = {}
        self.release_t: dict[str, float] = {}
        self.latencies: list[float] = []
        self.grant_times: list[float] = []
        self.handoffs_in_window = 0
        self.grants = 0
        self.n = 0
        self.window = (0.0, 0.0)
        self.stop_at = 0.0
        self.done = asyncio.Event()
        self.stop_changed = asyncio.Event()
        self.stop_after_grant: float | None = None  # stop this long after the next grant (recovery.py)
        self.populated = 0
        self.nc: Any = None
        self.ack_inbox = ""
        self.hold_s = args.hold_ms / 1000
        self.holds: collections.deque[tuple[float, Granted]] = collections.deque()  # (release at, grant)
        self.hold_wake = asyncio.Event()
        self.holds_empty = asyncio.Event()
        self.holds_empty.set()
        self.payload = b""

    def _rid(self) -> str:
        self.n += 1
        return f"{self.a.prefix}-{self.n}"

    async def _pub(self, group: str, job: str, msg: Acquire | Release) -> None:
        verb = msg.__struct_config__.tag
        assert isinstance(verb, str)
        await self.nc.publish(
            subjects.job(group, job, verb), encode(msg), reply=self.ack_inbox, headers={"Nats-Msg-Id": msg.request_id}
        )

    async def _acquire(self, group: str, job: str) -> None:
        rid = self._rid()
        self.pending[(group, job)] = rid
        await self._pub(
            group,
            job,
            Acquire(
                group=group,
                job=job,
                request_id=rid,
                lease_ms=LONG_MS,
                timeout_ms=6 * LONG_MS,
                waiter_ttl_ms=LONG_MS,
                confirm_ms=LONG_MS,
            ),
        )

    async def _on_ack(self, msg: Msg) -> None:
        self.c.acks += 1
        if b'"error"' in msg.data:
            self.c.ack_errors += 1

    async def _on_notice(self, msg: Msg) -> None:
        n = decode_notice(msg.data)
        if isinstance(n, Granted):
            await self._on_grant(n)
        elif isinstance(n, Released):
            self.c.released += 1
            if self.a.mode == "populate":
                self.populated += 1
                if self.populated == len(self.groups):
                    self.done.set()
        elif isinstance(n, Refused):
            self.c.refused += 1
        elif isinstance(n, Revoked):
            self.c.revoked += 1
        elif isinstance(n, Dequeued):
            self.c.dequeued += 1

    async def _on_grant(self, n: Granted) -> None:
        key = (n.group, n.job)
        if self.pending.get(key) != n.request_id:
            self.c.duplicates += 1  # re-issued after an orchestrator restart, or a late answer
            return
        self.pending[key] = None
        t = time.monotonic()
        self.grants += 1
        if self.stop_after_grant is not None:
            self._stop_by(t + self.stop_after_grant)
            self.stop_after_grant = None
        if self.a.timeline:
            self.grant_times.append(t)
        rel = self.release_t.get(n.group)
        if rel is not None and self.window[0] <= t <= self.window[1]:
            self.latencies.append((t - rel) * 1000)
            self.handoffs_in_window += 1
        if self.hold_s > 0 and self.a.mode == "handoff":
            self.holds.append((t + self.hold_s, n))  # equal holds: the deque stays in release order
            self.holds_empty.clear()
            self.hold_wake.set()
            return
        await self._release(n)

    def _stop_by(self, t: float) -> None:
        self.stop_at = min(self.stop_at, t)
        self.stop_changed.set()

    async def _release(self, n: Granted) -> None:
        self.release_t[n.group] = t = time.monotonic()
        await self._pub(n.group, n.job, Release(group=n.group, job=n.job, request_id=self._rid(), epoch=n.epoch))
        if self.a.mode == "handoff" and t < self.stop_at:
            await self._acquire(n.group, n.job)

    async def _releaser(self) -> None:
        """Releases held groups when their hold time is up (``--hold-ms``)."""
        while True:
            while self.holds and self.holds[0][0] <= time.monotonic():
                await self._release(self.holds.popleft()[1])
            if not self.holds:
                self.holds_empty.set()
            self.hold_wake.clear()
            delay = self.holds[0][0] - time.monotonic() if self.holds else 3600.0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(delay, 0.0)):
                    await self.hold_wake.wait()

    # ------------------------------------------------------------------ baseline: publish + ack chains

    async def _on_base_ack(self, msg: Msg) -> None:
        self.c.acks += 1
        if b'"error"' in msg.data:
            self.c.ack_errors += 1
        t = time.monotonic()
        if self.window[0] <= t <= self.window[1]:
            self.handoffs_in_window += 1  # here: acknowledged publishes in the window
        if t < self.stop_at:
            chain = msg.subject.rsplit(".", 1)[1]
            await self._base_pub(chain)

    async def _base_pub(self, chain: str) -> None:
        rid = self._rid()
        await self.nc.publish(
            f"{BASELINE_SUBJECT}.{chain}", self.payload, reply=f"{self.ack_inbox}.{chain}", headers={"Nats-Msg-Id": rid}
        )

    # ------------------------------------------------------------------ run

    async def run(self) -> dict[str, Any]:
        a = self.a
        self.nc = await connect(a.url, name=f"bench-loadgen-{a.prefix}", pending_size=64 * 1024 * 1024)
        self.ack_inbox = self.nc.new_inbox()
        go: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()

        async def on_go(msg: Msg) -> None:
            if not go.done():
                go.set_result(json.loads(msg.data))

        async def on_stop(msg: Msg) -> None:
            after = json.loads(msg.data).get("after_next_grant") if msg.data else None
            if after is None:
                self._stop_by(time.monotonic())
            else:
                self.stop_after_grant = float(after)

        await self.nc.subscribe(GO_SUBJECT, cb=on_go)
        await self.nc.subscribe(STOP_SUBJECT, cb=on_stop)
        if a.mode == "baseline":
            self.payload = encode(Acquire(group="g", job="j", request_id="x" * 32))
            await self.nc.subscribe(f"{self.ack_inbox}.*", cb=self._on_base_ack, pending_msgs_limit=1_000_000)
        else:
            await self.nc.subscribe(self.ack_inbox, cb=self._on_ack, pending_msgs_limit=1_000_000)
            for g in self.groups:
                await self.nc.subscribe(f"ts.v1.notice.{g}.*", cb=self._on_notice, pending_msgs_limit=1_000_000)
        await asyncio.sleep(0)  # else flush() after subscribe() is no barrier (docs/nats.md)
        await self.nc.flush(timeout=10)
        Path(a.ready).write_text("ready")
        async with asyncio.timeout(a.go_timeout):
            plan = await go
        self.window = (plan["window_start"], plan["window_end"])
        self.stop_at = plan["stop"]
        started = time.monotonic()
        if a.mode == "baseline":
            for chain in range(a.count):
                await self._base_pub(str(chain))
        elif a.mode == "populate":
            for grp in self.groups:
                await self._acquire(grp, "p")
        else:
            for i, grp in enumerate(self.groups):
                if self.hold_s > 0:  # spread the groups' first grants over one hold, so the load is even
                    await asyncio.sleep(max(0.0, started + self.hold_s * i / len(self.groups) - time.monotonic()))
                for job in self.jobs:
                    await self._acquire(grp, job)
        if a.mode == "populate":
            async with asyncio.timeout(a.go_timeout):
                await self.done.wait()
        else:
            async with asyncio.TaskGroup() as tg:
                releaser = tg.create_task(self._releaser())
                while time.monotonic() < self.stop_at:  # the run's planned length, or until told to stop
                    self.stop_changed.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(0.0, self.stop_at - time.monotonic())):
                            await self.stop_changed.wait()
                async with asyncio.timeout(self.hold_s + 10):
                    await self.holds_empty.wait()  # every job ends without the group
                releaser.cancel()
        finished = time.monotonic()
        await self.nc.flush(timeout=10)
        await self.nc.drain()
        return {
            "mode": a.mode,
            "groups": len(self.groups),
            "jobs_per_group": len(self.jobs),
            "hold_ms": a.hold_ms,
            "started": started,
            "finished": finished,
            "window": list(self.window),
            "in_window": self.handoffs_in_window,
            "grants": self.grants,
            "latencies_ms": self.latencies,
            "grant_times": self.grant_times,
            "counters": msgspec.to_builtins(self.c),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--mode", choices=("handoff", "baseline", "populate"), default="handoff")
    p.add_argument("--prefix", default="g")
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--count", type=int, required=True, help="groups (baseline: publish chains)")
    p.add_argument("--jobs", type=int, default=4, help="jobs per group")
    p.add_argument("--hold-ms", type=float, default=0.0, help="a granted job holds this long before releasing")
    p.add_argument("--timeline", action="store_true", help="record the time of every grant")
    p.add_argument("--ready", required=True, help="file written once subscribed")
    p.add_argument("--out", required=True)
    p.add_argument("--go-timeout", type=float, default=300.0)
    a = p.parse_args()
    res = loop_run(LoadGen(a).run())
    Path(a.out).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
