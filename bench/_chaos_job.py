"""One job of ``bench/chaos.py``: acquire, hold, release, in a loop, logging every step as a JSON line.

It registers a small workload with its node's agent (a suspend and a resume of ``--switch-ms`` each), so the
agent has operations to be killed in the middle of. Errors are logged and the loop goes on: the harness
judges the run from these logs and from the stream, not from this process surviving.

Run by the harness: ``python bench/_chaos_job.py --nats-url URLS --group G --job J --out FILE [--node N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from timeslice_client import AsyncTimeSliceClient, CallbackHandler, HandlerResult
from timeslice_client.errors import TimeSliceError


class Log:
    def __init__(self, path: Path) -> None:
        self._f = path.open("a", encoding="utf-8")

    def __call__(self, ev: str, **fields: Any) -> None:
        self._f.write(json.dumps({"ev": ev, "t": time.time(), **fields}) + "\n")
        self._f.flush()


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nats-url", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--node", default=None, help="register a workload with this node's agent")
    p.add_argument("--hold-ms", type=float, default=2.0)
    p.add_argument("--switch-ms", type=float, default=5.0)
    p.add_argument("--lease", type=float, default=5.0)
    p.add_argument("--stop-file", required=True, help="the loop ends once this file exists")
    p.add_argument(
        "--away-ms", type=float, default=0.0, help="off the accelerators between a release and the next acquire"
    )
    p.add_argument("--priority", type=int, default=0, help="this job's priority class among the group's waiters")
    a = p.parse_args()
    log = Log(Path(a.out))
    stop = Path(a.stop_file)

    def pause(_mode: object, _tags: object) -> HandlerResult:
        time.sleep(a.switch_ms / 1000)  # the job's own suspend/resume: what an agent kill lands in
        return HandlerResult(bytes_moved=1)

    client = AsyncTimeSliceClient(
        a.job, a.group, a.nats_url, lease_s=a.lease, acquire_timeout_s=300, request_timeout_s=10, priority=a.priority
    )
    async with client:
        if a.node:
            try:
                await client.register_workload(
                    CallbackHandler(suspend=pause, resume=pause), node_id=a.node, op_timeout_s=30
                )
            except TimeSliceError as exc:
                log("error", where="register", type=exc.__class__.__name__, msg=str(exc)[:300])
        log("ready", pid=os.getpid())
        while not stop.exists():
            asked = time.time()
            try:
                g = await client.acquire(timeout=300)
            except TimeSliceError as exc:
                log("error", where="acquire", type=exc.__class__.__name__, msg=str(exc)[:300])
                await asyncio.sleep(1.0)  # e.g. faulted until the operator clears it: ask again a second later
                continue
            log("granted", asked=asked, epoch=g.epoch)
            await asyncio.sleep(a.hold_ms / 1000)  # the hold itself (the job's GPU phase)
            try:
                await client.release()
                log("released", epoch=g.epoch)
            except TimeSliceError as exc:
                log("error", where="release", type=exc.__class__.__name__, msg=str(exc)[:300], epoch=g.epoch)
            if a.away_ms:
                await asyncio.sleep(a.away_ms / 1000)  # the job's phase off the accelerators (reward, generation)
    log("done")


if __name__ == "__main__":
    asyncio.run(main())
