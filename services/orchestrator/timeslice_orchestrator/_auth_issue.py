"""Issuing NATS credentials: an operator, a system account and the ``TIMESLICE`` account (decentralized auth,
memory resolver), and user JWTs signed by the account key, written as ``.creds`` files.

The JWTs are written here over ``nkeys`` (ed25519), in the format of NATS's own ``jwt`` library (v2). The PyPI
package ``nats-jwt`` (0.2.2) was tried first: its account limits write ``memory_storage`` where nats-server
reads ``mem_storage`` (memory streams then fail with "insufficient resources"), and its response permission
writes ``max_msgs``/``expires`` where the server reads ``max``/``ttl``, so a user could not answer requests.
A JWT is ``b64url(header).b64url(claims).b64url(ed25519 signature)``; the claims' ``jti`` is the base32 of
SHA-512/256 over the claims without it, as the Go library computes it.

The auth directory ``D`` (mode 0700, every file 0600):
``operator.nk``/``operator.jwt``, ``sys.nk``/``sys.jwt``, ``account.nk``/``account.jwt``, ``account.pub`` (the
account's public key: what verifies a user JWT, e.g. in the gRPC shim), ``revocations.json``,
``issued.jsonl`` (one line per credential issued: user key, name, times; no secret) and ``nats-auth.conf``,
the snippet nats-server loads (``include``, or ``-c``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import nkeys
from nacl.signing import VerifyKey

from ._auth_perms import ROLES, permissions
from ._errors import AuthError

__all__ = ["ACCOUNT", "AuthDir", "AuthError", "Issued", "creds_text", "decode_jwt", "parse_ttl", "write_private"]

ACCOUNT: Final = "TIMESLICE"
_HEADER: Final = {"typ": "JWT", "alg": "ed25519-nkey"}
_UNLIMITED: Final = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
}
_JETSTREAM: Final = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_jwt(claims: dict[str, Any], signer: nkeys.KeyPair, *, now: int | None = None) -> str:
    """``claims`` (``sub``, ``name``, ``nats`` …) issued and signed by ``signer``."""
    body = {k: v for k, v in claims.items() if k != "jti"}
    body["iat"] = int(time.time()) if now is None else now
    body["iss"] = signer.public_key.decode()
    digest = hashlib.new("sha512_256", json.dumps(body, separators=(",", ":")).encode()).digest()
    body = {"jti": base64.b32encode(digest).rstrip(b"=").decode(), **body}
    signing_input = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(body, separators=(',', ':')).encode())}"
    return f"{signing_input}.{_b64(signer.sign(signing_input.encode()))}"


def decode_jwt(token: str, *, issuer: str | None = None) -> dict[str, Any]:
    """The claims of ``token``; with ``issuer`` (a public nkey) its signature is checked against that key."""
    try:
        head, body, sig = token.strip().split(".")
        claims: dict[str, Any] = json.loads(_unb64(body))
        if issuer is not None:
            if claims.get("iss") != issuer:
                raise ValueError(f"issued by {claims.get('iss')!r}, not {issuer!r}")
            _verify_key(issuer, nkeys.PREFIX_BYTE_ACCOUNT).verify(f"{head}.{body}".encode(), _unb64(sig))
    except Exception as exc:
        raise AuthError(f"not a valid NATS JWT ({exc.__class__.__name__}: {exc})") from None
    return claims


def _public_key_bytes(key: str, prefix: int) -> bytes:
    """The 32 raw bytes of a public nkey (base32 of prefix byte, key, CRC-16); ValueError when it is not one."""
    try:
        raw = base64.b32decode(key + "=" * (-len(key) % 8))
    except Exception:
        raise ValueError(f"{key!r} is not base32") from None
    if len(raw) != 35 or raw[0] != prefix or nkeys.crc16(bytearray(raw[:-2])) != int.from_bytes(raw[-2:], "little"):
        raise ValueError(f"{key!r} is not a public nkey of this kind")
    return raw[1:-2]


def _verify_key(key: str, prefix: int) -> VerifyKey:
    return VerifyKey(_public_key_bytes(key, prefix))


def creds_text(jwt: str, seed: bytes) -> str:
    """A NATS ``.creds`` file: the user JWT and its seed, as ``nsc`` writes them."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed.decode()}\n"
        "------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600), replacing it atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask or an older file said
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


