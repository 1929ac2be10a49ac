"""The ``timeslice`` command: its parser, the flags every command takes, logging, and how it ends.

Every command ends in one of three ways: its exit code; one line on stderr and exit code 2 for any error
(``TimeSliceError``, a service's error, a refused connection, a missing package: the line says what to do;
``--debug`` adds the traceback); or quietly when its reader goes away (``timeslice events | head``: exit 141,
as a process killed by SIGPIPE).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ._common import CliError

__all__ = ["build_parser", "main"]

_LEVELS = ("debug", "info", "warning", "error", "critical")

#: The command groups, in the order ``--help`` lists them: (module, the commands it adds).
_COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("_up", ("up", "down", "orchestrator")),
    ("demo", ("demo",)),
    ("_status", ("status",)),
    ("_events", ("events",)),
    ("_replay", ("replay",)),
    ("_advise", ("advise",)),
    ("_check", ("check",)),
    ("_health", ("health",)),
    ("_faults", ("clear-fault",)),
    ("_policy", ("set-policy",)),
    ("_agent", ("agent", "agent-status", "agent-clear-fault")),
    ("_auth", ("auth",)),
)

#: A missing module and the distribution (or extra) that brings it.
_PROVIDERS = {
    "torch": "pip install 'timeslice-server[torch]' (or your own torch build)",
    "uvloop": "pip install 'timeslice-server[fast]'",
    "pynvml": "pip install 'timeslice-server[gpu]'",
    "cuda": "pip install 'timeslice-server[gpu]'",
}


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


class _Version(argparse.Action):
    """``--version``: one line, as it is (argparse's own wraps it to the terminal)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(_version())
        parser.exit()


def _level(text: str) -> str:
    if text.lower() not in _LEVELS:
        raise argparse.ArgumentTypeError(f"--log-level {text!r}: give one of {', '.join(_LEVELS)}")
    return text.lower()


def _global_flags(p: argparse.ArgumentParser, *, top: bool) -> None:
    """The flags every command takes, before or after its name. Under a command they default to SUPPRESS, so a
    value given before the command is not overwritten by the command's defaults."""
    d: Callable[[Any], Any] = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    g = p.add_argument_group("global flags (before or after the command)")
    g.add_argument(
        "--log-level",
        type=_level,
        default=d(os.environ.get("TIMESLICE_LOG_LEVEL", "info").lower()),
        metavar="LEVEL",
        help=f"log threshold: {', '.join(_LEVELS)} (default $TIMESLICE_LOG_LEVEL, else info)",
    )
    g.add_argument(
        "--debug",
        action="store_true",
        default=d(False),
        help="on an error, show the traceback (and log at debug level)",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    from timeslice_client import __version__

    return (
        f"timeslice {__version__} (timeslice-server {of('timeslice-server')}, timeslice-client "
        f"{of('timeslice-client')})"
    )


def _unavailable(sub: Any, name: str, why: BaseException) -> None:
    """A command that could not load still appears, and says why when run."""
    message = (
        f"`timeslice {name}` cannot load ({type(why).__name__}: {why}); reinstall timeslice-server "
        "(pip install --force-reinstall timeslice-server)"
    )

    async def fail(args: argparse.Namespace) -> int:
        raise CliError(message)

    p = sub.add_parser(name, help=f"(unavailable: {why})")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="ignored: the command cannot load")
    p.set_defaults(func=fail)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    p = _Parser(prog="timeslice", description="Cooperative GPU time-slicing for RL jobs")
    p.add_argument("--version", action=_Version, help="print the versions of timeslice's distributions and exit")
    _global_flags(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for module, names in _COMMANDS:
        try:
            importlib.import_module(f"{__package__}.{module}").register(sub)
        except ImportError as exc:
            for name in names:
                if name not in sub.choices:
                    _unavailable(sub, name, exc)
    from timeslice_client._bus_auth import add_auth_flags

    for name, cmd in sub.choices.items():
        if (
            name != "up"
            and any("--nats-url" in a.option_strings for a in cmd._actions)
            and not any("--creds" in a.option_strings for a in cmd._actions)
        ):
            add_auth_flags(cmd)  # every command that connects to NATS: its identity and TLS (docs/security.md)
        for each in _parsers(cmd):
            _global_flags(each, top=False)
    return p


def _parsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``p`` and every parser below it (``auth job``, ...)."""
    found = [p]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for child in a.choices.values():
                found += _parsers(child)
    return found


def _missing_module(exc: ModuleNotFoundError) -> str:
    name = (exc.name or "").split(".")[0]
    fix = _PROVIDERS.get(name, "pip install timeslice-server (it brings everything the `timeslice` command needs)")
    return f"this needs the Python package {name!r}, which is not installed: {fix}"


def _one_line(exc: BaseException) -> str:
    """An error as the line the command ends with."""
    from timeslice_client.errors import TimeSliceError

    if isinstance(exc, ModuleNotFoundError):
        return _missing_module(exc)
    text = str(exc).strip()
    lines = text.splitlines() or [""]
    more = f" (+{len(lines) - 1} more lines: --debug shows them)" if len(lines) > 1 else ""
    if isinstance(exc, TimeSliceError) or type(exc).__module__.startswith("timeslice_"):
        return lines[0] + more  # ours (OrchestratorError, EmbeddedNatsError, ...): the message says what to do
    if isinstance(exc, OSError) and exc.errno == 98:  # EADDRINUSE
        return (
            f"{exc.strerror or text}: another process (a `timeslice up`?) has the port; stop it "
            "(`timeslice down`) or give this one another port"
        )
    return f"{type(exc).__name__}: {lines[0] or 'no message'}{more}"


def _quiet_stdout() -> None:
    """After a broken pipe: stdout to /dev/null, so the interpreter's final flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``timeslice`` command; returns its exit code."""
    from timeslice_client._bus_auth import auth_from_args, set_process_auth
    from timeslice_client._internal.runner import run

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    debug = bool(args.debug)
    try:
        from timeslice_orchestrator._logging import setup_logging

        setup_logging("debug" if debug else args.log_level)
    except ImportError:
        logging.basicConfig(level=args.log_level.upper())
    try:
        set_process_auth(auth_from_args(args))  # --creds / --tls-*: every connection of this process
        return int(run(args.func(args)))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # every error: one line, never a traceback unless asked
        leaf = _leaf(exc)
        if isinstance(leaf, BrokenPipeError):
            _quiet_stdout()
            return 141
        if isinstance(leaf, KeyboardInterrupt):
            return 130
        _report(leaf, exc, debug)
        return leaf.code if isinstance(leaf, CliError) else 2


def _leaf(exc: BaseException) -> BaseException:
    """The error itself, out of the exception groups a task group wraps it in."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _report(leaf: BaseException, whole: BaseException, debug: bool) -> None:
    if debug:
        import traceback

        traceback.print_exception(whole, file=sys.stderr)
    with contextlib.suppress(OSError):
        print(f"timeslice: {_one_line(leaf)}", file=sys.stderr, flush=True)
