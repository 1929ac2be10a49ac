"""The snapshot agent's Prometheus metrics, derived from each operation's ``OpResult``.

Labels are the backend chain (``app_channel``, ``freeze+cuda``: bounded by the agent's configuration),
the operation (``snapshot``/``restore``) and a fixed outcome. Job ids and op ids are never labels: they
are unbounded; the event stream has them (``timeslice events``, ``timeslice replay``).
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from timeslice_client._internal.duration_buckets import DURATION_BUCKETS
from timeslice_client._internal.metrics_http import MetricsEndpoint, MetricsServerError, serve_metrics
from timeslice_client.protocol import OpResult

from ._untrusted import REFUSALS

__all__ = [
    "DURATION_BUCKETS",
    "OUTCOMES",
    "REFUSALS",
    "SOURCES",
    "TASKS",
    "AgentMetrics",
    "MetricsEndpoint",
    "MetricsServerError",
    "serve_metrics",
]

# DURATION_BUCKETS (``_internal.duration_buckets``: 1-2.5-5 per decade, 100 µs to 60 s) fit an operation: one with
# nothing to move (noop, SIGSTOP of a few processes) takes well under a millisecond; an app_channel offload of a
# few GB to pinned host memory 0.1-1 s; a CUDA checkpoint of a full 80-141 GB device 5-30 s. Past 60 s an
# operation is near its default 120 s timeout and lands in +Inf (counted in _sum).

OUTCOMES: Final = (
    "ok",  # the backends moved the state
    "noop",  # nothing to move (already saved, already running, never ran)
    "rolled_back",  # a snapshot failed and was undone: the job runs again
    "failed",  # the operation failed; the job is FAULTED on this node
    "refused",  # not attempted: stale epoch, unknown or faulted job, deadline passed
)

# Where a refused message came from (REFUSALS: why); "pods": the Kubernetes pod list (_pod_discovery).
SOURCES: Final = ("command", "rpc", "grpc", "kv", "socket", "pods")
# Where an unexpected error was caught.
TASKS: Final = ("operation", "standalone", "pid_check", "rpc", "command", "pod_scan")


class AgentMetrics:
    """The agent's metrics on ``registry``; the agent calls :meth:`operation` once per operation it answers."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.duration = Histogram(
            "timeslice_agent_operation_seconds",
            "Time the backends took for a snapshot or restore that ran.",
            ["backend", "operation"],
            registry=r,
            buckets=DURATION_BUCKETS,
        )
        self.bytes_moved = Counter(
            "timeslice_agent_bytes_moved",
            "Bytes copied between device and host by operations that ran.",
            ["backend", "operation"],
            registry=r,
        )
        self.device_bytes_freed = Counter(
            "timeslice_agent_device_bytes_freed",
            "Device memory released by operations that ran.",
            ["backend", "operation"],
            registry=r,
        )
        self.outcomes = Counter(
            "timeslice_agent_operations",
            "Operations answered, by outcome: " + ", ".join(OUTCOMES) + ".",
            ["backend", "operation", "outcome"],
            registry=r,
        )
        self.overlapped = Counter(
            "timeslice_agent_restores_overlapped",
            "Restores started beside the snapshots they follow, the node "
            "having room for both contexts (Restore.after; see AgentConfig.overlap_restores).",
            ["backend"],
            registry=r,
        )

        self.commands = Counter(
            "timeslice_agent_commands",
            "Commands received: from the stream (the agent's durable consumer), or "
            "handed over directly by the orchestrator this agent runs beside (its stream copy is then only "
            "acknowledged).",
            ["via"],
            registry=r,
        )
        self.stale_commands = Counter(
            "timeslice_agent_stale_commands",
            "Commands answered without running, their epoch older than their group's newest here or their job's "
            "(delivered again after a restart of this agent, whose durable consumer resumes at its ack floor; or of an "
            "earlier life of a job registered afresh). Counted in timeslice_agent_operations as refused too.",
            registry=r,
        )
        self.refused = Counter(
            "timeslice_agent_refused",
            "Messages refused as malformed (and acknowledged, for a command), by where "
            "they came from (" + ", ".join(SOURCES) + ") and why (" + ", ".join(REFUSALS) + ").",
            ["source", "reason"],
            registry=r,
        )
        self.task_errors = Counter(
            "timeslice_agent_task_errors",
            "Unexpected exceptions caught in the agent's own tasks ("
            + ", ".join(TASKS)
            + "): logged and answered where possible; the agent goes on.",
            ["task"],
            registry=r,
        )

    def refusal(self, source: str, reason: str) -> None:
        """Count one refused message (both labels from fixed sets)."""
        if source not in SOURCES or reason not in REFUSALS:
            raise ValueError(
                f"unknown refusal {source!r}/{reason!r}; expected a source in {SOURCES} and a reason in {REFUSALS}"
            )
        self.refused.labels(source, reason).inc()

    def task_error(self, task: str) -> None:
        """Count one unexpected exception caught in one of the agent's tasks."""
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
        self.task_errors.labels(task).inc()

    def operation(self, result: OpResult, outcome: str) -> None:
        """Record one answered operation; duration and bytes only for operations that ran."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        backend, op = result.backend or "none", str(result.kind)
        self.outcomes.labels(backend, op, outcome).inc()
        if outcome in ("ok", "rolled_back", "failed") and result.elapsed_ms > 0:
            self.duration.labels(backend, op).observe(result.elapsed_ms / 1000)
            if result.bytes_moved:
                self.bytes_moved.labels(backend, op).inc(result.bytes_moved)
            if result.device_bytes_freed:
                self.device_bytes_freed.labels(backend, op).inc(result.device_bytes_freed)
