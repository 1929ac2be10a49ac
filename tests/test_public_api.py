"""The public surface of each package, pinned: a name added to or dropped from an ``__all__`` is a decision that
shows up here (and in the changelog of whoever depends on it), never an accident of a refactor. Every exported
name resolves, and every public module's ``__all__`` lists only what it defines or re-exports."""

from __future__ import annotations

import importlib

import pytest

PINNED: dict[str, set[str]] = {
    "timeslice_client": {
        "AcquireAllFailed", "AcquireAllTimeout", "AcquireCancelled", "AcquireTimeout", "AgentRefused",
        "AsyncSnapshotAgentClient", "AsyncTimeSliceClient", "BusUnreachable", "CallbackHandler", "Grant", "GroupFull",
        "GroupQuarantined", "GroupRecord", "GroupState", "HandlerError", "HandlerResult", "InvalidId", "InvalidNatsUrl",
        "InvalidRequest", "JobFaulted", "JobState", "LeaseExpired", "LockLost", "LockOrderError", "NotHolder",
        "ReleaseResult", "SnapshotAgentClient", "StaleEpoch",
        "SuspendMode", "TimeSliceClient", "TimeSliceError", "Unavailable", "UnresizableStorage", "WorkloadChannel",
        "WorkloadHandler", "register_workload",
    },
    "timeslice_agent": {
        "Agent", "AgentConfig", "AgentMetrics", "AppChannelBackend", "AppEndpointBackend", "Backend",
        "BackendError", "BackendUnavailable", "CheckpointDriver", "CudaBackend", "DriverError", "FreezeBackend",
        "GpuAccounting", "GpuProcess", "GpuSource", "NoopBackend", "OpContext", "OperationInProgress", "Outcome",
        "ProcessState", "available_backends", "register_backend", "unavailable_backends",
    },
    "timeslice_orchestrator": {
        "EmbeddedNatsError", "NatsServer", "Orchestrator", "OrchestratorConfig", "OrchestratorError",
        "OrchestratorMetrics", "apply", "find_nats_server", "new_record", "next_deadline",
    },
}


@pytest.mark.parametrize("package", sorted(PINNED))
def test_the_public_names_are_the_pinned_ones_and_resolve(package: str) -> None:
    mod = importlib.import_module(package)
    exported = set(mod.__all__)
    assert len(exported) == len(mod.__all__), f"{package}.__all__ lists a name twice"
    assert exported == PINNED[package], (f"added: {sorted(exported - PINNED[package])}, "
                                         f"dropped: {sorted(PINNED[package] - exported)}")
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"


@pytest.mark.parametrize("module", ["timeslice_client.protocol", "timeslice_client.bus", "timeslice_client.errors",
                                    "timeslice_client.handlers", "timeslice_client.workload",
                                    "timeslice_client.agent_client", "timeslice_agent.backends",
                                    "timeslice_orchestrator.core", "timeslice_orchestrator.service"])
def test_every_public_modules_all_resolves(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in getattr(mod, "__all__", ()) if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names what it does not define: {missing}"
