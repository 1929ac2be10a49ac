"""The server half of the gRPC plumbing, shared by the orchestrator's and the agent's shim.

* :func:`bind` serves a service from its descriptor (method names, message classes and paths all
  come from the ``.proto``), optionally under another service name: how the orchestrator answers
  the earlier ``accelerator_orchestrator.v1alpha1`` name with the same handlers.
* :func:`server_credentials`: TLS and mutual TLS from PEM files.
* :func:`live_peers`: the peers of every open server connection in this process (channelz), which
  is how the orchestrator shim tells that a holder's connection is gone.

The client half (:func:`timeslice_client._grpc.runtime.channel_credentials`) stays with the stubs.
"""

from __future__ import annotations

import importlib
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

__all__ = [
    "SERVER_OPTIONS",
    "Handler",
    "bind",
    "live_peers",
    "normalize_peer",
    "server_credentials",
]

log = logging.getLogger("timeslice.grpc")

Handler = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]

#: Server options: channelz on (connection liveness), and keepalive pings so that a peer that
#: vanished without closing its connection (host down, network cut) is dropped within ~20 s.
SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.enable_channelz", 1),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
)


def bind(
    server: grpc.aio.Server, service: ServiceDescriptor, handlers: Mapping[str, Handler], *, name: str | None = None
) -> str:
    """Serve every method of ``service`` with ``handlers[method name]``, under ``name`` (default: the service's
    own full name). Returns the name served. A unary method's handler takes the request and returns the response;
    a streaming one's reads and writes through its context (``await ctx.read()``, ``await ctx.write(...)``)."""
    served = name or service.full_name
    missing = [m.name for m in service.methods if m.name not in handlers]
    if missing:
        raise ValueError(f"no handler for {served}/{', '.join(missing)}")
    methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for m in service.methods:
        req = message_factory.GetMessageClass(m.input_type)
        resp = message_factory.GetMessageClass(m.output_type)
        make = _HANDLER_KINDS[(m.client_streaming, m.server_streaming)]
        methods[m.name] = make(
            handlers[m.name], request_deserializer=req.FromString, response_serializer=resp.SerializeToString
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(served, methods),))
    register = getattr(server, "add_registered_method_handlers", None)
    if register is not None:  # grpcio >= 1.63: a faster path for known methods
        register(served, methods)
    return served


_HANDLER_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}  # (client streaming, server streaming) -> how grpc serves that method


def _read(path: str | Path | None) -> bytes | None:
    return Path(path).expanduser().read_bytes() if path else None


def server_credentials(
    cert: str | Path, key: str | Path, client_ca: str | Path | None = None
) -> grpc.ServerCredentials:
    """TLS with the server's certificate chain and key; with ``client_ca``, mutual TLS: clients must
    present a certificate signed by that CA."""
    cert_b, key_b = _read(cert), _read(key)
    assert cert_b is not None and key_b is not None
    ca = _read(client_ca)
    return grpc.ssl_server_credentials([(key_b, cert_b)], root_certificates=ca, require_client_auth=ca is not None)


def normalize_peer(peer: str) -> str:
    """``ipv6:%5B::1%5D:5000`` and ``ipv6:[::1]:5000`` are the same peer."""
    return urllib.parse.unquote(peer.strip())


_channelz_warned = False


def live_peers() -> set[str] | None:
    """Peers (as ``context.peer()`` names them) of every open connection of every gRPC server in this
    process, from channelz; ``None`` when that cannot be known (then callers must assume alive)."""
    global _channelz_warned
    try:
        cygrpc: Any = importlib.import_module("grpc._cython.cygrpc")
        peers: set[str] = set()
        servers: list[dict[str, Any]] = []
        start = 0
        while True:
            page = json.loads(cygrpc.channelz_get_servers(start))
            batch = page.get("server", [])
            servers.extend(batch)
            if page.get("end", True) or not batch:
                break
            start = max(int(s["ref"]["serverId"]) for s in batch) + 1
        if not servers:
            return None
        for s in servers:
            sid, start = int(s["ref"]["serverId"]), 0
            while True:
                page = json.loads(cygrpc.channelz_get_server_sockets(sid, start, 0))
                refs = page.get("socketRef", [])
                for r in refs:
                    peers.add(normalize_peer(str(r.get("name", "")).split()[-1] if r.get("name") else ""))
                if page.get("end", True) or not refs:
                    break
                start = max(int(r["socketId"]) for r in refs) + 1
        return peers
    except Exception as exc:  # channelz is not a public Python API: degrade, loudly, once
        if not _channelz_warned:
            _channelz_warned = True
            log.warning("cannot read gRPC connections from channelz (%r); holders' connections are assumed alive", exc)
        return None
