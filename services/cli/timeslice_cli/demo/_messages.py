"""What a demo job tells the demo runner: one JSON object per line on the job's stdout. (The runner
answers on the job's stdin with one word per line: ``register``, ``go``, then ``exit``.)

The runner reads them line by line (each line bounded by the reader's limit) to draw the live
progress and to collect the results; the job's logs go to stderr, never here.
"""

from __future__ import annotations

import msgspec

__all__ = ["Built", "Done", "Failed", "JobMessage", "Offload", "PhaseChange", "Ready", "StepDone", "decode", "encode"]


class Built(msgspec.Struct, frozen=True, tag="built"):
    """Model and optimizer built; waiting for ``register`` on stdin."""

    job: str
    backend: str  # "torch" or "numpy"
    torch_available: bool  # whether this interpreter can import torch at all
    pid: int
    # One suspend and resume of the job's handler, timed before anything runs (the second of two rounds): what a
    # switch of it costs, for ``timeslice advise``'s prediction of the shared run (demo/_predict.py).
    suspend_ms: float = 0.0
    resume_ms: float = 0.0


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """Registered with the node's agent; waiting for ``go`` on stdin."""

    job: str


class PhaseChange(msgspec.Struct, frozen=True, tag="phase"):
    """The job entered a phase: ``waiting`` (for the accelerators), ``generation``, ``reward``,
    ``train``, ``weight_sync``, and ``checkpoint`` after the last step."""

    job: str
    step: int
    name: str
    holding: bool


class Offload(msgspec.Struct, frozen=True, tag="offload"):
    """The agent had the job's state suspended (moved off the accelerator) or resumed (brought back)."""

    job: str
    action: str  # "suspend" or "resume"
    bytes_moved: int
    elapsed_ms: float


class StepDone(msgspec.Struct, frozen=True, tag="step"):
    job: str
    step: int
    reward: float  # mean reward of the step's rollouts
    loss: float
    waited_ms: float  # waiting for the accelerators during this step
    step_ms: float


class Done(msgspec.Struct, frozen=True, tag="done"):
    job: str
    steps: int
    loop_s: float  # from ``go`` to the end of the final checkpoint
    weights: str  # path of the .npz with the final weights and optimizer state
    sha256: str  # of the arrays' names, dtypes, shapes and bytes, in name order
    suspends: int
    resumes: int
    final_reward: float


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    job: str
    error: str


JobMessage = Built | Ready | PhaseChange | Offload | StepDone | Done | Failed

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(JobMessage)


def encode(msg: JobMessage) -> bytes:
    return _encoder.encode(msg)


def decode(line: bytes) -> JobMessage:
    """Raises ``msgspec.DecodeError``/``ValidationError`` on anything that is not a job message."""
    return _decoder.decode(line)
