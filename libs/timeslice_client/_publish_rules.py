"""What the client's stream publishes rest on: request ids, which errors are worth a retry with the same
message id (the stream drops duplicates within its window) or mean a claim was superseded, and the publish that
retries by those rules."""

from __future__ import annotations

import os
from typing import Final

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from ._grants import _Superseded
from .errors import TimeSliceError, Unavailable

__all__ = ["publish_stored", "request_id", "superseded", "transient"]

# Errors of the bus itself, not of the request, by type (nats-py's own TimeoutError is a TimeoutError).
_TRANSIENT: Final = (
    TimeoutError,
    OSError,
    ConnectionError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
)


def request_id() -> str:
    """A random 128-bit id in hex, like ``uuid4().hex`` at a seventh of its cost."""
    return os.urandom(16).hex()


# JetStream's error codes for a failed Nats-Expected-Last-*-Sequence check: 10071, and 10164 from a clustered stream
# while another write of the same subject is still in flight (seen on a 3-node cluster; docs/nats.md, docs/cluster.md).
_WRONG_LAST_SEQUENCE = frozenset({10071, 10164})


def superseded(exc: BaseException) -> bool:
    return getattr(exc, "err_code", None) in _WRONG_LAST_SEQUENCE


# JetStream's error code for a publish whose message id a clustered stream is still storing from an earlier attempt
# (seen on a 3-node cluster during an election): the same publish again gets the first one's answer (docs/nats.md).
_DUPLICATE_IN_PROCESS = 10158
_TEMPORARILY_UNAVAILABLE = 10008  # JetStream: "JetStream system temporarily unavailable" (code 503)
ATTEMPT_S = 1.0  # one attempt's wait for a PubAck (publish_stored); a PubAck takes well under a millisecond here


def transient(exc: BaseException) -> bool:
    """Errors worth retrying with the same message id: timeouts, connection trouble, an earlier attempt of the
    same message still in process, and JetStream saying it is temporarily unavailable (a cluster's servers coming
    back, their meta layer not led yet)."""
    if getattr(exc, "err_code", None) in (_DUPLICATE_IN_PROCESS, _TEMPORARILY_UNAVAILABLE):
        return True
    return isinstance(exc, _TRANSIENT)


async def publish_stored(
    js: JetStreamContext, subject: str, data: bytes, *, headers: dict[str, str] | None, timeout: float, nats_url: str
) -> int:
    """Publish into the stream and wait for its PubAck, retrying transient errors for ``3 * timeout`` with the
    same message id (``Nats-Msg-Id`` in ``headers``); returns the message's stream sequence. Raises
    ``_Superseded`` when the stream refuses it for a sequence check in ``headers``, else ``Unavailable``.

    Each attempt waits at most :data:`ATTEMPT_S` (or ``timeout`` if shorter): a publish sent while a NATS cluster
    elects the stream's leader is never answered, and the next attempt reaches the new leader; a retry of a stored
    message is answered as the duplicate it is."""
    attempt_s = min(timeout, ATTEMPT_S)
    try:  # the common case first, without the retry machinery on the hot path
        ack = await js.publish(subject, data, timeout=attempt_s, headers=headers)
        return int(ack.seq)
    except Exception as exc:
        if superseded(exc):
            raise _Superseded from exc
        if not transient(exc):
            raise Unavailable(
                f"publishing {subject} failed ({exc.__class__.__name__}: {exc})", nats_url=nats_url
            ) from exc
    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_delay(timeout * 3),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception(transient),
            reraise=True,
        ):
            with attempt:
                ack = await js.publish(subject, data, timeout=attempt_s, headers=headers)
                return int(ack.seq)
    except TimeSliceError:
        raise
    except Exception as exc:
        if superseded(exc):
            raise _Superseded from exc
        raise Unavailable(
            f"publishing {subject} failed ({exc.__class__.__name__})", nats_url=nats_url, after_s=timeout * 3
        ) from exc
    raise AssertionError("unreachable: the retry loop returns or raises")
