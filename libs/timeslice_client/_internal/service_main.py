"""What the services' own ``python -m`` entry points share (the orchestrator's, the agent's): the ``--log-level``
and ``--nats-url`` flags (the latter the ``timeslice`` command's too), and how a run ends as an exit code.

Both answer alike so that a supervisor (systemd, Kubernetes) reads them alike: 130 on Ctrl-C, 2 and one line on
stderr for a refusal that says what to do (a ``TimeSliceError``), 1 and the traceback in the log for anything else.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any

from timeslice_client.bus import nats_url_arg
from timeslice_client.errors import TimeSliceError

from .runner import run

__all__ = ["add_log_level_flag", "add_nats_url_flag", "exit_code"]


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` (default ``$TIMESLICE_LOG_LEVEL``, else info), lower-cased."""
    parser.add_argument(
        "--log-level",
        default=os.environ.get("TIMESLICE_LOG_LEVEL", "info"),
        choices=("debug", "info", "warning", "error", "critical"),
        type=str.lower,
        help="log threshold (default $TIMESLICE_LOG_LEVEL, else info)",
    )


def add_nats_url_flag(parser: argparse.ArgumentParser, *, example: str | None = None) -> None:
    """``--nats-url``, checked (``bus.nats_url_arg``), the same flag everywhere a bus is named; ``example``: a list
    of servers the help shows."""
    such_as = f", e.g. {example}" if example else ""
    parser.add_argument(
        "--nats-url",
        type=nats_url_arg,
        default=None,
        help=f"NATS server(s), comma-separated{such_as} (default: $TIMESLICE_NATS_URL or what `timeslice up` wrote)",
    )


def exit_code(
    main: Coroutine[Any, Any, int],
    service: str,
    log: logging.Logger,
    *,
    logged: tuple[type[BaseException], ...] = (),
) -> int:
    """Run ``main`` (``runner.run``) and return its exit code, or the one its end calls for. ``logged``: errors
    logged with their traceback even where they are a ``TimeSliceError`` (the service's own failure, whose cause
    is in the log)."""
    try:
        return int(run(main))
    except KeyboardInterrupt:
        return 130
    except logged:
        log.exception("the %s stopped on an error", service)
        return 1
    except TimeSliceError as exc:  # a refusal that says what to do: one line
        print(f"timeslice {service}: {exc}", file=sys.stderr)
        return 2
    except Exception:
        log.exception("the %s stopped on an error", service)
        return 1
