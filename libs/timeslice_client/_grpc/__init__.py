"""Private protobuf/gRPC stubs generated from ``schemas/proto`` (see ``generate.py``; never edit them).

Modules: ``timeslice_orchestrator_pb2``, ``accelerator_orchestrator_pb2`` and ``snapshot_agent_pb2``
(messages, with ``.pyi`` types), and their ``*_pb2_grpc`` (the standard generated stubs and
servicers, for anyone who wants them; timeslice binds its services from the descriptors instead, so
its runtime does not depend on the generated grpc version check).
"""

#: The grpcio-tools version the committed stubs were generated with.
GENERATED_WITH = "1.85.1"
