"""``timeslice demo``: RL training jobs (GRPO on a toy task, torch or numpy) time-slicing one accelerator
through the real stack (nats-server, orchestrator, snapshot agent), run back to back and then shared, with
a report of wall times, the lock's figures and a bit-identity check of the final weights.

The jobs are ``python -m timeslice_cli.demo._job`` processes; see that module for the loop.
"""

from ._cli import register, run_demo

__all__ = ["register", "run_demo"]