_TTL_RE: Final = re.compile(r"(\d+)([smhdw])")
_UNIT_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_ttl(text: str) -> int:
    """``30d``, ``12h``, ``90m``, ``3600s``, ``2w`` (or several, ``1d12h``) as seconds."""
    t = text.strip().lower()
    parts = _TTL_RE.findall(t)
    if not t or "".join(n + u for n, u in parts) != t or not parts:
        raise ValueError(f"--ttl {text!r}: give a duration such as 30d, 12h, 90m or 1d12h")
    seconds = sum(int(n) * _UNIT_S[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f"--ttl {text!r}: the duration must be positive")
    return seconds


@dataclass(frozen=True)
class Issued:
    """A user credential: its JWT, its seed (secret) and public key, and what it was issued as."""

    jwt: str
    seed: bytes
    user_key: str
    name: str
    expires: int | None

    def creds(self) -> str:
        return creds_text(self.jwt, self.seed)


_KEYS: Final = ("operator", "sys", "account")


class AuthDir:
    """The operator's and the account's keys in a directory, and what they sign."""

    def __init__(self, path: Path, operator: nkeys.KeyPair, sys: nkeys.KeyPair, account: nkeys.KeyPair) -> None:
        self.path = path
        self._operator = operator
        self._sys = sys
        self._account = account

    @property
    def account_key(self) -> str:
        """The TIMESLICE account's public key: the issuer of every user JWT."""
        return str(self._account.public_key.decode())

    @classmethod
    def init(cls, path: str | os.PathLike[str]) -> tuple[AuthDir, bool]:
        """Create ``path`` with fresh keys, or reuse the keys already there (never overwritten). True: created."""
        d = Path(path).expanduser()
        present = [k for k in _KEYS if (d / f"{k}.nk").exists()]
        if present:
            if len(present) != len(_KEYS):
                missing = [f"{k}.nk" for k in _KEYS if k not in present]
                raise AuthError(
                    f"auth dir {d} is incomplete (missing {', '.join(missing)}); restore it from a "
                    "backup, or move it away and run `timeslice auth init` again (every credential "
                    "issued from it must then be issued again)",
                    path=d,
                )
            return cls.load(d), False
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)
        seeds = {
            "operator": nkeys.PREFIX_BYTE_OPERATOR,
            "sys": nkeys.PREFIX_BYTE_ACCOUNT,
            "account": nkeys.PREFIX_BYTE_ACCOUNT,
        }
        for name, prefix in seeds.items():
            write_private(d / f"{name}.nk", nkeys.encode_seed(os.urandom(32), prefix).decode() + "\n")
        auth = cls.load(d)
        auth.write_server_config()
        return auth, True

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AuthDir:
        """The keys of an existing auth dir (``AuthError`` saying how to make one when there is none)."""
        d = Path(path).expanduser()
        pairs = []
        for name in _KEYS:
            try:
                pairs.append(nkeys.from_seed(bytearray((d / f"{name}.nk").read_bytes().strip())))
            except FileNotFoundError:
                raise AuthError(
                    f"no auth dir at {d} ({name}.nk is missing): run `timeslice auth init --dir {d}` "
                    "first, or give --dir / $TIMESLICE_AUTH_DIR",
                    path=d,
                ) from None
            except Exception as exc:
                raise AuthError(
                    f"{d / (name + '.nk')} is not an nkey seed ({exc.__class__.__name__})", path=d
                ) from None
        return cls(d, *pairs)

    # ------------------------------------------------------------------ account, operator, server config

    def revocations(self) -> dict[str, int]:
        try:
            data = json.loads((self.path / "revocations.json").read_text())
        except FileNotFoundError:
            return {}
        return {str(k): int(v) for k, v in dict(data).items()}

    def revoke(self, user_key: str, *, at: int | None = None) -> int:
        """Revoke every JWT of ``user_key`` issued up to ``at`` (default now); rewrites the server config. The
        servers apply it on reload (``nats-server --signal reload``, or SIGHUP). Returns the time written."""
        try:
            _public_key_bytes(user_key, nkeys.PREFIX_BYTE_USER)
        except ValueError:
            raise AuthError(
                f"{user_key!r} is not a NATS user key (56 characters starting with U; `timeslice auth` "
                "prints it when it issues a credential, and issued.jsonl lists them)"
            ) from None
        revs = self.revocations()
        stamp = int(time.time()) if at is None else at
        revs[user_key] = max(stamp, revs.get(user_key, 0))
        write_private(self.path / "revocations.json", json.dumps(revs, indent=1, sort_keys=True) + "\n")
        self.write_server_config()
        return revs[user_key]

    def _operator_jwt(self) -> str:
        path = self.path / "operator.jwt"
        with contextlib.suppress(FileNotFoundError):
            token = path.read_text().strip()
            if decode_jwt(token).get("sub") == self._operator.public_key.decode():
                return token  # stable: a server reload keeps the same operator
        token = encode_jwt(
            {
                "sub": self._operator.public_key.decode(),
                "name": "timeslice",
                "nats": {"system_account": self._sys.public_key.decode(), "type": "operator", "version": 2},
            },
            self._operator,
        )
        write_private(path, token + "\n")
        return token

    def _account_jwt(self, name: str, pair: nkeys.KeyPair, *, jetstream: bool) -> str:
        nats: dict[str, Any] = {
            "limits": {**_UNLIMITED, **(_JETSTREAM if jetstream else {})},
            "default_permissions": {"pub": {}, "sub": {}},
            "type": "account",
            "version": 2,
        }
        if jetstream and (revs := self.revocations()):
            nats["revocations"] = revs
        return encode_jwt({"sub": pair.public_key.decode(), "name": name, "nats": nats}, self._operator)

    def server_config(self) -> str:
        """The nats-server configuration for this operator: its JWT, the system account, and both accounts
        preloaded into the memory resolver (the TIMESLICE one with JetStream on, unlimited, and the revocations)."""
        op = self._operator_jwt()
        sys_jwt = self._account_jwt("SYS", self._sys, jetstream=False)
        acc_jwt = self._account_jwt(ACCOUNT, self._account, jetstream=True)
        write_private(self.path / "sys.jwt", sys_jwt + "\n")
        write_private(self.path / "account.jwt", acc_jwt + "\n")
        write_private(self.path / "account.pub", self.account_key + "\n")
        sys_key = self._sys.public_key.decode()
        return (
            "# written by `timeslice auth`: the operator, its accounts and their revocations. Load it with\n"
            "# `include nats-auth.conf` (or `nats-server -c` it); after a revocation rewrite it\n"
            "# (`timeslice auth server-config`) and reload the servers (`nats-server --signal reload`).\n"
            f"operator: {op}\n"
            f"system_account: {sys_key}\n"
            "resolver: MEMORY\n"
            "resolver_preload: {\n"
            f"  {sys_key}: {sys_jwt}\n"
            f"  {self.account_key}: {acc_jwt}\n"
            "}\n"
        )

    def write_server_config(self, out: Path | None = None) -> Path:
        target = out or self.path / "nats-auth.conf"
        write_private(target, self.server_config())
        return target

    # ------------------------------------------------------------------ users

    def issue(
        self, role: str, ident: str | None = None, *, groups: Iterable[str] = (), ttl_s: int | None = None
    ) -> Issued:
        """A user credential for ``role`` (see ``_auth_perms``), signed by the account key."""
        if role not in ROLES:
            raise AuthError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
        gs = list(dict.fromkeys(groups))
        try:
            perms = permissions(role, ident, gs)
        except ValueError as exc:
            raise AuthError(str(exc)) from None
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        user_key = nkeys.from_seed(bytearray(seed)).public_key.decode()
        name = f"{role}:{ident}" if ident else role
        tags = [f"timeslice-role:{role}"]
        if role == "job":
            tags.append(f"timeslice-job:{ident}")
        elif role == "agent":
            tags.append(f"timeslice-node:{ident}")
        tags += [f"timeslice-group:{g}" for g in gs]
        now = int(time.time())
        claims: dict[str, Any] = {
            "sub": user_key,
            "name": name,
            "nats": {**perms, "subs": -1, "data": -1, "payload": -1, "tags": tags, "type": "user", "version": 2},
        }
        expires = now + ttl_s if ttl_s else None
        if expires is not None:
            claims["exp"] = expires
        jwt = encode_jwt(claims, self._account, now=now)
        line = {"user_key": user_key, "name": name, "issued_at": now, "expires": expires, "tags": tags}
        fd = os.open(self.path / "issued.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
        return Issued(jwt=jwt, seed=seed, user_key=user_key, name=name, expires=expires)
