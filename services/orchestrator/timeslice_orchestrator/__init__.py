"""timeslice orchestrator: per-group lock queues over NATS JetStream, built as a pure core
(:mod:`timeslice_orchestrator.core`) inside thin I/O shells (:mod:`timeslice_orchestrator.service`)."""

from ._errors import (
    AdviseError,
    AuthError,
    Deposed,
    EmbeddedNatsError,
    LeadershipError,
    LeaderWaitTimeout,
    NotLeader,
    OrchestratorError,
    ReplayError,
    ServiceFailed,
    Unusable,
)
from .core import apply, new_record, next_deadline
from .embedded import NatsServer, find_nats_server
from .metrics import OrchestratorMetrics
from .service import Orchestrator, OrchestratorConfig

__all__ = [
    "AdviseError",
    "AuthError",
    "Deposed",
    "EmbeddedNatsError",
    "LeaderWaitTimeout",
    "LeadershipError",
    "NatsServer",
    "NotLeader",
    "Orchestrator",
    "OrchestratorConfig",
    "OrchestratorError",
    "OrchestratorMetrics",
    "ReplayError",
    "ServiceFailed",
    "Unusable",
    "apply",
    "find_nats_server",
    "new_record",
    "next_deadline",
]
