"""What timeslice's own services share with one another and with the client library: no part of the public API.

For the orchestrator, the node agent and the ``timeslice`` command (``services/``), and for the tests and benches
that drive them; never for a job. Nothing here is re-exported by ``timeslice_client``, nothing here keeps a name
from one release to the next, and a job that imports it gets no help when it moves (the same contract as
``pip._internal``).

Why a home of its own: the services never import each other (docs/architecture.md), so what two of them need
lives in the one distribution both install, ``timeslice-client``. Before, it lay among the client's own private
modules, and a reader could not tell ``_async_client`` (the job's lock, private to the library) from the metrics
server (shared by the services). The rule now: a service imports from ``timeslice_client`` its public modules
(``protocol``, ``bus``, ``errors``, ...), the wire pieces both ends of an exchange need (``_grpc``'s stubs,
``_names``, ``_bounds``, ``_agent_socket``), three rules the client owns and the services follow (``_bus_auth``: how
a connection's identity is found, with the ``--creds``/``--tls-*`` flags that feed it; ``_publish_rules.transient``:
which bus errors are worth a retry; ``_group_reads.read_after``: how a read waits for a group's record to reflect a
caller's calls, for the gRPC shim's GetGroupStatus as for ``status()``), and this package; the library's other
``_`` modules are its own.
``tests/test_public_api.py`` holds the services to that list.

Modules (the names carry no underscore: the package's already says private):

* ``metrics_http``: the Prometheus endpoint of ``--metrics-port`` (orchestrator, agent, ``timeslice up``).
* ``runner``: runs a service's main coroutine, on uvloop where it is installed.
* ``grpc_server``: the server side of the gRPC shims: who may call, who a caller is, the port and its door.
* ``bus_layout``: the JetStream stream and key-value buckets, made where missing (``ensure_bus``, ``BusConfig``);
  connecting stays public, in ``timeslice_client.bus``.

A module here may need what only ``timeslice-server`` installs (``prometheus_client``, ``cryptography``): a job's
environment lacks them, which is fine, since nothing a job imports loads this package.
"""
