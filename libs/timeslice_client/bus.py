"""Connecting to NATS: the part of the bus a job shares with the services.

Public (``__all__``), because a job meets it: ``connect`` and its argument types (``CredsPath``, ``TlsOption``,
``TlsFiles``, ``BusAuth``), the URL rules (``NatsUrl``, ``resolve_nats_url``, ``default_nats_url``, ``parse_servers``,
``InvalidNatsUrl``, ``url_file``), ``identity_of`` (a second connection as the first one is) and ``kv_keys`` (a
bucket's keys, listed reliably). ``nats_url_arg`` is the ``--nats-url`` type of every command, and of a job's own
``argparse`` where it takes one.

A NATS URL is one server or several, comma-separated (``nats://a:4222,nats://b:4222``): ``parse_servers``
reads and checks it, and every command, service and client goes through it (via ``connect``).

``connect`` also picks the connection's identity (a NATS ``.creds`` file) and TLS files: given, set for the process
by the CLI's flags, from ``$TIMESLICE_CREDS``/``$TIMESLICE_TLS_*``, or the credentials ``timeslice up`` writes beside
its URL file (``_bus_auth``; docs/security.md).

Laying out the stream and the buckets (``ensure_bus``, ``BusConfig``) is the services' alone:
``timeslice_client._internal.bus_layout``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nats.aio.client import Client as NATS

from . import _bus_auth
from ._bus_auth import BusAuth, CredsPath, TlsFiles, TlsOption
from ._renamed import renamed_keywords
from .errors import BusUnreachable, InvalidNatsUrl, Unavailable

__all__ = [
    "BusAuth",
    "CredsPath",
    "InvalidNatsUrl",
    "NatsUrl",
    "TlsFiles",
    "TlsOption",
    "connect",
    "default_nats_url",
    "identity_of",
    "kv_keys",
    "nats_url_arg",
    "parse_servers",
    "resolve_nats_url",
    "url_file",
]

log = logging.getLogger("timeslice.bus")

_URL_FILE_ENV = "TIMESLICE_URL_FILE"
_URL_ENV = "TIMESLICE_NATS_URL"
_DEFAULT_URL = "nats://127.0.0.1:4222"


def url_file() -> Path:
    """Where ``timeslice up`` advertises its NATS URL for clients on this host."""
    env = os.environ.get(_URL_FILE_ENV)
    return Path(env) if env else Path.home() / ".timeslice" / "nats.url"


def local_creds_file() -> Path:
    """Where ``timeslice up`` leaves the credentials of this machine's user: beside its URL file."""
    return url_file().with_name(_bus_auth.LOCAL_CREDS_NAME)


def _advertised() -> list[str] | None:
    """The servers the URL file names (None: no readable URL file)."""
    try:
        lines = url_file().read_text().split()
        return parse_servers(",".join(x.strip(",") for x in lines if x.strip(","))) if lines else None
    except (OSError, InvalidNatsUrl):
        return None


def default_nats_url() -> str:
    """``$TIMESLICE_NATS_URL``, else the URL ``timeslice up`` advertised, else ``nats://127.0.0.1:4222`` (the
    NATS default; ``timeslice up`` takes port 4222 unless it is in use). Either may name several servers,
    comma-separated (the file: also one a line); ``parse_servers`` reads it. ``resolve_nats_url`` also says which."""
    return _default_with_source()[0]


def _default_with_source() -> tuple[str, str]:
    env = os.environ.get(_URL_ENV)
    if env and env.strip():
        return env.strip(), f"from ${_URL_ENV}"
    path = url_file()
    try:
        lines = path.read_text().split()
    except OSError:
        return _DEFAULT_URL, (
            f"the default: no URL was given, ${_URL_ENV} is not set and no `timeslice up` advertises one in {path}"
        )
    text = ",".join(x.strip(",") for x in lines if x.strip(","))
    if not text:
        return _DEFAULT_URL, f"the default: no URL was given, ${_URL_ENV} is not set and {path} is empty"
    return text, f"advertised by `timeslice up` in {path}"


