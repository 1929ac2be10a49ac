"""The server side of the gRPC shims (the orchestrator's and the agent's): the door each call passes through.

* ``auth_config``: who may call, as settings and command-line flags (no gRPC import: the CLIs add the flags cheaply).
* ``identity``: who a caller is (bearer token, client certificate, the local user) and what it may do.
* ``sock_diag``: the uid that owns a loopback TCP socket, asked of the kernel (the local user's identity).
* ``guard``: the port a shim listens on, and the answer to a caller that may not do what it asks.
* ``serving``: binding a service from its descriptor, server TLS, and the connections open now (channelz).

The generated stubs and the client's channel TLS (``runtime.channel_credentials``) stay in ``timeslice_client._grpc``:
the job's ``SnapshotAgentClient`` uses them.
"""
