"""The loopback caller's uid, asked of the kernel for the one socket (``_internal.grpc_server.sock_diag``), as the
gRPC shims' local identity uses it (``identity.loopback_peer_uid``): right for a live connection, none once it is
closed."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time

import pytest
from timeslice_client._internal.grpc_server.identity import loopback_peer_uid
from timeslice_client._internal.grpc_server.sock_diag import tcp_socket_uid

from .helpers import eventually_sync

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sock_diag is Linux's")
LO = ipaddress.ip_address("127.0.0.1")


def test_the_uid_of_a_live_loopback_connection_and_none_once_closed() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        mine = client.getsockname()[1]
        assert tcp_socket_uid(LO, mine, LO, port) == os.geteuid()
        assert loopback_peer_uid(f"ipv4:127.0.0.1:{mine}", port) == os.geteuid()
        assert tcp_socket_uid(LO, mine, LO, port + 1 if port < 65535 else port - 1) is None  # not that socket
        client.close()  # no longer established at once (closing, then TIME_WAIT: no owner to name)
        eventually_sync(lambda: tcp_socket_uid(LO, mine, LO, port) is None, timeout=5, what="closed: no uid")


def test_a_dual_stack_client_socket_is_found_by_its_mapped_address() -> None:
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as server:
        port = server.getsockname()[1]
        with socket.socket(socket.AF_INET6) as client:
            client.connect(("::ffff:127.0.0.1", port))
            mine = client.getsockname()[1]
            assert loopback_peer_uid(f"ipv4:127.0.0.1:{mine}", port) == os.geteuid()


def test_a_lookup_is_far_cheaper_than_reading_the_table() -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(("127.0.0.1", server.getsockname()[1])) as client,
    ):
        port, mine = server.getsockname()[1], client.getsockname()[1]
        t0 = time.perf_counter()
        for _ in range(20):
            assert tcp_socket_uid(LO, mine, LO, port) == os.geteuid()
        per_lookup = (time.perf_counter() - t0) / 20
        assert per_lookup < 0.002, f"{per_lookup * 1000:.2f} ms a lookup"
