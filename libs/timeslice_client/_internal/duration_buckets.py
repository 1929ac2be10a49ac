"""The histogram buckets of the services' durations (seconds), one ladder for the orchestrator and the agent.

Three steps per decade (1-2.5-5) from 100 µs to 60 s. The orchestrator's handoffs and acquire waits and the agent's
snapshots and restores are the two ends of the same switch, so they are bucketed alike: a dashboard then lines
their histograms up bucket by bucket. Each service's ``metrics`` says why the ladder fits what it measures.
"""

from __future__ import annotations

from typing import Final

__all__ = ["DURATION_BUCKETS"]

DURATION_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
