"""The orchestrator's error (re-exported by ``service``)."""

from __future__ import annotations

__all__ = ["OrchestratorError"]


class OrchestratorError(RuntimeError):
    """The orchestrator cannot go on safely (for example another instance writes the same records)."""
