"""Before a leader publishes or stores a decision: is its lease still its own? (private to the shell)"""

from __future__ import annotations

import asyncio
import contextlib
import time

from ._leadership import Leadership

__all__ = ["confirm_lease"]

_ATTEMPT_S = 0.5  # one renewal's wait for its answer (a renewal takes well under a millisecond here)


async def confirm_lease(leader: Leadership, *, ttl_s: float, wait_s: float, halt: asyncio.Event) -> str | None:
    """None when this instance may go on leading, else why not.

    The lease's validity window can lapse while this instance still holds the lease (a stalled event loop, or a
    NATS cluster electing a stream leader, when writes stall for seconds). Then renewals (compare-and-swaps on its
    own revision, refused once anyone else took the lease) are tried until one lands, for at most ``wait_s``;
    ``halt`` ends the wait at once."""
    if leader.is_leader():
        return None
    deadline = time.monotonic() + wait_s
    why = "the lease lapsed"
    while not halt.is_set():
        try:
            async with asyncio.timeout(min(ttl_s, _ATTEMPT_S)):  # one sent into an election is never answered
                await leader.confirm()
        except Exception as exc:
            why = f"the lease could not be confirmed ({exc!r})"
        if leader.is_leader():
            return None
        if leader.term is None or time.monotonic() >= deadline:
            return why  # stepped down (someone else leads), or the bus stayed away too long
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.1):  # between renewals
                await halt.wait()
    return "stopping"
