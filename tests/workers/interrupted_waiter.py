"""A job that waits for a group through the blocking ``TimeSliceClient`` until Ctrl-C (SIGINT), for
``tests/test_sync_interrupt.py``.

Run as ``python -m tests.workers.interrupted_waiter NATS_URL GROUP JOB OUT {uncaught,exit}``. It connects, writes
``ready`` to ``OUT``, and waits (``acquire``) with a long waiter TTL, so that only its own withdrawal can take it
out of the queue soon. It never closes the client. On the ``KeyboardInterrupt`` it either ends the process at once
(``exit``: ``os._exit(130)``, a process that dies right after the interrupt, as one killed then would), or writes
``interrupted`` and lets it end the interpreter (``uncaught``): either way, what the acquire did before it raised is
all that can have withdrawn the wait (with ``exit`` nothing else runs after it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from timeslice_client import TimeSliceClient


def main() -> None:
    url, group, job, out, how = sys.argv[1:6]
    log = Path(out)
    client = TimeSliceClient(job, group, url, waiter_ttl_s=60.0).connect()
    log.write_text("ready\n")
    try:
        client.acquire(timeout=120)
    except KeyboardInterrupt:
        if how == "exit":
            os._exit(130)  # at once: not even the log line first (the exit status says it)
        with log.open("a") as f:
            f.write("interrupted\n")
        raise
    with log.open("a") as f:
        f.write("granted\n")


if __name__ == "__main__":
    main()
