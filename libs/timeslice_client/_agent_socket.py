"""The agent's node-local Unix socket: how a job proves to its node's agent which process it is.

The agent serves a Unix stream socket (path: ``--socket`` / ``$TIMESLICE_AGENT_SOCKET``, default
:func:`default_socket_path`). The kernel tells the agent who connected (``SO_PEERCRED``: pid, uid, gid), which no
caller can forge. One exchange per connection, one JSON line each way, at most :data:`MAX_LINE` bytes, within
:data:`EXCHANGE_TIMEOUT_S`:

    job   → agent   {"job": "<job id>", "pid": <the caller's pid as it sees it>}
    agent → job     {"ok": true, "token": "<32 hex digits>", "pid": <the caller's pid as the agent sees it>,
                     "expires_s": 30.0}
                    or {"ok": false, "error": "<what went wrong and what to do>"}

The token is random, single-use, bound to that job id and to the caller's credentials, and expires after
``expires_s``. The job then registers over the bus (``ts.rpc.agent.<node>.register.<job>``, where permissions let
only that job publish) with ``RegisterJob.proof`` set to the token: the agent then knows the bus identity (the
subject's job) and the process (the socket's peer) belong together, and acts only on that process, its
descendants and its own process group (see docs/security.md). The ``pid`` the caller sends is its own view: where
it differs from the agent's (the job runs in a pid namespace of its own, e.g. a pod without ``hostPID``), the agent
translates the registration's pids from the job's namespace.

A caller that cannot reach the socket may still register backends that touch no process (``noop``,
``app_channel``, ``app_endpoint``); a registration with ``freeze`` or ``cuda`` is refused without a proof.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Annotated, Final

import msgspec

from ._bounds import Id

__all__ = [
    "EXCHANGE_TIMEOUT_S",
    "MAX_LINE",
    "SOCKET_ENV",
    "TOKEN_TTL_S",
    "Answer",
    "Hello",
    "ProofUnavailable",
    "candidate_socket_paths",
    "default_socket_path",
    "prove",
]

SOCKET_ENV: Final = "TIMESLICE_AGENT_SOCKET"
MAX_LINE: Final = 512  # bytes of one message, newline included
EXCHANGE_TIMEOUT_S: Final = 2.0  # the agent's bound on one connection; the caller's default too
TOKEN_TTL_S: Final = 30.0
MAX_TOKEN: Final = 128


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    job: Id
    pid: Annotated[int, msgspec.Meta(ge=0, le=2**31)]


class Answer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ok: bool
    token: Annotated[str, msgspec.Meta(max_length=MAX_TOKEN)] | None = None
    pid: int | None = None
    expires_s: float | None = None
    error: Annotated[str, msgspec.Meta(max_length=400)] | None = None


class ProofUnavailable(Exception):
    """No proof could be had from the agent's socket; the message says where it looked and why."""


def _runtime_dirs() -> list[str]:
    """The directories an agent's socket is looked for in, most specific last: ``/run/timeslice`` (an agent run as
    root), ``$XDG_RUNTIME_DIR/timeslice`` and ``/tmp/timeslice-<uid>`` (an agent run as the job's user)."""
    dirs = ["/run/timeslice"]
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        dirs.append(f"{xdg}/timeslice")
    dirs.append(f"/tmp/timeslice-{os.getuid()}")  # made 0755 by the agent, which checks its owner
    return dirs


def _named(template: str, node: str) -> str:
    return template.replace("{node}", node)


def default_socket_path(node: str) -> str:
    """Where an agent serves its socket when neither ``--socket`` nor ``$TIMESLICE_AGENT_SOCKET`` says:
    ``/run/timeslice/agent-<node>.sock`` as root, else under ``$XDG_RUNTIME_DIR/timeslice`` or
    ``/tmp/timeslice-<uid>``. ``$TIMESLICE_AGENT_SOCKET`` may hold ``{node}``, replaced by the node id."""
    if env := os.environ.get(SOCKET_ENV):
        return _named(env, node)
    if os.geteuid() == 0:
        base = "/run/timeslice"
    elif xdg := os.environ.get("XDG_RUNTIME_DIR"):
        base = f"{xdg}/timeslice"
    else:
        base = f"/tmp/timeslice-{os.getuid()}"
    return f"{base}/agent-{node}.sock"


def candidate_socket_paths(node: str) -> list[str]:
    """Where a job looks for its node's agent: ``$TIMESLICE_AGENT_SOCKET`` alone when set, else every default
    place (an agent run as root or as this user), in that order."""
    if env := os.environ.get(SOCKET_ENV):
        return [_named(env, node)]
    return [f"{d}/agent-{node}.sock" for d in _runtime_dirs()]


def _first_existing(paths: list[str]) -> str | None:
    return next((p for p in paths if Path(p).exists()), None)


async def prove(job: str, node: str, *, path: str | None = None, timeout: float = EXCHANGE_TIMEOUT_S) -> str:
    """A proof token for ``job`` from the agent of ``node`` (``path``: its socket; default: the first of
    :func:`candidate_socket_paths` that exists). Raises :class:`ProofUnavailable` saying why there is none."""
    paths = [path] if path else candidate_socket_paths(node)
    found = _first_existing(paths)
    if found is None:
        raise ProofUnavailable(f"no agent socket at {' or '.join(paths)} (set {SOCKET_ENV} to the agent's --socket)")
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(found, limit=MAX_LINE)
            try:
                writer.write(msgspec.json.encode(Hello(job=job, pid=os.getpid())) + b"\n")
                await writer.drain()
                line = await reader.readline()
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except (OSError, TimeoutError, ValueError) as exc:  # ValueError: an answer longer than MAX_LINE
        raise ProofUnavailable(f"the agent socket {found} did not answer ({exc.__class__.__name__}: {exc})") from exc
    try:
        answer = msgspec.json.decode(line, type=Answer)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProofUnavailable(f"the agent socket {found} answered garbage ({exc})") from exc
    if not answer.ok or not answer.token:
        raise ProofUnavailable(f"the agent socket {found} refused: {answer.error}")
    return answer.token