@dataclass(frozen=True, slots=True)
class NatsUrl:
    """The servers to connect to, checked, and where they came from (``source``: ``"as given"``, ``"from
    $TIMESLICE_NATS_URL"``, ``"advertised by `timeslice up` in PATH"`` or ``"the default: ..."``)."""

    servers: tuple[str, ...]
    source: str

    @property
    def text(self) -> str:
        return ",".join(self.servers)


def resolve_nats_url(url: str | Sequence[str] | NatsUrl | None = None) -> NatsUrl:
    """``url`` checked (``parse_servers``), or, when None or empty, ``default_nats_url()``'s, with where it came
    from. Raises ``InvalidNatsUrl`` naming the bad entry and its source."""
    if isinstance(url, NatsUrl):
        return url
    if url:
        return NatsUrl(tuple(parse_servers(url)), "as given")
    text, source = _default_with_source()
    return NatsUrl(tuple(parse_servers(text, source=source)), source)


def _advice(source: str) -> str:
    """What to do when no server of a URL from ``source`` answers."""
    path = url_file()
    up = (
        f"`timeslice up` starts NATS and writes its URL to {path} (${_URL_FILE_ENV} moves it), where clients "
        f"given no URL and no ${_URL_ENV} find it"
    )
    if source.startswith("advertised"):
        return (
            f"the `timeslice up` that wrote {path} is not running (or not reachable from here): start it again "
            f"(`timeslice up`), or give the server's URL (nats_url=, --nats-url or ${_URL_ENV})"
        )
    if source.startswith("the default"):
        return f"start one with `timeslice up`, or give the server's URL (nats_url=, --nats-url or ${_URL_ENV}); {up}"
    return f"check that NATS runs there and is reachable; {up}"


_SCHEMES = ("nats", "tls", "ws", "wss")


def parse_servers(text: str | Sequence[str], *, source: str | None = None) -> list[str]:
    """The servers named by ``text``: one NATS URL or several, comma-separated (a sequence: each item so).

    Each entry needs a scheme ``nats``, ``tls``, ``ws`` or ``wss`` (none: ``nats://``), a host and, if given, a
    port in 1..65535 (none: the client's default, 4222 for nats/tls); ``nats``/``tls`` and ``ws``/``wss`` do not
    mix. Raises ``InvalidNatsUrl`` naming the first bad entry (and ``source``, where the text came from).
    Credentials in an entry are kept as they are."""
    items = [text] if isinstance(text, str) else list(text)
    whole = ",".join(items)
    out: list[str] = []
    try:
        for item in items:
            for raw in item.split(","):
                out.append(_check_server(raw.strip(), whole))
        if not out:
            raise InvalidNatsUrl("", "no server given", whole)
        kinds = {urlsplit(u).scheme in ("ws", "wss") for u in out}
        if len(kinds) > 1:
            raise InvalidNatsUrl(
                next(u for u in out if urlsplit(u).scheme in ("ws", "wss")),
                "websocket and plain (nats/tls) servers cannot be mixed in one list",
                whole,
            )
    except InvalidNatsUrl as exc:
        if source is None:
            raise
        raise InvalidNatsUrl(exc.entry, exc.reason, exc.text, source) from None
    return out


def _check_server(entry: str, whole: str) -> str:
    if not entry:
        raise InvalidNatsUrl(entry, "empty entry (two commas in a row, or one at an end)", whole)
    url = entry if "://" in entry else f"nats://{entry}"
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when it is not a number in 0..65535
    except ValueError as exc:
        raise InvalidNatsUrl(entry, f"cannot read it ({exc})", whole) from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise InvalidNatsUrl(entry, f"unknown scheme {parts.scheme!r} (use nats, tls, ws or wss)", whole)
    if not parts.hostname:
        raise InvalidNatsUrl(entry, "no host", whole)
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        raise InvalidNatsUrl(entry, "the port must be 1..65535", whole)
    if scheme in ("nats", "tls") and parts.path not in ("", "/"):
        raise InvalidNatsUrl(entry, f"a {scheme}:// URL has no path (got {parts.path!r})", whole)
    if parts.query or parts.fragment:
        raise InvalidNatsUrl(entry, "a NATS URL has no query or fragment", whole)
    return url


