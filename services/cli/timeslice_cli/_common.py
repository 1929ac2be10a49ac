"""What the commands share: the error they end with, the ``--nats-url`` flag, JSON on stdout."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from timeslice_client._internal.service_main import add_nats_url_flag
from timeslice_client.errors import TimeSliceError

__all__ = [
    "CliError",
    "add_nats_flag",
    "add_stream_flags",
    "add_window_flags",
    "emit_json",
    "in_range",
    "publish_control",
    "until_applied",
]


class CliError(TimeSliceError):
    """A command cannot do what it was asked; the message says why and what to do. Ends the command in one line on
    stderr and exit code 2, as every error of the ``timeslice`` command (``--debug``: with the traceback)."""

    def __init__(self, message: str, *, code: int = 2) -> None:
        self.code = code
        super().__init__(message)


def add_nats_flag(p: argparse.ArgumentParser) -> None:
    """``--nats-url`` (the bus's identity and TLS flags are added to every command that has it)."""
    add_nats_url_flag(p)


def add_window_flags(p: argparse.ArgumentParser) -> None:
    """``--since`` and ``--until``: the window of the event stream a command folds (``replay``, ``advise``)."""
    p.add_argument(
        "--since",
        default=None,
        help="window start: 10m / 2h ago, ms since the epoch or ISO 8601 (default: the stream's first message)",
    )
    p.add_argument("--until", default=None, help="window end, same forms (default: the stream's last message)")


def add_stream_flags(p: argparse.ArgumentParser) -> None:
    """The bus (``--nats-url``) and ``--timeout`` of a command that reads the event stream through."""
    add_nats_flag(p)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds allowed for reading the stream")


def in_range(flag: str, low: float, high: float, unit: str) -> Callable[[str], float]:
    """An argparse type for ``flag``: a number from ``low`` to ``high`` ``unit``; out of range, the error says the
    range (a bound that keeps the command useful: a timeout it can wait out, a rate the terminal can show)."""

    def number(text: str) -> float:
        value = float(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} {value}: give {low:g} to {high:g} {unit}")
        return value

    return number


def emit_json(doc: Any, *, indent: int | None = 2) -> None:
    """One JSON document on stdout (``--json``: machine-readable output, nothing else on stdout)."""
    sys.stdout.write(json.dumps(doc, indent=indent, default=str) + "\n")
    sys.stdout.flush()


async def publish_control(nc: Any, subject: str, data: bytes, *, timeout: float, what: str) -> None:
    """Store an operator's control event (``what``, for the error) in the stream; a CliError that points at the
    operator's rights when the bus does not take it."""
    try:
        await nc.jetstream().publish(subject, data, timeout=timeout)
    except Exception as exc:
        raise CliError(
            f"the bus did not take {what} ({type(exc).__name__}: {exc or 'no answer'}); does this identity (--creds) "
            "have the operator's rights? (docs/security.md)"
        ) from exc


async def until_applied(applied: Callable[[], Awaitable[bool]], *, timeout: float, what: str) -> None:
    """Poll the record the orchestrator writes until ``applied()``, at most ``timeout`` seconds; then a CliError
    saying the orchestrator did not ``what``."""
    deadline = time.monotonic() + timeout
    while not await applied():
        if time.monotonic() > deadline:
            raise CliError(
                f"the orchestrator did not {what} within {timeout:g} s (is one running? `timeslice status` names the "
                "leader)"
            )
        await asyncio.sleep(0.05)  # polling the record the orchestrator writes, bounded by the deadline
