"""Who a connection to NATS is: the credentials file (a NATS ``.creds``: user JWT + seed) and TLS files it uses.

Resolved for every connection (``bus.connect``), first match wins:

1. what the caller passes (``creds=``, ``tls=``: ``TimeSliceClient(..., creds=...)``, ``connect(..., creds=...)``);
2. what this process was told (``set_process_auth``: the ``timeslice`` command's ``--creds``/``--tls-*`` flags);
3. the environment: ``$TIMESLICE_CREDS``, ``$TIMESLICE_TLS_CA``, ``$TIMESLICE_TLS_CERT``, ``$TIMESLICE_TLS_KEY``;
4. for the credentials only: ``nats.creds`` beside the URL file ``timeslice up`` writes (``bus.url_file()``), when
   the connection goes to the servers that file names (or to the default URL). So on a ``timeslice up`` machine,
   local clients need no flag at all.

Only paths travel in flags and the environment, never a secret; nats-py reads the file when it connects. A
restricted user may only receive on its own inbox prefix: it is derived from the credential's name
(``job:J`` -> ``_INBOX_job_J``), as ``timeslice auth`` issues it.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import ssl
import stat
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, TypeAlias

from .errors import CredentialsError

__all__ = [
    "BusAuth",
    "CredentialsError",
    "CredsPath",
    "TlsFiles",
    "TlsOption",
    "add_auth_flags",
    "auth_from_args",
    "creds_identity",
    "set_process_auth",
]

log = logging.getLogger("timeslice.bus")

CREDS_ENV: Final = "TIMESLICE_CREDS"
_TLS_ENV: Final = {"ca": "TIMESLICE_TLS_CA", "cert": "TIMESLICE_TLS_CERT", "key": "TIMESLICE_TLS_KEY"}
LOCAL_CREDS_NAME: Final = "nats.creds"


@dataclass(frozen=True)
class TlsFiles:
    """TLS to NATS: the CA that signed the servers' certificates, and for mutual TLS this client's certificate and
    key (PEM files). Any may be None: no CA means the system's; no cert means no client certificate."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise CredentialsError(
                self.cert or self.key or "",
                "a client certificate needs its key and the key its certificate: give both --tls-cert and --tls-key",
            )

    def context(self) -> ssl.SSLContext:
        for p in (self.ca, self.cert, self.key):
            if p is not None and not p.is_file():
                raise CredentialsError(p, "no such file")
        ctx = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        if self.cert is not None and self.key is not None:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx

    @property
    def empty(self) -> bool:
        return self.ca is None and self.cert is None


TlsOption: TypeAlias = "TlsFiles | ssl.SSLContext"
"""TLS to NATS: the files (``TlsFiles``) or a ready ``ssl.SSLContext``."""
CredsPath: TypeAlias = "str | os.PathLike[str]"
"""The path of a NATS ``.creds`` file."""


@dataclass(frozen=True)
class BusAuth:
    """A connection's credentials file and TLS files; ``source`` says where the credentials were found."""

    creds: Path | None = None
    tls: TlsFiles | None = None
    source: str = ""


_process: BusAuth | None = None


def set_process_auth(auth: BusAuth | None) -> None:
    """What every connection of this process uses unless its caller passes its own (the CLI's flags)."""
    global _process
    _process = auth


def _path(value: str | os.PathLike[str] | None) -> Path | None:
    if value is None or str(value).strip() == "":
        return None
    return Path(value).expanduser()


def _env_tls() -> TlsFiles | None:
    ca, cert, key = (_path(os.environ.get(_TLS_ENV[k])) for k in ("ca", "cert", "key"))
    if ca is None and cert is None and key is None:
        return None
    return TlsFiles(ca, cert, key)


