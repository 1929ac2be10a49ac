"""What the orchestrator checks of one input before the core sees it, and the refusal a malformed one gets.

An input's subject says who sent it (the bus's permissions), so its payload must agree with it (``check_names``),
and every id it carries must be one the wire allows. Apart from the service's shell so that the shell reads as the
order of work for one event, and what makes an input acceptable reads in one place.
"""

from __future__ import annotations

import contextlib

import msgspec
from timeslice_client.protocol import ErrorCode, InputEvent, Refused, decode_input, validate_id

from ._subjects import check_names

__all__ = ["checked_input", "malformed_refusal"]


def checked_input(subject: str, data: bytes, job: str | None) -> InputEvent:
    """The input ``data`` published on ``subject`` (whose job, if any, is ``job``, validated by ``route``).
    Raises ``msgspec.DecodeError``, ``msgspec.ValidationError`` or ``ValueError`` when it is malformed."""
    ev = decode_input(data)
    check_names(subject, ev)  # the subject is who sent it (the bus's permissions): the payload agrees
    for kind in ("job", "node"):
        value = getattr(ev, kind, None)
        if value is not None and value != job:  # equal to the subject's job: validated by route()
            validate_id(kind, value)
    return ev


def malformed_refusal(subject: str, data: bytes, group: str, job: str, exc: BaseException) -> Refused:
    """The answer to ``job``'s malformed input: its request id where one can be read, and why it was refused."""
    request_id = ""
    with contextlib.suppress(Exception):
        raw = msgspec.json.decode(data)
        if isinstance(raw, dict) and isinstance(raw.get("request_id"), str):
            request_id = raw["request_id"][:128]
    return Refused(
        group=group,
        job=job,
        request_id=request_id,
        code=ErrorCode.INVALID,
        message=f"malformed request on {subject}: {exc}",
    )
