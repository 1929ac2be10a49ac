"""timeslice snapshot agent: the node-local daemon that moves job contexts off the accelerators and back."""

from .backends import (
    AppChannelBackend,
    Backend,
    BackendError,
    BackendUnavailable,
    FreezeBackend,
    NoopBackend,
    OpContext,
    Outcome,
    register_backend,
)
from .service import Agent, AgentConfig

__all__ = [
    "Agent",
    "AgentConfig",
    "AppChannelBackend",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "FreezeBackend",
    "NoopBackend",
    "OpContext",
    "Outcome",
    "register_backend",
]