def nats_url_arg(text: str) -> str:
    """``argparse`` type of ``--nats-url``: the servers checked by ``parse_servers``, joined with commas again."""
    try:
        return ",".join(parse_servers(text))
    except InvalidNatsUrl as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


async def _quiet_error_cb(exc: Exception) -> None:
    log.debug("nats connection error: %r", exc)


@renamed_keywords(connect_timeout="connect_timeout_s")
async def connect(
    url: str | Sequence[str] | NatsUrl | None = None,
    *,
    name: str = "timeslice",
    connect_timeout_s: float = 5.0,
    creds: CredsPath | None = None,
    tls: TlsOption | None = None,
    **kwargs: Any,
) -> NATS:
    """Connect to NATS with reconnects on, a quiet error callback and a clear error when nobody answers.
    ``url``: one server, or several (comma-separated, or a sequence; tried in turn, and again on reconnect), read
    by ``parse_servers`` (``InvalidNatsUrl`` names a bad one); default ``default_nats_url()`` (see
    ``resolve_nats_url``). ``connect_timeout_s`` bounds the whole first connection (each server's attempt gets its
    share); a refusal by every server (nothing listens on the port, or the host name does not resolve) ends it at
    once. Both raise ``BusUnreachable`` naming the URL, where it came from and what to do.
    ``creds``: a NATS ``.creds`` file; ``tls``: the CA / client certificate files (or a ready ``SSLContext``);
    None: found as ``timeslice_client._bus_auth`` says (the CLI's flags, ``$TIMESLICE_CREDS``/``$TIMESLICE_TLS_*``,
    the credentials beside ``timeslice up``'s URL file). Raises ``CredentialsError`` for an unusable file."""
    target = resolve_nats_url(url)
    servers = list(target.servers)
    url = target.text
    auth, context = _bus_auth.resolve(
        creds, tls, servers=servers, advertised=_advertised(), local_creds=local_creds_file()
    )
    errors: list[Exception] = []
    refusals: list[Exception] = []  # definite failures in a row, while the first connection is being made
    refused = asyncio.Event()  # every server refused: give up now rather than at the timeout
    user_cb = kwargs.pop("error_cb", _quiet_error_cb)

    async def error_cb(exc: Exception) -> None:
        if not errors:  # the first refusal says why a connection never came up
            errors.append(exc)
        if not refused.is_set() and not nc.is_connected:
            if _definite(exc):
                refusals.append(exc)
                if len(refusals) >= len(servers):  # tried in turn: each one refused
                    refused.set()
            else:
                refusals.clear()
        await user_cb(exc)

    opts: dict[str, Any] = {
        "name": name,
        "connect_timeout": connect_timeout_s / len(servers),
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "error_cb": error_cb,
        **_bus_auth.nats_options(auth, context),
    }
    opts.update(kwargs)
    who = f"as {auth.creds} ({auth.source})" if auth.creds is not None else "without credentials"
    nc = NATS()
    started = time.monotonic()
    try:
        # With unlimited reconnects nats-py retries a first connection forever: bound it here (docs/nats.md).
        await _first_connection(nc, servers, opts, refused, connect_timeout_s)
    except Exception as exc:
        first = errors[0] if errors else exc
        reason = f"{first.__class__.__name__}: {first}; tried {who}" if str(first) else f"tried {who}"
        hint = _hint(errors or [exc], auth)
        raise BusUnreachable(
            url,
            target.source,
            reason,
            refused=refused.is_set(),
            after_s=None if refused.is_set() or not isinstance(exc, TimeoutError) else time.monotonic() - started,
            advice=hint.removeprefix("; ") or _advice(target.source),
        ) from exc
    errors.clear()
    _identities[nc] = {"creds": auth.creds, "tls": context}
    return nc


async def _first_connection(
    nc: NATS, servers: list[str], opts: dict[str, Any], refused: asyncio.Event, timeout: float
) -> None:
    """``nc.connect``, given up (TimeoutError) after ``timeout`` or (ConnectionRefusedError) once ``refused`` is set;
    a connection given up is closed."""
    trying = asyncio.ensure_future(nc.connect(servers, **opts))
    given_up = asyncio.ensure_future(refused.wait())
    try:
        async with asyncio.timeout(timeout):
            await asyncio.wait((trying, given_up), return_when=asyncio.FIRST_COMPLETED)
        if not trying.done():
            raise ConnectionRefusedError("every server refused the connection")
        trying.result()
    finally:
        given_up.cancel()
        if not trying.done() or trying.cancelled() or trying.exception() is not None:
            trying.cancel()
            with contextlib.suppress(BaseException):
                await trying
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1):
                    await nc.close()


def _definite(exc: Exception) -> bool:
    """A connection attempt that failed for good, not for want of time: nothing listens there, or no such host."""
    return isinstance(exc, ConnectionRefusedError | socket.gaierror) or (
        isinstance(exc, OSError) and exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH)
    )


_identities: weakref.WeakKeyDictionary[NATS, dict[str, Any]] = weakref.WeakKeyDictionary()


def identity_of(nc: NATS) -> dict[str, Any]:
    """``connect``'s ``creds``/``tls`` arguments that connect another connection as ``nc`` is (made by ``connect``;
    else empty: found as for any connection). For a second connection of one component (a workload's own)."""
    return dict(_identities.get(nc, {}))


def _hint(errors: Sequence[Exception], auth: BusAuth) -> str:
    text = " ".join(str(e).lower() for e in errors)
    if "authorization" not in text and "authentication" not in text:
        return ""
    if auth.creds is None:
        return (
            "; the server wants credentials: give --creds FILE or $TIMESLICE_CREDS (`timeslice auth job|agent|"
            "reader|admin ...` issues them; docs/security.md)"
        )
    return (
        "; the server refused these credentials (expired, revoked, or issued by another operator): issue new "
        "ones with `timeslice auth` against that server's auth dir"
    )


async def kv_keys(nc: NATS, bucket: str, *, under: str | None = None, timeout: float = 5.0) -> list[str]:
    """The keys of KV ``bucket`` (only those below the dotted prefix ``under``), sorted: read from the bucket
    stream's subject index, one request per 100,000 keys.

    Use this, not nats-py's ``KeyValue.keys()``: that one can miss keys, since its watcher may announce the end
    of the listing before it has processed entries the server already sent (1 wrong list in 300 calls on the
    development machine; docs/nats.md). A deleted key keeps its delete marker and so is listed: read values with
    ``get()`` and skip ``KeyNotFoundError`` (of which ``KeyDeletedError`` is a kind).

    Raises ``Unavailable`` when the server does not answer, or answers with an error (no such bucket)."""
    head = f"$KV.{bucket}."
    flt = f"{head}{under}.>" if under else f"{head}>"
    keys: list[str] = []
    while True:
        req = json.dumps({"subjects_filter": flt, "offset": len(keys)}).encode()
        try:
            msg = await nc.request(f"$JS.API.STREAM.INFO.KV_{bucket}", req, timeout=timeout)
            info: dict[str, Any] = json.loads(msg.data)
        except Exception as exc:
            raise Unavailable(
                f"listing the keys of bucket {bucket!r} failed ({exc.__class__.__name__})", after_s=timeout
            ) from exc
        if "error" in info:
            err = info["error"]
            raise Unavailable(f"listing the keys of bucket {bucket!r} failed: {err.get('description', err)}")
        page = list((info.get("state") or {}).get("subjects") or {})
        keys.extend(s[len(head) :] for s in page)
        if not page or len(keys) >= int(info.get("total") or 0):
            return sorted(keys)
