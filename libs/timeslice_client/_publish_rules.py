"""What the client's stream publishes rest on: request ids, and which errors are worth a retry with the same
message id (the stream drops duplicates within its window) or mean a claim was superseded."""

from __future__ import annotations

import os

__all__ = ["request_id", "superseded", "transient"]


def request_id() -> str:
    """A random 128-bit id in hex, like ``uuid4().hex`` at a seventh of its cost."""
    return os.urandom(16).hex()


_WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed Nats-Expected-Last-*-Sequence check


def superseded(exc: BaseException) -> bool:
    return getattr(exc, "err_code", None) == _WRONG_LAST_SEQUENCE


def transient(exc: BaseException) -> bool:
    """Errors worth retrying with the same message id: timeouts and connection trouble."""
    return isinstance(exc, TimeoutError | OSError | ConnectionError) or exc.__class__.__name__ in (
        "NoRespondersError", "NoStreamResponseError", "ConnectionClosedError", "ConnectionReconnectingError",
        "OutboundBufferLimitError")
