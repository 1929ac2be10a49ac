"""The agent's writes to the stream and its ``jobs`` bucket (and its read of a group's record), ridden through a NATS
election.

While a NATS cluster elects the leader of a stream (4-9 s on a 3-node loopback cluster, docs/nats.md), a write gets no
answer or "no responders". An operation's outcome must still reach the orchestrator: a snapshot that ran, reported
as failed because its answer could not be written at once, faults a job whose state is fine, and a command sent
again meanwhile would run a second time. So the agent retries transient failures (the client's own rule,
``transient``) for :data:`RETRY_S`, with the same message id where the stream deduplicates (``Nats-Msg-Id``), and a
key-value write is a plain put: repeating it after a timeout whose write landed anyway (in a cluster a timeout is
"unknown", not "failed": a write that timed out on the client had been committed in 2 of 10 leader kills) writes
the same value.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential
from timeslice_client._publish_rules import transient

__all__ = ["RETRY_S", "kv_get", "kv_put", "publish"]

RETRY_S: Final = 30.0  # beyond the longest election seen (9 s) with room; an operation's deadline is longer still
_ATTEMPT_S: Final = 1.0  # one attempt's wait for the stream's answer (the next one reaches a new leader)
T = TypeVar("T")


async def _retrying(call: Callable[[], Awaitable[T]], within_s: float) -> T:
    async for attempt in AsyncRetrying(
        stop=stop_after_delay(within_s),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        retry=retry_if_exception(transient),
        reraise=True,
    ):
        with attempt:
            return await call()
    raise AssertionError("unreachable: the retry loop returns or raises")


async def publish(
    js: JetStreamContext, subject: str, data: bytes, *, headers: dict[str, str] | None = None, within_s: float = RETRY_S
) -> int:
    """Publish into the stream until it answers (transient errors retried for ``within_s``); the stream sequence.
    Raises the last error when it never did."""

    async def once() -> int:
        ack = await js.publish(subject, data, timeout=_ATTEMPT_S, headers=headers)
        return int(ack.seq)

    return await _retrying(once, within_s)


async def kv_put(kv: KeyValue, key: str, value: bytes, *, within_s: float = RETRY_S) -> int:
    """``kv.put`` until the bucket answers (transient errors retried for ``within_s``); the entry's revision."""

    async def once() -> int:
        return int(await kv.put(key, value))

    return await _retrying(once, within_s)


async def kv_get(kv: KeyValue, key: str, *, within_s: float = RETRY_S) -> bytes | None:
    """``kv.get`` until the bucket answers (transient errors retried for ``within_s``); the value, None when the key
    has none (never written, deleted or purged)."""

    async def once() -> bytes | None:
        try:
            return (await kv.get(key)).value or None
        except (KeyNotFoundError, KeyDeletedError):
            return None

    return await _retrying(once, within_s)
