"""What the commands share: the error they end with, the ``--nats-url`` flag, JSON on stdout."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from timeslice_client.bus import nats_url_arg
from timeslice_client.errors import TimeSliceError

__all__ = ["CliError", "add_nats_flag", "emit_json"]


class CliError(TimeSliceError):
    """A command cannot do what it was asked; the message says why and what to do. Ends the command in one line on
    stderr and exit code 2, as every error of the ``timeslice`` command (``--debug``: with the traceback)."""

    def __init__(self, message: str, *, code: int = 2) -> None:
        self.code = code
        super().__init__(message)


def add_nats_flag(p: argparse.ArgumentParser) -> None:
    """``--nats-url`` (the bus's identity and TLS flags are added to every command that has it)."""
    p.add_argument(
        "--nats-url",
        type=nats_url_arg,
        default=None,
        help="NATS server(s), comma-separated (default: $TIMESLICE_NATS_URL or what `timeslice up` wrote)",
    )


def emit_json(doc: Any, *, indent: int | None = 2) -> None:
    """One JSON document on stdout (``--json``: machine-readable output, nothing else on stdout)."""
    sys.stdout.write(json.dumps(doc, indent=indent, default=str) + "\n")
    sys.stdout.flush()
