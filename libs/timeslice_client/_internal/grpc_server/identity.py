"""The identity of a gRPC caller, and what it may do. Private; used by both shims (settings: ``auth_config.py``).

* :class:`Trust` is the TIMESLICE account as the shims trust it: its public key (and signing keys, revocations)
  from a key, a file or the auth dir; files are read again when they change (``timeslice auth revoke`` then
  ``server-config`` rewrites the snippet, and a revoked token stops working here too).
* :class:`TokenVerifier` checks a NATS user JWT the way nats-server does (ed25519 ``ed25519-nkey`` signature by the
  account or one of its signing keys, ``exp``/``nbf``, revocations) and reads its ``timeslice-*`` tags.
* :class:`CertificateMapper` reads the job a client certificate names (SAN URI, SAN DNS or CN, through a pattern).
* :func:`loopback_peer_uid` finds the uid of the process at the other end of a loopback TCP connection.
* :class:`Identity` says what a caller may do: act as a job (its own; the local user and an insecure shim: any)
  or only read.

Tokens are never logged: messages name the user's ``name`` claim and public key.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import os
import re
import sys
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ...errors import CallerRefused, PermissionDenied, TrustError, Unauthenticated
from .sock_diag import tcp_socket_uid

__all__ = [
    "Account",
    "CallerRefused",
    "CertificateMapper",
    "Identity",
    "PermissionDenied",
    "TokenVerifier",
    "Trust",
    "TrustError",
    "Unauthenticated",
    "loopback_peer_uid",
]

_JOB_RE: Final = r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}"  # the id rule of timeslice_client._names
_NKEY_RE: Final = re.compile(r"[A-Z2-7]{56}")
_JWT_RE: Final = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
_PRELOAD_RE: Final = re.compile(r"\b(A[A-Z2-7]{55})\b[\"']?\s*[:=]\s*[\"']?(" + _JWT_RE.pattern + ")")
ACCOUNT_NAME: Final = "TIMESLICE"
#: Roles that act as any job: ``timeslice up``'s local user (``nats.creds``) and a shim without authentication.
ANY_JOB_ROLES: Final = frozenset({"local", "insecure"})


# ---------------------------------------------------------------------------------------------- identity


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a call comes from. ``kind``: how it was proven (token, certificate, local, insecure)."""

    kind: str
    role: str
    name: str
    job: str | None = None
    groups: frozenset[str] | None = None  # a job token issued for some groups only
    user_key: str = ""

    def refusal(self, job: str, group: str | None) -> str | None:
        """Why this caller may not act as ``job`` in ``group``; None when it may."""
        if self.role in ANY_JOB_ROLES:
            return None
        who = f"{self.name} ({self.kind})"
        if self.role != "job" or self.job is None:
            return (
                f"{who} may only read (ListGroups, GetGroupStatus): acting as job {job!r} needs that job's token "
                "(`timeslice auth job --job ...`) or a client certificate naming it"
            )
        if self.job != job:
            return f"{who} acts only as job {self.job!r}, not as job {job!r}"
        if group is not None and self.groups is not None and group not in self.groups:
            return (
                f"{who} was issued for groups {', '.join(sorted(self.groups))}, not for group {group!r}; "
                "issue a token with --group for it"
            )
        return None


# ---------------------------------------------------------------------------------------------- keys and JWTs


def _b64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _verify_key(public_key: str) -> Any:
    """The ed25519 verify key of an nkey public key (account ``A...``), checksum and prefix checked."""
    import nkeys
    from nacl.signing import VerifyKey

    try:
        raw = base64.b32decode(public_key + "=" * (-len(public_key) % 8))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{public_key[:8]}... is not an nkey") from exc
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if len(body) != 33 or nkeys.crc16(bytearray(body)) != crc:
        raise ValueError(f"{public_key[:8]}... is not an nkey (bad length or checksum)")
    if body[0] != nkeys.PREFIX_BYTE_ACCOUNT:
        raise ValueError(f"{public_key[:8]}... is not an account public key (those start with A)")
    return VerifyKey(bytes(body[1:]))


def _claims(jwt: str) -> dict[str, Any]:
    claims = json.loads(_b64(jwt.split(".")[1]))
    if not isinstance(claims, dict):
        raise TypeError("the JWT's claims are not an object")
    return claims


