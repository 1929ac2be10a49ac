"""The client half of the gRPC plumbing: TLS for a channel to a shim. Private.

:func:`channel_credentials`: TLS and mutual TLS from PEM files, for the job's ``SnapshotAgentClient``. The server
half (binding a service, server TLS, live connections) is the services' own:
``timeslice_client._internal.grpc_server.serving``.
"""

from __future__ import annotations

from pathlib import Path

import grpc

__all__ = ["channel_credentials"]


def _read(path: str | Path | None) -> bytes | None:
    return Path(path).expanduser().read_bytes() if path else None


def channel_credentials(
    ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None
) -> grpc.ChannelCredentials:
    """TLS for a client: ``ca`` verifies the server (default: the system roots); ``cert``/``key`` is
    the client's own certificate for mutual TLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert)
    )