def resolve(
    creds: CredsPath | None,
    tls: TlsOption | None,
    *,
    servers: list[str],
    advertised: list[str] | None,
    local_creds: Path,
) -> tuple[BusAuth, ssl.SSLContext | None]:
    """The credentials and TLS context of one connection (see the module's docstring for the order).
    ``advertised``: the servers the URL file names (None: no URL file); ``local_creds``: the file beside it."""
    auth = BusAuth(_path(creds), tls if isinstance(tls, TlsFiles) else None, "given" if creds else "")
    proc = _process or BusAuth()
    if auth.creds is None and proc.creds is not None:
        auth = replace(auth, creds=proc.creds, source="--creds")
    if auth.creds is None and (env := _path(os.environ.get(CREDS_ENV))) is not None:
        auth = replace(auth, creds=env, source=f"${CREDS_ENV}")
    if auth.creds is None and advertised is not None and set(servers) <= set(advertised) and local_creds.is_file():
        auth = replace(auth, creds=local_creds, source="beside the URL file of `timeslice up`")
    if tls is None:
        auth = replace(auth, tls=proc.tls or _env_tls())
    context = (
        tls
        if isinstance(tls, ssl.SSLContext)
        else (auth.tls.context() if auth.tls is not None and not auth.tls.empty else None)
    )
    return auth, context


def creds_identity(path: Path) -> str:
    """The ``name`` claim of the user JWT in the ``.creds`` file ``path`` (``job:J``, ``agent:N``, ``reader``…);
    raises ``CredentialsError`` when the file is not one. The signature is the server's to check."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise CredentialsError(
            path,
            f"{exc.strerror or exc.__class__.__name__} (give the path of a .creds file "
            "from `timeslice auth`, with --creds or $TIMESLICE_CREDS)",
        ) from None
    try:
        jwt = text.split("-----BEGIN NATS USER JWT-----", 1)[1].split("------END NATS USER JWT------", 1)[0].strip()
        body = jwt.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        name = claims.get("name")
        if "-----BEGIN USER NKEY SEED-----" not in text or not isinstance(name, str):
            raise ValueError(name)
    except (IndexError, ValueError, UnicodeError):
        raise CredentialsError(
            path, "not a NATS user credentials file (a user JWT and its seed, as `timeslice auth` writes them)"
        ) from None
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("credentials file %s can be read by others (mode %o): chmod 600 it", path, mode & 0o777)
    return name


def nats_options(auth: BusAuth, context: ssl.SSLContext | None) -> dict[str, Any]:
    """The nats-py ``connect`` options for ``auth``: the credentials file, its user's own inbox prefix, TLS."""
    opts: dict[str, Any] = {}
    if auth.creds is not None:
        name = creds_identity(auth.creds)
        opts["user_credentials"] = str(auth.creds)
        opts["inbox_prefix"] = "_INBOX_" + "_".join(p for p in name.split(":", 1) if p)
    if context is not None:
        opts["tls"] = context
    return opts


def add_auth_flags(parser: argparse.ArgumentParser) -> None:
    """``--creds``, ``--tls-ca``, ``--tls-cert``, ``--tls-key`` (read by ``auth_from_args``)."""
    g = parser.add_argument_group("NATS identity and TLS")
    g.add_argument(
        "--creds",
        default=None,
        metavar="FILE",
        help=f"NATS user credentials (.creds from `timeslice auth`; default ${CREDS_ENV}, else the "
        f"{LOCAL_CREDS_NAME} `timeslice up` writes beside its URL file)",
    )
    g.add_argument(
        "--tls-ca",
        default=None,
        metavar="FILE",
        help=f"PEM CA of the NATS servers' certificates (default ${_TLS_ENV['ca']}; tls:// URLs)",
    )
    g.add_argument(
        "--tls-cert",
        default=None,
        metavar="FILE",
        help=f"PEM client certificate for mutual TLS to NATS (default ${_TLS_ENV['cert']})",
    )
    g.add_argument(
        "--tls-key", default=None, metavar="FILE", help=f"PEM key of --tls-cert (default ${_TLS_ENV['key']})"
    )


def auth_from_args(args: argparse.Namespace) -> BusAuth | None:
    """What the flags of ``add_auth_flags`` name (None: none given). TLS flags complete the environment's."""
    creds = _path(getattr(args, "creds", None))
    given = {k: _path(getattr(args, f"tls_{k}", None)) for k in ("ca", "cert", "key")}
    if creds is None and not any(given.values()):
        return None
    tls = None
    if any(given.values()):
        env = _env_tls() or TlsFiles()
        tls = TlsFiles(given["ca"] or env.ca, given["cert"] or env.cert, given["key"] or env.key)
    return BusAuth(creds, tls, "--creds" if creds else "")