@dataclass(frozen=True, slots=True)
class Account:
    """The trusted account: the key that signs users, its signing keys, and the users it revoked."""

    public_key: str
    signing_keys: frozenset[str] = frozenset()
    revocations: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_jwt(cls, jwt: str) -> Account:
        c = _claims(jwt)
        nats = c.get("nats") or {}
        if nats.get("type") != "account" or not isinstance(c.get("sub"), str):
            raise ValueError("not an account JWT")
        keys = {k if isinstance(k, str) else str(k.get("key", "")) for k in nats.get("signing_keys") or []}
        revs = {str(k): int(v) for k, v in (nats.get("revocations") or {}).items()}
        return cls(c["sub"], frozenset(k for k in keys if k), revs)

    def issuer_ok(self, iss: str, issuer_account: str | None) -> bool:
        if iss == self.public_key:
            return issuer_account in (None, "", self.public_key)
        return iss in self.signing_keys and issuer_account == self.public_key

    def revoked(self, user_key: str, issued_at: int) -> bool:
        at = max(self.revocations.get(user_key, -1), self.revocations.get("*", -1))
        return at >= 0 and issued_at <= at


class Trust:
    """The account whose users the shim believes: ``source`` is an account public key, a file holding one (or the
    account's JWT, or a server config with ``resolver_preload``), or an auth dir (its ``nats-auth.conf``). A file is
    read again when its modification time changes (checked at most every ``recheck_s``)."""

    def __init__(self, source: str | Path, *, recheck_s: float = 1.0) -> None:
        self.source = str(source)
        self._recheck_s = recheck_s
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._mtime: int | None = None
        self._checked = 0.0
        if _NKEY_RE.fullmatch(self.source) and self.source.startswith("A"):
            try:
                _verify_key(self.source)
            except ValueError as exc:
                raise TrustError(f"--grpc-trust-account: {exc}") from exc
            self._account = Account(self.source)
            return
        path = Path(self.source).expanduser()
        self._path = path / "nats-auth.conf" if path.is_dir() else path
        self._account = self._load()

    def account(self) -> Account:
        if self._path is None:
            return self._account
        now = time.monotonic()
        if now - self._checked >= self._recheck_s:
            with self._lock:
                self._checked = now
                try:
                    changed = self._path.stat().st_mtime_ns != self._mtime
                    if changed:
                        self._account = self._load()
                except (OSError, TrustError):
                    pass  # keep what was read last; a half-written file is read on the next check
        return self._account

    def _load(self) -> Account:
        assert self._path is not None
        try:
            self._mtime = self._path.stat().st_mtime_ns
            text = self._path.read_text().strip()
        except OSError as exc:
            raise TrustError(
                f"cannot read the trusted account from {self._path} ({exc.strerror}); give the TIMESLICE "
                "account's public key, its JWT, or the auth dir of `timeslice auth init`"
            ) from exc
        try:
            if _NKEY_RE.fullmatch(text) and text.startswith("A"):
                _verify_key(text)
                return Account(text)
            if _JWT_RE.fullmatch(text):
                return Account.from_jwt(text)
            jwts = [jwt for _, jwt in _PRELOAD_RE.findall(text)]
            found = [Account.from_jwt(jwt) for jwt in jwts if _claims(jwt).get("name") == ACCOUNT_NAME]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TrustError(f"{self._path} holds no usable account key or JWT ({exc})") from exc
        if len(found) != 1:
            raise TrustError(
                f"{self._path} has {len(found)} accounts named {ACCOUNT_NAME} (of {len(jwts)} "
                "preloaded); give the account's public key or JWT instead"
            )
        return found[0]


class TokenVerifier:
    """Bearer tokens (NATS user JWTs) → :class:`Identity`. A token's signature is checked once, then remembered
    (bounded); expiry and revocation are checked on every call."""

    def __init__(self, trust: Trust, *, cache: int = 4096, clock: Callable[[], float] = time.time) -> None:
        self.trust = trust
        self._clock = clock
        self._cache: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        self._cache_max = cache
        self._lock = threading.Lock()

    def verify(self, token: str) -> Identity:
        account = self.trust.account()
        claims = self._verified(token, account)
        nats = claims.get("nats") or {}
        sub, name = str(claims.get("sub", "")), str(claims.get("name", ""))
        who = f"token of {name or '?'} ({sub[:12]}...)"
        now = self._clock()
        exp, nbf = claims.get("exp"), claims.get("nbf")
        if isinstance(exp, int | float) and exp > 0 and now >= exp:
            raise Unauthenticated(f"the {who} expired at {_iso(exp)}; issue a new one (`timeslice auth job ...`)")
        if isinstance(nbf, int | float) and nbf > 0 and now < nbf:
            raise Unauthenticated(f"the {who} is not valid before {_iso(nbf)}")
        if account.revoked(sub, int(claims.get("iat") or 0)):
            raise Unauthenticated(f"the {who} was revoked by the account; issue a new one")
        return _identity(nats.get("tags") or [], name, sub, who)

    def _verified(self, token: str, account: Account) -> dict[str, Any]:
        key = (token, account.public_key)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        claims = self._check(token, account)
        if self._cache_max:
            with self._lock:
                self._cache[key] = claims
                while len(self._cache) > self._cache_max:
                    self._cache.popitem(last=False)
        return claims

    def _check(self, token: str, account: Account) -> dict[str, Any]:
        from nacl.exceptions import BadSignatureError

        if not _JWT_RE.fullmatch(token):
            raise Unauthenticated(
                "the bearer token is not a JWT (header.claims.signature); send the JWT of a "
                "`timeslice auth job` credential"
            )
        head, body, sig = token.split(".")
        try:
            header, claims = json.loads(_b64(head)), json.loads(_b64(body))
            signature = _b64(sig)
        except (ValueError, binascii.Error) as exc:
            raise Unauthenticated("the bearer token does not decode (base64url JSON)") from exc
        if not isinstance(header, dict) or not isinstance(claims, dict):
            raise Unauthenticated("the bearer token's header or claims are not JSON objects")
        if str(header.get("typ", "")).upper() != "JWT" or str(header.get("alg", "")).lower() != "ed25519-nkey":
            raise Unauthenticated(
                f"the bearer token is not a NATS JWT (typ {header.get('typ')!r}, alg "
                f"{header.get('alg')!r}; want JWT, ed25519-nkey)"
            )
        nats = claims.get("nats")
        if not isinstance(nats, dict) or nats.get("type") != "user":
            raise Unauthenticated("the bearer token is not a user JWT (nats.type is not 'user')")
        iss = str(claims.get("iss", ""))
        if not account.issuer_ok(iss, nats.get("issuer_account")):
            raise Unauthenticated(
                f"the bearer token was issued by {iss[:12]}..., not by the trusted account "
                f"{account.public_key[:12]}... (or one of its signing keys)"
            )
        try:
            _verify_key(iss).verify(f"{head}.{body}".encode(), signature)
        except (BadSignatureError, ValueError) as exc:
            raise Unauthenticated(f"the bearer token's signature does not verify against {iss[:12]}...") from exc
        return claims


def _identity(tags: list[Any], name: str, sub: str, who: str) -> Identity:
    """Read the ``timeslice-*`` tags (tags may come lower-cased; the ``name`` claim keeps the job's case)."""
    by: dict[str, list[str]] = {}
    for t in tags:
        k, sep, v = str(t).partition(":")
        if sep and k.lower().startswith("timeslice-"):
            by.setdefault(k.lower()[len("timeslice-") :], []).append(v)
    roles = by.get("role", [])
    if len(roles) != 1:
        raise Unauthenticated(
            f"the {who} carries {len(roles)} timeslice-role tags, not one; issue it with "
            "`timeslice auth job|reader|admin ...`"
        )
    role = roles[0].lower()
    if role != "job":
        return Identity("token", role, name or role, user_key=sub)
    jobs = by.get("job", [])
    named = name.partition(":")[2] if name.startswith("job:") else ""
    if len(jobs) != 1 or (named and named.lower() != jobs[0].lower()):
        raise Unauthenticated(f"the {who} names its job ambiguously (tags {jobs}, name {name!r})")
    job = named or jobs[0]
    if re.fullmatch(_JOB_RE, job) is None:
        raise Unauthenticated(f"the {who} names an invalid job id {job!r}")
    groups = frozenset(by["group"]) if by.get("group") else None
    return Identity("token", "job", f"job:{job}", job=job, groups=groups, user_key=sub)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


# ---------------------------------------------------------------------------------------------- certificates


