"""timeslice orchestrator: per-group lock queues over NATS JetStream, built as a pure core
(:mod:`timeslice_orchestrator.core`) inside thin I/O shells (:mod:`timeslice_orchestrator.service`)."""

from .core import apply, new_record, next_deadline
from .embedded import EmbeddedNatsError, NatsServer, find_nats_server
from .metrics import OrchestratorMetrics
from .service import Orchestrator, OrchestratorConfig, OrchestratorError

__all__ = [
    "EmbeddedNatsError",
    "NatsServer",
    "Orchestrator",
    "OrchestratorConfig",
    "OrchestratorError",
    "OrchestratorMetrics",
    "apply",
    "find_nats_server",
    "new_record",
    "next_deadline",
]
