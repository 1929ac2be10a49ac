"""A nats-server with timeslice's auth on (operator mode, memory resolver), optionally TLS/mTLS, for the security
tests and the auth benchmark: real credentials issued by ``timeslice auth``'s code, throwaway certificates made with
``cryptography`` (a CA, a server certificate for 127.0.0.1, a client certificate)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from timeslice_orchestrator._auth_issue import AuthDir, write_private
from timeslice_orchestrator.embedded import NatsServer


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    write_private(
        path,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode(),
    )


def make_certs(d: Path) -> Certs:
    """A CA and, signed by it, a server certificate (SAN 127.0.0.1, localhost) and a client certificate."""
    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("timeslice test CA"))
        .issuer_name(_name("timeslice test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(
        cn: str, san: list[x509.GeneralName], usage: x509.ObjectIdentifier
    ) -> tuple[bytes, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), key

    out = Certs(d / "ca.pem", d / "server.pem", d / "server-key.pem", d / "client.pem", d / "client-key.pem")
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert, key = leaf(
        "127.0.0.1",
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
        x509.ExtendedKeyUsageOID.SERVER_AUTH,
    )
    out.server_cert.write_bytes(cert)
    _write_key(out.server_key, key)
    cert, key = leaf("job-client", [x509.DNSName("job-client")], x509.ExtendedKeyUsageOID.CLIENT_AUTH)
    out.client_cert.write_bytes(cert)
    _write_key(out.client_key, key)
    return out


@dataclass
class SecureBus:
    """A started nats-server with auth (and TLS when ``certs`` is given; ``mtls``: client certificates required)."""

    dir: Path
    auth: AuthDir
    server: NatsServer
    url: str
    certs: Certs | None = None
    issued: dict[str, Any] = field(default_factory=dict)

    def creds(
        self, role: str, ident: str | None = None, groups: Iterable[str] = (), *, ttl_s: int | None = None
    ) -> Path:
        """A fresh credential of ``role`` written to a 0600 file; its ``Issued`` is kept in ``issued[path]``."""
        issued = self.auth.issue(role, ident, groups=groups, ttl_s=ttl_s)
        path = self.dir / "creds" / f"{role}-{ident or 'x'}-{issued.user_key[:8]}.creds"
        write_private(path, issued.creds())
        self.issued[str(path)] = issued
        return path

    def reload(self) -> None:
        """The server reads its configuration again (what a revocation needs)."""
        assert self.server.proc is not None
        self.server.proc.send_signal(1)  # SIGHUP: reload

    def stop(self) -> None:
        self.server.stop()


def start_secure_bus(d: Path, *, tls: bool = False, mtls: bool = False) -> SecureBus:
    auth, _ = AuthDir.init(d / "auth")
    conf = auth.write_server_config()
    certs = make_certs(d / "tls") if tls or mtls else None
    args: tuple[str, ...] = ("-c", str(conf))
    if certs is not None:
        args += ("--tls", "--tlscert", str(certs.server_cert), "--tlskey", str(certs.server_key))
        if mtls:
            args += ("--tlsverify", "--tlscacert", str(certs.ca))
    server = NatsServer(d / "nats", extra_args=args)
    url = server.start()
    if certs is not None:
        url = url.replace("nats://", "tls://")
    return SecureBus(d, auth, server, url, certs)


class Violations:
    """An ``error_cb`` that keeps the server's refusals (a publish that violates permissions raises nothing and times
    out: only ``error_cb`` says why)."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.changed = asyncio.Event()

    async def __call__(self, exc: Exception) -> None:
        self.seen.append(str(exc).lower())
        self.changed.set()

    def about(self, subject: str, kind: str = "publish") -> bool:
        return any("permissions violation" in s and kind in s and subject.lower() in s for s in self.seen)
