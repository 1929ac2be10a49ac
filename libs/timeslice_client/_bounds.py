"""Bounds on every client-chosen field of the wire types, enforced when a message is decoded (before anything
acts on it), so that no input can grow a record or a log line without limit (used by ``protocol``). Ids (group,
job, node) follow ``validate_id`` (at most 64 characters); the orchestrator checks durations against its
``Limits`` and refuses them with a reason."""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

__all__ = [
    "DEFAULT_OP_TIMEOUT_MS",
    "ID_PATTERN",
    "MAX_PRIORITY",
    "Count",
    "Elapsed",
    "Id",
    "JobId",
    "Ms",
    "Name",
    "OpId",
    "OpTimeoutMs",
    "Reason",
    "RequestId",
    "Text",
]

Id = Annotated[str, msgspec.Meta(max_length=64)]
# What ``validate_id`` accepts, as a pattern msgspec checks at decoding (and JSON Schema states): for an id that no
# subject carries, so that the bus did not check it (a job named in ``SetPolicy.shares``). ``(?!\n)``: Python's ``$``
# also matches before a final newline.
ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$(?!\n)"
JobId = Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
OpId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Name = Annotated[str, msgspec.Meta(max_length=64)]  # phase and backend names, tags
Reason = Annotated[str, msgspec.Meta(max_length=256)]
MAX_TEXT: Final = 2048  # characters of an error text on the wire
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]  # error texts
Ms = Annotated[int, msgspec.Meta(ge=-(2**53), le=2**53)]  # any time or duration in ms: far from int64's edge
Count = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
MAX_PRIORITY: Final = 9  # the highest priority class of an acquire (``Acquire.priority``); 0 is the default
DEFAULT_OP_TIMEOUT_MS: Final = 120_000  # one agent operation's budget unless the job registers another
OpTimeoutMs = Annotated[int, msgspec.Meta(ge=1, le=7 * 24 * 3600 * 1000)]  # at most a week
Elapsed = Annotated[float, msgspec.Meta(ge=0, le=1e12)]  # no NaN, no infinity
