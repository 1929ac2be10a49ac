"""The gRPC contract: the .proto files say exactly what the published API says, the committed stubs are
what protoc makes of them (regenerated here; drift fails), and the core client import stays light."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor, FileDescriptor
from timeslice_client._grpc import (
    accelerator_orchestrator_pb2,
    generate,
    snapshot_agent_pb2,
    timeslice_orchestrator_pb2,
)

pytest.importorskip("grpc_tools")

T = FieldDescriptor
# (message, field, number, type, repeated, message/enum type name or "") as the published API has them.
ORCHESTRATOR_FIELDS = [
    ("AcquireRequest", "job_id", 1, T.TYPE_STRING, False, ""),
    ("AcquireRequest", "group_id", 2, T.TYPE_STRING, False, ""),
    ("AcquireResponse", "success", 1, T.TYPE_BOOL, False, ""),
    ("AcquireResponse", "waited_ms", 2, T.TYPE_INT64, False, ""),
    ("AcquireResponse", "context_restored", 3, T.TYPE_BOOL, False, ""),
    ("YieldRequest", "job_id", 1, T.TYPE_STRING, False, ""),
    ("YieldRequest", "group_id", 2, T.TYPE_STRING, False, ""),
    ("YieldResponse", "success", 1, T.TYPE_BOOL, False, ""),
    ("YieldResponse", "pending_waiters", 2, T.TYPE_INT64, False, ""),
    ("YieldResponse", "snapshot_deferred", 3, T.TYPE_BOOL, False, ""),
    ("ListGroupsResponse", "group_ids", 1, T.TYPE_STRING, True, ""),
    ("GetGroupStatusRequest", "group_id", 1, T.TYPE_STRING, False, ""),
    ("GetGroupStatusResponse", "group", 1, T.TYPE_MESSAGE, False, "GroupStatus"),
    ("GetGroupStatusResponse", "agent_job_states", 2, T.TYPE_MESSAGE, True, "SnapshotAgentJobState"),
    ("GroupStatus", "group_id", 1, T.TYPE_STRING, False, ""),
    ("GroupStatus", "group_state", 2, T.TYPE_ENUM, False, "State"),
    ("GroupStatus", "state_timestamp", 3, T.TYPE_MESSAGE, False, "Timestamp"),
    ("GroupStatus", "locking_job", 4, T.TYPE_STRING, False, ""),
    ("GroupStatus", "active_job", 5, T.TYPE_STRING, False, ""),
    ("GroupStatus", "waiter_queue_depth", 6, T.TYPE_INT64, False, ""),
    ("GroupStatus", "loaded_job", 7, T.TYPE_STRING, False, ""),
    ("SnapshotAgentJobState", "agent", 1, T.TYPE_STRING, False, ""),
    ("SnapshotAgentJobState", "job_state", 2, T.TYPE_ENUM, False, "State"),
    ("SnapshotAgentJobState", "job_id", 3, T.TYPE_STRING, False, ""),
]
ORCHESTRATOR_ENUMS = {
    "GroupStatus.State": [
        "STATE_UNSPECIFIED",
        "STATE_UNKNOWN",
        "STATE_IDLE",
        "STATE_IDLE_YIELDED",
        "STATE_LOCKED",
        "STATE_SWITCHING",
    ],
    "SnapshotAgentJobState.State": [
        "STATE_UNSPECIFIED",
        "STATE_IDLE",
        "STATE_RUNNING",
        "STATE_TRANSITIONING",
        "STATE_SAVED",
        "STATE_FAULTED",
    ],
}
AGENT_FIELDS = [
    ("SnapshotRequest", "job_id", 1, T.TYPE_STRING, False, ""),
    ("SnapshotRequest", "group", 2, T.TYPE_STRING, False, ""),
    ("SnapshotRequest", "backend", 3, T.TYPE_ENUM, False, "Backend"),
    ("SnapshotRequest", "backend_config", 4, T.TYPE_MESSAGE, False, "BackendConfig"),
    ("SnapshotResponse", "operation_id", 1, T.TYPE_STRING, False, ""),
    ("RestoreRequest", "job_id", 1, T.TYPE_STRING, False, ""),
    ("RestoreRequest", "group", 2, T.TYPE_STRING, False, ""),
    ("RestoreRequest", "backend", 3, T.TYPE_ENUM, False, "Backend"),
    ("RestoreRequest", "backend_config", 4, T.TYPE_MESSAGE, False, "BackendConfig"),
    ("RestoreResponse", "operation_id", 1, T.TYPE_STRING, False, ""),
    ("GetOperationRequest", "operation_id", 1, T.TYPE_STRING, False, ""),
    ("GetOperationResponse", "status", 1, T.TYPE_ENUM, False, "OperationStatus"),
    ("GetOperationResponse", "storage_bytes", 2, T.TYPE_INT64, False, ""),
    ("GetOperationResponse", "snapshot_device_bytes", 3, T.TYPE_INT64, False, ""),
    ("GetOperationResponse", "elapsed_ms", 4, T.TYPE_INT64, False, ""),
    ("GetOperationResponse", "error", 5, T.TYPE_STRING, False, ""),
    ("JobStatus", "job_id", 1, T.TYPE_STRING, False, ""),
    ("JobStatus", "state", 2, T.TYPE_ENUM, False, "JobState"),
    ("AcceleratorStatus", "id", 1, T.TYPE_STRING, False, ""),
    ("AcceleratorStatus", "memory_used_bytes", 2, T.TYPE_INT64, False, ""),
    ("AcceleratorStatus", "memory_total_bytes", 3, T.TYPE_INT64, False, ""),
    ("StatusResponse", "job_statuses", 1, T.TYPE_MESSAGE, True, "JobStatus"),
    ("StatusResponse", "accelerator_statuses", 2, T.TYPE_MESSAGE, True, "AcceleratorStatus"),
    ("BackendConfig", "cuda", 1, T.TYPE_MESSAGE, False, "CudaBackendConfig"),
    ("BackendConfig", "app_endpoint", 2, T.TYPE_MESSAGE, False, "AppEndpointConfig"),
    ("BackendConfig", "app_channel", 3, T.TYPE_MESSAGE, False, "AppChannelConfig"),
    ("BackendConfig", "direct_memory", 4, T.TYPE_MESSAGE, False, "DirectMemoryBackendConfig"),
    ("BackendConfig", "memory_regions", 5, T.TYPE_MESSAGE, False, "MemoryRegionsBackendConfig"),
    ("CudaBackendConfig", "explicit_target", 1, T.TYPE_MESSAGE, False, "ProcessTarget"),
    ("DirectMemoryBackendConfig", "explicit_target", 1, T.TYPE_MESSAGE, False, "ProcessTarget"),
    ("ProcessTarget", "pids", 1, T.TYPE_INT32, True, ""),
    ("AppEndpointConfig", "app", 1, T.TYPE_ENUM, False, "App"),
    ("AppEndpointConfig", "endpoints", 2, T.TYPE_STRING, True, ""),
    ("AppEndpointConfig", "mode", 3, T.TYPE_ENUM, False, "SuspendMode"),
    ("AppEndpointConfig", "tags", 4, T.TYPE_STRING, True, ""),
    ("AppChannelConfig", "mode", 1, T.TYPE_ENUM, False, "SuspendMode"),
    ("AppChannelConfig", "tags", 2, T.TYPE_STRING, True, ""),
    ("MemoryRegionsBackendConfig", "regions", 1, T.TYPE_MESSAGE, True, "MemoryRegion"),
    ("MemoryRegionsBackendConfig", "snapshot_name", 2, T.TYPE_STRING, False, ""),
    ("MemoryRegion", "pid", 1, T.TYPE_INT32, False, ""),
    ("MemoryRegion", "address", 2, T.TYPE_UINT64, False, ""),
    ("MemoryRegion", "size_bytes", 3, T.TYPE_UINT64, False, ""),
    ("WorkloadCapabilities", "supported_modes", 1, T.TYPE_ENUM, True, "SuspendMode"),
    ("WorkloadCapabilities", "default_mode", 2, T.TYPE_ENUM, False, "SuspendMode"),
    ("WorkloadCapabilities", "tags", 3, T.TYPE_STRING, True, ""),
    ("RegisterWorkload", "job_id", 1, T.TYPE_STRING, False, ""),
    ("RegisterWorkload", "group", 2, T.TYPE_STRING, False, ""),
    ("RegisterWorkload", "capabilities", 3, T.TYPE_MESSAGE, False, "WorkloadCapabilities"),
    ("CommandResult", "command_id", 1, T.TYPE_STRING, False, ""),
    ("CommandResult", "ok", 2, T.TYPE_BOOL, False, ""),
    ("CommandResult", "error", 3, T.TYPE_STRING, False, ""),
    ("WorkloadMessage", "register", 1, T.TYPE_MESSAGE, False, "RegisterWorkload"),
    ("WorkloadMessage", "result", 2, T.TYPE_MESSAGE, False, "CommandResult"),
    ("SnapshotCommand", "mode", 1, T.TYPE_ENUM, False, "SuspendMode"),
    ("SnapshotCommand", "tags", 2, T.TYPE_STRING, True, ""),
    ("RestoreCommand", "tags", 1, T.TYPE_STRING, True, ""),
    ("AgentCommand", "command_id", 1, T.TYPE_STRING, False, ""),
    ("AgentCommand", "snapshot", 2, T.TYPE_MESSAGE, False, "SnapshotCommand"),
    ("AgentCommand", "restore", 3, T.TYPE_MESSAGE, False, "RestoreCommand"),
]
AGENT_ENUMS = {
    "Backend": ["BACKEND_UNSPECIFIED", "BACKEND_CUDA"],
    "OperationStatus": [
        "OPERATION_STATUS_UNSPECIFIED",
        "OPERATION_STATUS_PENDING",
        "OPERATION_STATUS_COMPLETE",
        "OPERATION_STATUS_FAILED",
    ],
    "JobState": [
        "JOB_STATE_UNSPECIFIED",
        "JOB_STATE_IDLE",
        "JOB_STATE_RUNNING",
        "JOB_STATE_TRANSITIONING",
        "JOB_STATE_SAVED",
        "JOB_STATE_FAULTED",
    ],
    "App": ["APP_UNSPECIFIED", "APP_VLLM", "APP_SGLANG"],
    "SuspendMode": ["SUSPEND_MODE_UNSPECIFIED", "SUSPEND_MODE_OFFLOAD", "SUSPEND_MODE_DISCARD"],
}


def _check_fields(fd: FileDescriptor, fields: list[tuple[str, str, int, int, bool, str]]) -> None:
    for msg, name, number, typ, repeated, type_name in fields:
        f = fd.message_types_by_name[msg].fields_by_name[name]
        assert (f.number, f.type, f.is_repeated) == (number, typ, repeated), (msg, name)
        target = f.message_type or f.enum_type
        assert (target.name if target else "") == type_name, (msg, name)


def _enum(fd: FileDescriptor, path: str) -> EnumDescriptor:
    parts = path.split(".")
    if len(parts) == 1:
        return fd.enum_types_by_name[parts[0]]
    return fd.message_types_by_name[parts[0]].enum_types_by_name[parts[1]]


@pytest.mark.parametrize(
    ("module", "package", "service"),
    [
        (timeslice_orchestrator_pb2, "timeslice_orchestrator.v1alpha1", "TimeSliceOrchestratorService"),
        (accelerator_orchestrator_pb2, "accelerator_orchestrator.v1alpha1", "AcceleratorOrchestratorService"),
    ],
)
def test_orchestrator_contract(module: object, package: str, service: str) -> None:
    fd: FileDescriptor = module.DESCRIPTOR  # type: ignore[attr-defined]
    assert fd.package == package
    svc = fd.services_by_name[service]
    assert [(m.name, m.input_type.name, m.output_type.name) for m in svc.methods] == [
        ("Acquire", "AcquireRequest", "AcquireResponse"),
        ("Yield", "YieldRequest", "YieldResponse"),
        ("ListGroups", "ListGroupsRequest", "ListGroupsResponse"),
        ("GetGroupStatus", "GetGroupStatusRequest", "GetGroupStatusResponse"),
    ]
    _check_fields(fd, ORCHESTRATOR_FIELDS)
    for path, values in ORCHESTRATOR_ENUMS.items():
        assert [(v.name, v.number) for v in _enum(fd, path).values] == [(v, i) for i, v in enumerate(values)]
    ts = fd.message_types_by_name["GroupStatus"].fields_by_name["state_timestamp"].message_type
    assert ts.full_name == "google.protobuf.Timestamp"


def _shape(d: Descriptor) -> object:
    fields = [(f.name, f.number, f.type, f.is_repeated, (f.message_type or f.enum_type or d).name) for f in d.fields]
    return (
        d.name,
        fields,
        [(e.name, [(v.name, v.number) for v in e.values]) for e in d.enum_types],
        [_shape(n) for n in d.nested_types],
    )


def test_legacy_name_has_identical_messages() -> None:
    """The server answers the earlier service name with the current message classes: sound only if
    every message is the same on the wire."""
    new, old = timeslice_orchestrator_pb2.DESCRIPTOR, accelerator_orchestrator_pb2.DESCRIPTOR
    assert sorted(new.message_types_by_name) == sorted(old.message_types_by_name)
    for name, d in new.message_types_by_name.items():
        assert _shape(d) == _shape(old.message_types_by_name[name]), name
    a = new.services_by_name["TimeSliceOrchestratorService"].methods
    b = old.services_by_name["AcceleratorOrchestratorService"].methods
    assert [(m.name, m.input_type.name, m.output_type.name) for m in a] == [
        (m.name, m.input_type.name, m.output_type.name) for m in b
    ]


def test_agent_contract() -> None:
    fd = snapshot_agent_pb2.DESCRIPTOR
    assert fd.package == "snapshot_agent.v1alpha1"
    svc = fd.services_by_name["SnapshotAgentService"]
    assert [(m.name, m.input_type.name, m.output_type.name) for m in svc.methods] == [
        ("Snapshot", "SnapshotRequest", "SnapshotResponse"),
        ("Restore", "RestoreRequest", "RestoreResponse"),
        ("GetOperation", "GetOperationRequest", "GetOperationResponse"),
        ("Status", "StatusRequest", "StatusResponse"),
        ("WorkloadChannel", "WorkloadMessage", "AgentCommand"),
    ]
    channel = svc.methods_by_name["WorkloadChannel"]
    assert channel.client_streaming and channel.server_streaming
    _check_fields(fd, AGENT_FIELDS)
    for path, values in AGENT_ENUMS.items():
        assert [(v.name, v.number) for v in _enum(fd, path).values] == [(v, i) for i, v in enumerate(values)]
    resp = fd.message_types_by_name["GetOperationResponse"].fields_by_name
    assert [n for n in ("storage_bytes", "snapshot_device_bytes", "elapsed_ms", "error") if resp[n].has_presence] == [
        "storage_bytes",
        "snapshot_device_bytes",
        "error",
    ]  # proto3 `optional`
    oneof = fd.message_types_by_name["BackendConfig"].oneofs_by_name["backend"]
    assert [f.name for f in oneof.fields] == ["cuda", "app_endpoint", "app_channel", "direct_memory", "memory_regions"]
    for msg, name, fields in (
        ("WorkloadMessage", "message", ["register", "result"]),
        ("AgentCommand", "command", ["snapshot", "restore"]),
    ):
        assert [f.name for f in fd.message_types_by_name[msg].oneofs_by_name[name].fields] == fields
    req = fd.message_types_by_name["SnapshotRequest"].fields_by_name["backend"]
    assert req.GetOptions().deprecated


def test_committed_stubs_match_protos() -> None:
    """Regenerates into a temporary directory and compares with the committed files."""
    assert generate.check() == []


def test_drift_is_caught(tmp_path: Path) -> None:
    protos = tmp_path / "proto"
    shutil.copytree(generate.PROTO_DIR, protos)
    f = protos / "snapshot_agent/v1alpha1/snapshot_agent.proto"
    f.write_text(f.read_text().replace("int64 elapsed_ms = 4;", "int64 elapsed_ms = 6;"))
    problems = generate.check(proto_dir=protos)
    assert any(p.startswith("snapshot_agent_pb2.py: differs") for p in problems), problems
    # with another grpcio-tools only the descriptors are compared: still caught
    problems = generate.check(proto_dir=protos, generated_with="0.0.0")
    assert [p.split(":")[0] for p in problems] == ["snapshot_agent_pb2.py"]
    out = tmp_path / "out"
    out.mkdir()
    written = generate.generate(out, protos)
    assert len(written) == 10 and generate.check(out, protos) == []
    assert "from . import snapshot_agent_pb2 as" in (out / "snapshot_agent_pb2_grpc.py").read_text()


def test_generated_service_stubs_import() -> None:
    for name, service in (
        ("timeslice_orchestrator", "TimeSliceOrchestratorService"),
        ("accelerator_orchestrator", "AcceleratorOrchestratorService"),
        ("snapshot_agent", "SnapshotAgentService"),
    ):
        mod = importlib.import_module(f"timeslice_client._grpc.{name}_pb2_grpc")
        for attr in (f"{service}Stub", f"{service}Servicer", f"add_{service}Servicer_to_server"):
            assert hasattr(mod, attr), (name, attr)


def test_check_command_and_light_core_import() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "timeslice_client._grpc.generate", "--check"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    code = (
        "import sys, timeslice_client; heavy = [m for m in ('grpc', 'google.protobuf') if m in sys.modules]; "
        "assert not heavy, heavy; timeslice_client.SnapshotAgentClient; assert 'grpc' in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_earlier_names_proto_is_generated_and_an_edit_is_caught(tmp_path: Path) -> None:
    """``accelerator_orchestrator.proto`` is derived from ``timeslice_orchestrator.proto``: a hand edit of either is
    reported until ``generate`` runs again, and after it the two differ only in package and service names."""
    protos = tmp_path / "proto"
    shutil.copytree(generate.PROTO_DIR, protos)
    legacy, src = protos / generate.LEGACY[0], protos / generate.LEGACY[1]
    assert legacy.read_text() == generate.derive_legacy(protos)
    legacy.write_text(legacy.read_text().replace("string job_id = 1;", "string job_id = 9;", 1))
    assert any(p.startswith(generate.LEGACY[0]) for p in generate.check(proto_dir=protos, generated_with="0.0.0"))
    src.write_text(src.read_text().replace("int64 waited_ms = 2;", "int64 waited_ms = 7;"))
    out = tmp_path / "out"
    out.mkdir()
    generate.generate(out, protos)
    assert generate.check(out, protos) == []
    text = legacy.read_text()
    assert "int64 waited_ms = 7;" in text and "string job_id = 1;" in text
    assert text.startswith("// Generated by `python -m timeslice_client._grpc.generate`")
    renamed = src.read_text()
    for old, new in generate.LEGACY[2]:
        renamed = renamed.replace(old, new)
    assert text[text.index("syntax = ") :] == renamed[renamed.index("syntax = ") :]
