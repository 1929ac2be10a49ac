"""A gRPC client built from the ``.proto`` files alone, as any existing client of the published API is:
protoc compiles ``schemas/proto`` into a temporary directory, and the stubs are plain
``channel.unary_unary('/<package>.<Service>/<Method>', ...)`` callables, used with the blocking API
(exactly what generated stubs do). Nothing from ``timeslice_client`` is used.
"""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import grpc
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "schemas" / "proto"

_cache: dict[str, ModuleType] = {}


def compile_proto(rel: str) -> ModuleType:
    """protoc ``schemas/proto/<rel>`` → its ``_pb2`` module, imported under a private name."""
    if rel in _cache:
        return _cache[rel]
    include = str(resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory(prefix="ts-proto-client-") as out:
        rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out}", rel])
        assert rc == 0, f"protoc failed on {rel}"
        path = Path(out) / rel.replace(".proto", "_pb2.py")
        spec = importlib.util.spec_from_file_location(f"proto_only_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    _cache[rel] = mod
    return mod


ORCHESTRATOR_PROTO = "timeslice_orchestrator/v1alpha1/timeslice_orchestrator.proto"
LEGACY_PROTO = "accelerator_orchestrator/v1alpha1/accelerator_orchestrator.proto"
AGENT_PROTO = "snapshot_agent/v1alpha1/snapshot_agent.proto"


T = TypeVar("T")


@contextlib.contextmanager
def held(acquire: Callable[[], T], release: Callable[[], object]) -> Iterator[T]:
    """A gRPC client's ``on_accelerators``: ``acquire()``'s reply for the block, then ``release()`` however the block
    ended (an acquire that failed released nothing)."""
    result = acquire()
    try:
        yield result
    finally:
        release()


class Stub:
    """Blocking stub of one service: ``stub.Acquire(stub.pb.AcquireRequest(...), timeout=...)``."""

    def __init__(self, channel: grpc.Channel, pb: ModuleType, service: str) -> None:
        self.pb = pb
        svc = pb.DESCRIPTOR.services_by_name[service]
        self.service = svc.full_name
        for m in svc.methods:
            req = getattr(pb, m.input_type.name)
            resp = getattr(pb, m.output_type.name)
            setattr(
                self,
                m.name,
                channel.unary_unary(
                    f"/{svc.full_name}/{m.name}",
                    request_serializer=req.SerializeToString,
                    response_deserializer=resp.FromString,
                ),
            )

    def __getattr__(self, name: str) -> Any:  # for type checkers: methods are set in __init__
        raise AttributeError(name)


class OrchestratorClient:
    """What an existing client of the orchestrator API does (acquire / release / status / with-block)."""

    def __init__(
        self,
        target: str,
        *,
        legacy: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        job_id: str | None = None,
        group_id: str | None = None,
        own_connection: bool = False,
        token: str | None = None,
    ) -> None:
        pb = compile_proto(LEGACY_PROTO if legacy else ORCHESTRATOR_PROTO)
        service = "AcceleratorOrchestratorService" if legacy else "TimeSliceOrchestratorService"
        # Channels of one process to one target share their connection unless told otherwise.
        options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
        self.channel = (
            grpc.secure_channel(target, credentials, options)
            if credentials is not None
            else grpc.insecure_channel(target, options)
        )
        self.stub = Stub(self.channel, pb, service)
        self.pb = pb
        self.job_id, self.group_id = job_id, group_id
        # A bearer token as plain metadata (works on plaintext loopback too; grpc's call credentials need TLS).
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None

    def acquire(self, job_id: str | None = None, group_id: str | None = None, timeout: float | None = None) -> Any:
        req = self.pb.AcquireRequest(job_id=job_id or self.job_id, group_id=group_id or self.group_id)
        return self.stub.Acquire(req, timeout=timeout, metadata=self.metadata)

    def acquire_future(
        self, job_id: str | None = None, group_id: str | None = None, timeout: float | None = None
    ) -> Any:
        req = self.pb.AcquireRequest(job_id=job_id or self.job_id, group_id=group_id or self.group_id)
        return self.stub.Acquire.future(req, timeout=timeout, metadata=self.metadata)

    def release(self, job_id: str | None = None, group_id: str | None = None, timeout: float | None = 10) -> Any:
        req = self.pb.YieldRequest(job_id=job_id or self.job_id, group_id=group_id or self.group_id)
        return self.stub.Yield(req, timeout=timeout, metadata=self.metadata)

    def list_groups(self, timeout: float | None = 10) -> list[str]:
        reply = self.stub.ListGroups(self.pb.ListGroupsRequest(), timeout=timeout, metadata=self.metadata)
        return list(reply.group_ids)

    def get_status(self, group_id: str | None = None, timeout: float | None = 10) -> Any:
        return self.stub.GetGroupStatus(
            self.pb.GetGroupStatusRequest(group_id=group_id or self.group_id), timeout=timeout, metadata=self.metadata
        )

    def on_accelerators(
        self, job_id: str | None = None, group_id: str | None = None, timeout: float | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        return held(lambda: self.acquire(job_id, group_id, timeout), lambda: self.release(job_id, group_id))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> OrchestratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
