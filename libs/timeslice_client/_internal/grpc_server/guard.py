"""The shims' door: the port they listen on (TLS or not, and whether that may serve at all), who each call comes
from (:class:`Authenticator`), and the gRPC answers to a caller that may not do what it asks (UNAUTHENTICATED,
PERMISSION_DENIED). Private; the rules are in ``auth_config.py``'s docstring."""

from __future__ import annotations

import ipaddress
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from ...errors import GrpcRefusedToStart
from .auth_config import GrpcAuthSettings
from .identity import (
    CertificateMapper,
    Identity,
    PermissionDenied,
    TokenVerifier,
    Trust,
    Unauthenticated,
    local_callers_supported,
    loopback_peer_uid,
)
from .serving import SERVER_OPTIONS, normalize_peer, server_credentials

if TYPE_CHECKING:  # beside.py imports this module: the shims' settings are a type here only
    from .beside import ShimSettings

__all__ = [
    "Authenticator",
    "GrpcRefusedToStart",
    "add_port",
    "authenticate",
    "authorize",
    "is_loopback",
    "serve_health",
]

Ctx = grpc.aio.ServicerContext[Any, Any]
INSECURE = Identity("insecure", "insecure", "anyone (--grpc-insecure)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Authenticator:
    """Finds the :class:`Identity` of each call (order: bearer token, certificate naming a job, local user,
    any other certificate) and counts what it refused (``refused[code]``)."""

    def __init__(self, settings: GrpcAuthSettings, *, mutual_tls: bool, server_port: Callable[[], int | None]) -> None:
        self.settings = settings
        self.verifier = (
            TokenVerifier(Trust(settings.trust_account), cache=settings.token_cache) if settings.trust_account else None
        )
        self.mapper = CertificateMapper(settings.identity_from, settings.pattern) if mutual_tls else None
        self.local = settings.local_callers and local_callers_supported()
        self._uid = os.geteuid() if hasattr(os, "geteuid") else -1
        self._port = server_port
        self.refused: Counter[str] = Counter()

    def describe(self) -> str:
        if self.settings.insecure:
            return "callers NOT authenticated (--grpc-insecure)"
        ways = []
        if self.verifier is not None:
            ways.append(f"bearer tokens of account {self.verifier.trust.account().public_key[:12]}...")
        if self.mapper is not None:
            ways.append(f"client certificates ({self.mapper.source} {self.mapper.pattern})")
        if self.local:
            ways.append(f"the local user (loopback callers with uid {self._uid})")
        return "callers: " + (", ".join(ways) or "none can be identified")

    def identify(
        self, metadata: Iterable[tuple[str, str | bytes]] | None, auth_context: Mapping[str, Iterable[bytes]], peer: str
    ) -> Identity:
        if self.settings.insecure:
            return INSECURE
        token = _bearer(metadata)
        if token is not None:
            if self.verifier is None:
                raise Unauthenticated(
                    "this gRPC API takes no bearer tokens (it trusts no account: its operator "
                    "gives --grpc-trust-account); use a client certificate"
                )
            return self.verifier.verify(token)
        certificate = None
        if self.mapper is not None:
            pems = list(auth_context.get("x509_pem_cert") or ())
            if pems:
                job, certificate = self.mapper.job(pems[0])
                if job is not None:
                    return Identity("certificate", "job", f"job:{job}", job=job)
        if self.local:
            port = self._port()
            if port and loopback_peer_uid(normalize_peer(peer), port) == self._uid:
                return Identity("local", "local", f"the local user (uid {self._uid})")
        if certificate is not None:
            return Identity("certificate", "certificate", certificate)
        raise Unauthenticated(
            "no credentials: send `authorization: Bearer <JWT>` metadata (the JWT of a "
            "`timeslice auth job --job J` credential)"
            + (" or a client certificate naming the job" if self.mapper else "")
        )


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("the authorization metadata is not `Bearer <JWT>`")
        return token.strip()
    return None


async def authenticate(ctx: Ctx, auth: Authenticator, log: logging.Logger) -> Identity:
    """The caller of a read-only call; UNAUTHENTICATED when it proved no identity."""
    try:
        return auth.identify(ctx.invocation_metadata(), ctx.auth_context(), ctx.peer())
    except Unauthenticated as exc:
        auth.refused["unauthenticated"] += 1
        log.warning("gRPC call refused: %s", exc, extra={"peer": ctx.peer()})
        await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        raise  # not reached: abort raises


async def authorize(ctx: Ctx, auth: Authenticator, log: logging.Logger, job: str, group: str | None) -> Identity:
    """The caller of a call that acts as ``job``; PERMISSION_DENIED when it may not act as that job (in that group)."""
    who = await authenticate(ctx, auth, log)
    why = who.refusal(job, group)
    if why is None:
        return who
    exc = PermissionDenied(why, caller=who.name, job=job, group=group)
    auth.refused["permission_denied"] += 1
    log.warning(
        "gRPC call refused: %s", exc, extra={"caller": who.name, "job": job, "group": group, "peer": ctx.peer()}
    )
    await ctx.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
    raise exc  # not reached


def add_port(server: grpc.aio.Server, settings: ShimSettings, log: logging.Logger) -> int:
    """Listen where ``settings`` say (``host:port``, their TLS files) as their auth settings allow (the port bound),
    or raise :class:`GrpcRefusedToStart`."""
    host, tls_cert, tls_key, tls_client_ca = settings.host, settings.tls_cert, settings.tls_key, settings.tls_client_ca
    flags = "--grpc-tls-cert and --grpc-tls-key"
    if bool(tls_cert) != bool(tls_key):
        raise GrpcRefusedToStart(f"TLS needs both a certificate and its key ({flags})")
    if tls_client_ca and not tls_cert:
        raise GrpcRefusedToStart(f"mutual TLS (--grpc-tls-client-ca) needs {flags}")
    loopback = is_loopback(host)
    if not settings.insecure:
        if not tls_cert and not loopback:
            raise GrpcRefusedToStart(
                f"refusing to serve gRPC on {host} without TLS: give {flags} (with --grpc-tls-client-ca and/or "
                "--grpc-trust-account to identify callers), serve on 127.0.0.1, or say --grpc-insecure to serve "
                "anyone without authentication"
            )
        if not loopback and not (tls_client_ca or settings.trust_account):
            raise GrpcRefusedToStart(
                f"gRPC on {host} could identify no caller: give --grpc-tls-client-ca (client certificates naming "
                "jobs) and/or --grpc-trust-account (bearer tokens), or --grpc-insecure"
            )
        if loopback and not (settings.local_callers or tls_client_ca or settings.trust_account):
            raise GrpcRefusedToStart(
                "gRPC could identify no caller (--grpc-no-local-callers without a client CA or a trusted account)"
            )
        if settings.local_callers and not local_callers_supported():
            log.warning(
                "this platform cannot tell which user a loopback gRPC caller runs as (no /proc/net/tcp): "
                "callers without a token or certificate are refused"
            )
    address = f"{host}:{settings.port}"
    if tls_cert and tls_key:
        bound = server.add_secure_port(address, server_credentials(tls_cert, tls_key, tls_client_ca))
    else:
        bound = server.add_insecure_port(address)
    if settings.insecure:
        log.warning(
            "gRPC API on %s:%d does NOT authenticate callers (--grpc-insecure): anyone who can reach it may "
            "Acquire and Yield as any job%s",
            host,
            bound,
            "" if loopback else ", from the network",
        )
    return bound


async def serve_health(servicer: health.aio.HealthServicer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """The health service alone, without TLS, for probes that cannot speak TLS (it tells only SERVING or not)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound
