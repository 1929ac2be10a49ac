"""Who may call the gRPC shims: the settings and command-line flags, shared by the orchestrator's and the agent's
shim. Private; no gRPC import here, so the CLIs can add the flags without loading grpc.

Every call is made by an identity (:mod:`timeslice_client._internal.grpc_server.identity`), found in this order:

1. a bearer token (``authorization: Bearer <user JWT>``, the JWT of a ``timeslice auth ...`` credential), verified
   against the TIMESLICE account (``trust_account``: its public key, a file holding it or its JWT, or the auth dir);
2. the client certificate of a mutual-TLS connection (``tls_client_ca``), when it names a job
   (``identity_from`` / ``identity_pattern``);
3. on a loopback connection without either, the local user: a process running under this process's uid
   (``local_callers``; Linux, from ``/proc/net/tcp``), who may act as any job, like ``timeslice up``'s
   ``nats.creds``;
4. any other client certificate the CA signed: authenticated, read only.

``insecure`` turns all of that off: anyone who reaches the port acts as any job (logged as a warning at start).
Without TLS the shims serve loopback addresses only (unless ``insecure``); on any other address they need TLS and a
way to identify callers (a client CA or a trusted account).
"""

from __future__ import annotations

import argparse
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

__all__ = ["DEFAULT_PATTERNS", "GrpcAuthSettings", "IdentitySource", "add_auth_flags", "auth_settings_from_args"]

IdentitySource = Literal["san-uri", "san-dns", "cn"]

#: Where a client certificate names its job, by default, for each ``identity_from``.
DEFAULT_PATTERNS: dict[str, str] = {
    "san-uri": "spiffe://timeslice/job/{job}",
    "san-dns": "{job}.job.timeslice",
    "cn": "job:{job}",
}


class GrpcAuthSettings(BaseSettings):
    """Caller authentication of a gRPC shim (mixed into its config, so under that config's env prefix)."""

    insecure: bool = False
    local_callers: bool = True
    identity_from: IdentitySource = "san-uri"
    identity_pattern: str | None = None  # None: DEFAULT_PATTERNS[identity_from]
    trust_account: str | None = None
    token_cache: int = Field(default=4096, ge=0)  # verified tokens kept (signature checked once per token)

    @field_validator("identity_pattern")
    @classmethod
    def _one_job(cls, v: str | None) -> str | None:
        if v is not None and v.count("{job}") != 1:
            raise ValueError(
                f"identity pattern {v!r} must contain {{job}} exactly once, e.g. spiffe://timeslice/job/{{job}}"
            )
        return v

    @property
    def pattern(self) -> str:
        return self.identity_pattern or DEFAULT_PATTERNS[self.identity_from]


def add_auth_flags(parser: argparse.ArgumentParser, *, health: bool = False) -> None:
    """The caller-authentication flags of a gRPC shim (read back by :func:`auth_settings_from_args`)."""
    parser.add_argument(
        "--grpc-insecure",
        action="store_true",
        default=None,
        help="serve gRPC WITHOUT authenticating callers: anyone who reaches the port can act as "
        "any job (a warning is logged at start); default: callers prove who they are",
    )
    parser.add_argument(
        "--grpc-no-local-callers",
        dest="grpc_local_callers",
        action="store_false",
        default=None,
        help="refuse loopback callers that present no token or certificate (default: a loopback "
        "caller running as this user is the local user, who may act as any job)",
    )
    parser.add_argument(
        "--grpc-trust-account",
        default=None,
        metavar="PUBKEY_OR_FILE",
        help="accept bearer tokens (`authorization: Bearer <user JWT>`, the JWT in a `timeslice "
        "auth job` credential) signed by this NATS account: its public key, a file holding it "
        "or its JWT, or the auth dir (`timeslice auth init --dir`)",
    )
    parser.add_argument(
        "--grpc-identity-from",
        choices=sorted(DEFAULT_PATTERNS),
        default=None,
        help="with --grpc-tls-client-ca: where a client certificate names its job (default san-uri)",
    )
    parser.add_argument(
        "--grpc-identity-pattern",
        default=None,
        metavar="PATTERN",
        help="how that name spells the job, with {job} for the job id (defaults: "
        + ", ".join(f"{k}: {v}" for k, v in DEFAULT_PATTERNS.items())
        + ")",
    )
    if health:
        parser.add_argument(
            "--grpc-health-port",
            type=int,
            default=None,
            help="also serve the gRPC health service alone, without TLS, on this port (for probes "
            "that cannot speak TLS, e.g. Kubernetes' grpc probe)",
        )
        parser.add_argument(
            "--grpc-health-host", default=None, help="address of --grpc-health-port (default 127.0.0.1)"
        )


def auth_settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags :func:`add_auth_flags` added that were given, as config fields (the rest keep their env/defaults)."""
    fields = {
        "grpc_insecure": "insecure",
        "grpc_local_callers": "local_callers",
        "grpc_trust_account": "trust_account",
        "grpc_identity_from": "identity_from",
        "grpc_identity_pattern": "identity_pattern",
        "grpc_health_port": "health_port",
        "grpc_health_host": "health_host",
    }
    return {field: getattr(args, flag) for flag, field in fields.items() if getattr(args, flag, None) is not None}