class CertificateMapper:
    """The job a client certificate names: in its SAN URIs (``san-uri``), SAN DNS names (``san-dns``) or subject
    CN (``cn``), the one value that matches ``pattern`` (``{job}`` stands for the job id)."""

    def __init__(self, source: str, pattern: str) -> None:
        if source not in ("san-uri", "san-dns", "cn"):
            raise ValueError(f"identity source {source!r}: give san-uri, san-dns or cn")
        head, _, tail = pattern.partition("{job}")
        self.source, self.pattern = source, pattern
        self._re = re.compile(re.escape(head) + f"(?P<job>{_JOB_RE})" + re.escape(tail))
        self._cache: OrderedDict[bytes, tuple[str | None, str]] = OrderedDict()

    def job(self, pem: bytes) -> tuple[str | None, str]:
        """(the job, a description of the certificate for messages); the job is None when none (or several) match."""
        hit = self._cache.get(pem)
        if hit is None:
            hit = self._read(pem)
            self._cache[pem] = hit
            while len(self._cache) > 1024:
                self._cache.popitem(last=False)
        return hit

    def _read(self, pem: bytes) -> tuple[str | None, str]:
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        cert = x509.load_pem_x509_certificate(pem)
        values: list[str]
        if self.source == "cn":
            values = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
        else:
            try:
                san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            except x509.ExtensionNotFound:
                san = x509.SubjectAlternativeName([])
            kind = x509.UniformResourceIdentifier if self.source == "san-uri" else x509.DNSName
            values = [str(v) for v in san.get_values_for_type(kind)]
        jobs = {m.group("job") for v in values if (m := self._re.fullmatch(v)) is not None}
        cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        desc = f"client certificate {cn[0].value if cn else cert.subject.rfc4514_string()!s}"
        return (jobs.pop() if len(jobs) == 1 else None), desc


# ---------------------------------------------------------------------------------------------- local callers


def _proc_addr(text: str, v6: bool) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``0100007F:1F90`` (as /proc/net/tcp prints it: 32-bit words in host byte order) → (address, port)."""
    host, _, port = text.partition(":")
    raw = bytes.fromhex(host)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.IPv6Address(raw) if v6 else ipaddress.IPv4Address(raw)
    return addr, int(port, 16)


def _parse_peer(peer: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    """``ipv4:127.0.0.1:5000`` / ``ipv6:[::1]:5000`` (grpc's peer names) → (address, port); None otherwise."""
    family, _, rest = urllib.parse.unquote(peer.strip()).partition(":")
    if family not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        return ipaddress.ip_address(host.strip("[]")), int(port)
    except ValueError:
        return None


_PROC_NET = Path("/proc/net")


def loopback_peer_uid(peer: str, server_port: int, *, proc: Path = _PROC_NET) -> int | None:
    """The uid owning the client end of a loopback TCP connection to ``server_port`` from ``peer`` (a grpc peer
    name), from the kernel's socket table (Linux). None: not a loopback peer, or not found (not Linux, gone)."""
    found = _parse_peer(peer)
    if found is None:
        return None
    addr, port = _unmapped(found[0]), found[1]
    if not addr.is_loopback:
        return None
    if proc == _PROC_NET:
        # Asked of the kernel for the one socket first (microseconds); the table read walks every socket's hash
        # bucket (~6 ms a table on the dev VM, twice per call). The client's end: this address and port, connected
        # to the server's port on the same loopback address, in an IPv4 socket or (dual-stack) an IPv6 one.
        mapped = ipaddress.IPv6Address(f"::ffff:{addr}") if addr.version == 4 else addr
        for a in dict.fromkeys((addr, mapped)):
            uid = tcp_socket_uid(a, port, a, server_port)
            if uid is not None:
                return uid
    # Both tables: grpc uses dual-stack IPv6 sockets, so an IPv4 peer's socket may be in tcp6 as ::ffff:127.0.0.1.
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 8 or not f[1].endswith(f":{port:04X}") or not f[2].endswith(f":{server_port:04X}"):
                continue
            local, local_port = _proc_addr(f[1], v6)
            if (_unmapped(local), local_port) == (addr, port):
                return int(f[7])
    return None


def _unmapped(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return mapped or addr


def local_callers_supported(proc: Path = Path("/proc/net")) -> bool:
    return (proc / "tcp").exists() and hasattr(os, "geteuid")
