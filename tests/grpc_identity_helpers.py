"""Real credentials for the gRPC identity tests, made here: NATS user JWTs signed with nkeys in the format
`timeslice auth` issues (header ``{"typ":"JWT","alg":"ed25519-nkey"}``, base64url without padding, claims with
``name``, ``sub``, ``iss``, ``iat``, ``exp``, ``nats.tags``), and a throwaway certificate authority with a server
certificate for 127.0.0.1/localhost and client certificates naming jobs (``cryptography``)."""

from __future__ import annotations

import base64
import datetime
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# ---------------------------------------------------------------------------------------------- JWTs


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def new_key(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def new_account() -> nkeys.KeyPair:
    return new_key(nkeys.PREFIX_BYTE_ACCOUNT)


def public(kp: nkeys.KeyPair) -> str:
    return str(kp.public_key.decode())


def sign_jwt(signer: nkeys.KeyPair, claims: dict[str, Any]) -> str:
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{head}.{body}.{_b64(signer.sign(f'{head}.{body}'.encode()))}"


def user_jwt(
    account: nkeys.KeyPair,
    role: str,
    *,
    job: str | None = None,
    groups: Sequence[str] = (),
    ttl_s: float | None = 3600.0,
    iat: int | None = None,
    signer: nkeys.KeyPair | None = None,
    issuer: str | None = None,
) -> str:
    """A user of ``account`` with the role (and job, groups) tags `timeslice auth` gives. ``signer`` signs instead of
    the account (a forgery, or a signing key); ``issuer`` overrides ``iss``."""
    user = new_key(nkeys.PREFIX_BYTE_USER)
    now = int(time.time())
    tags = ([f"timeslice-role:{role}"] if role else []) + ([f"timeslice-job:{job}"] if job else [])
    tags += [f"timeslice-group:{g}" for g in groups]
    claims: dict[str, Any] = {
        "jti": _b64(os.urandom(16)),
        "iat": iat if iat is not None else now,
        "iss": issuer or public(account),
        "name": f"job:{job}" if role == "job" else role,
        "sub": public(user),
        "nats": {"type": "user", "version": 2, "tags": tags, "pub": {}, "sub": {}},
    }
    if ttl_s is not None:
        claims["exp"] = int(now + ttl_s)
    return sign_jwt(signer or account, claims)


def account_jwt(
    account: nkeys.KeyPair,
    operator: nkeys.KeyPair,
    *,
    name: str = "TIMESLICE",
    revocations: dict[str, int] | None = None,
) -> str:
    claims: dict[str, Any] = {
        "jti": _b64(os.urandom(16)),
        "iat": int(time.time()),
        "iss": public(operator),
        "name": name,
        "sub": public(account),
        "nats": {
            "type": "account",
            "version": 2,
            "revocations": revocations or {},
            "limits": {"jetstream": {"mem_storage": -1, "disk_storage": -1}},
        },
    }
    return sign_jwt(operator, claims)


def auth_conf_text(operator: nkeys.KeyPair, system: nkeys.KeyPair, accounts: dict[str, str]) -> str:
    """A server config snippet as `timeslice auth server-config` writes it (operator JWT, system account, memory
    resolver preloaded with ``{account pubkey: account JWT}``), valid for nats-server."""
    op = sign_jwt(
        operator,
        {
            "jti": _b64(os.urandom(16)),
            "iat": int(time.time()),
            "iss": public(operator),
            "sub": public(operator),
            "name": "timeslice",
            "nats": {"type": "operator", "version": 2, "system_account": public(system)},
        },
    )
    preload = "\n".join(f"  {k}: {v}" for k, v in accounts.items())
    return f"operator: {op}\nsystem_account: {public(system)}\nresolver: MEMORY\nresolver_preload: {{\n{preload}\n}}\n"


def write_auth_conf(path: Path, operator: nkeys.KeyPair, system: nkeys.KeyPair, accounts: dict[str, str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(auth_conf_text(operator, system, accounts))
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path

    def client(self, name: str) -> tuple[Path, Path]:
        return self.dir / f"{name}.pem", self.dir / f"{name}.key"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _cert(
    subject_cn: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    san: Sequence[x509.GeneralName] = (),
    client: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(list(san)), critical=False)
    if not ca:
        usage = x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH if client else x509.oid.ExtendedKeyUsageOID.SERVER_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(d: Path, clients: dict[str, tuple[str, Sequence[x509.GeneralName]]]) -> Pki:
    """A CA, a server certificate for 127.0.0.1 and localhost, and ``clients[name] = (CN, SANs)``."""
    import ipaddress

    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "timeslice test CA")])
    _write(d / "ca", ca_key, _cert("timeslice test CA", ca_key, ca_name, ca_key, ca=True))
    server_key = _key()
    _write(
        d / "server",
        server_key,
        _cert(
            "server",
            server_key,
            ca_name,
            ca_key,
            san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        ),
    )
    for name, (cn, san) in clients.items():
        k = _key()
        _write(d / name, k, _cert(cn, k, ca_name, ca_key, san=san, client=True))
    return Pki(d, d / "ca.pem", d / "server.pem", d / "server.key")


def uri(value: str) -> x509.GeneralName:
    return x509.UniformResourceIdentifier(value)


def dns(value: str) -> x509.GeneralName:
    return x509.DNSName(value)
