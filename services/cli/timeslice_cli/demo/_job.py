"""One demo RL job, as its own process: ``python -m timeslice_cli.demo._job --job J ...``.

A GRPO loop on :class:`~._task.SortTask` with the phases of real RL, each accelerator phase inside
``client.on_accelerators()`` and the policy's weights and optimizer state registered with the node's
snapshot agent (backend ``app_channel``), so every switch really moves them off and back:

1. generation (accelerators): the rollout copy samples ``group`` answers per prompt;
2. reward (CPU, accelerators released): the verifier scores the answers, then the job waits for a
   *modelled* remote reward service (``--reward-latency-ms`` of sleep, standing for an LLM judge or
   a sandbox round trip);
3. train (accelerators): one policy-gradient step with group-relative advantages;
4. weight sync (accelerators, same hold): the trainer's weights into the rollout copy.

After the last step a final hold copies the weights and optimizer state out (``checkpoint``).

torch is imported only when the job runs with it (``--backend torch``); ``--backend numpy`` runs the
same loop on a numpy policy and never imports torch. The job reports to the runner on stdout (see
``_messages``); once built it waits for ``register`` on stdin, registers with the agent, then waits
for ``go`` before its first step. It writes its final weights and optimizer state to ``--out`` (.npz)
with their sha256, and leaves (unregisters) on ``exit``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
from timeslice_client import HandlerResult, SuspendMode, TimeSliceClient, WorkloadHandler

from . import _messages as m
from ._task import Batch, SortTask

__all__ = ["main"]

Array = np.ndarray[Any, Any]
GO_TIMEOUT_S = 900.0  # the runner starts every job early, then runs them in turn; a dead runner ends the wait


class Policy(Protocol):
    backend: str

    def handler(self) -> WorkloadHandler: ...

    def probs(self, x: Array) -> Array: ...

    def train(self, x: Array, actions: Array, weights: Array) -> float: ...

    def sync(self) -> None: ...

    def state(self) -> dict[str, Array]: ...


class _Out:
    """Job messages to stdout, one line each, from the loop and from the handler's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, msg: m.JobMessage) -> None:
        line = m.encode(msg) + b"\n"
        with self._lock:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()


class _Reporting:
    """The policy's offload handler, each call timed and reported to the runner."""

    def __init__(self, inner: WorkloadHandler, job: str, out: _Out) -> None:
        self.inner = inner
        self.job = job
        self.out = out
        self.suspends = 0
        self.resumes = 0

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        r = self._timed("suspend", self.inner.suspend, mode, tags)
        self.suspends += 1
        return r

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        r = self._timed("resume", self.inner.resume, mode, tags)
        self.resumes += 1
        return r

    def _timed(
        self,
        action: str,
        call: Callable[[SuspendMode, frozenset[str]], HandlerResult],
        mode: SuspendMode,
        tags: frozenset[str],
    ) -> HandlerResult:
        """``call`` (the policy's own suspend or resume), timed, and reported to the runner as ``action``."""
        t0 = time.perf_counter()
        r = call(mode, tags)
        self.out(m.Offload(self.job, action, r.bytes_moved, (time.perf_counter() - t0) * 1000))
        return r


def torch_available() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["torch"] is None (torch blocked)
        return False


def make_policy(backend: str, task: SortTask, hidden: int, seed: int) -> Policy:
    if backend == "torch":
        from ._policy_torch import TorchPolicy

        return TorchPolicy(task.features, hidden, task.vocab, seed=seed, lr=1e-3)
    from ._policy_numpy import NumpyPolicy

    return NumpyPolicy(task.features, hidden, task.vocab, seed=seed, lr=1e-3)


def digest(state: dict[str, Array]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        a = np.ascontiguousarray(state[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def wait_for(word: str, timeout: float, *, sender: str = "the demo runner") -> None:
    """The next word on stdin, from ``sender`` (the process that started this job and paces it), must be ``word``:
    a job that waited in vain, or read something else, fails loudly instead of going on out of step. Also the
    pacing of the TRL test's worker (``tests/workers/trl_grpo_job.py``), which the test starts as the runner does."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no {word!r} from {sender} within {timeout:.0f} s")
    line = sys.stdin.readline().strip()
    if line != word:
        raise RuntimeError(f"expected {word!r} from {sender}, got {line!r} (has it stopped?)")


def _time_a_switch(handler: WorkloadHandler, rounds: int = 2) -> tuple[float, float]:
    """One suspend and resume of ``handler`` (the state's round trip off the accelerator and back: lossless), timed
    in ms; the last of ``rounds`` (the first allocates the host buffers that later switches reuse)."""
    suspend_ms = resume_ms = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        handler.suspend(SuspendMode.OFFLOAD, frozenset())
        t1 = time.perf_counter()
        handler.resume(SuspendMode.OFFLOAD, frozenset())
        suspend_ms, resume_ms = (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000
    return suspend_ms, resume_ms


def run(a: argparse.Namespace, out: _Out) -> int:
    task = SortTask(length=a.length, prompts=a.prompts, group=a.group_size, seed=a.seed)
    policy = make_policy(a.backend, task, a.hidden, a.seed)
    inner = policy.handler()
    suspend_ms, resume_ms = _time_a_switch(inner)
    handler = _Reporting(inner, a.job, out)
    latency_s = a.reward_latency_ms / 1000
    out(m.Built(a.job, policy.backend, torch_available(), os.getpid(), suspend_ms, resume_ms))
    wait_for("register", GO_TIMEOUT_S)
    with TimeSliceClient(a.job, a.group, a.nats_url, lease_s=a.lease_s) as client:
        # A switch moves ~10 MB here: an operation still unanswered after 30 s means this process is gone.
        client.register_workload(handler, node_id=a.node_id, op_timeout_s=30.0)
        out(m.Ready(a.job))
        wait_for("go", GO_TIMEOUT_S)
        start = time.perf_counter()
        reward = 0.0
        for step in range(1, a.steps + 1):
            t0 = time.perf_counter()
            waited = 0.0
            prompts, u = task.sample_prompts(), task.uniforms()
            out(m.PhaseChange(a.job, step, "waiting", holding=False))
            with client.on_accelerators() as grant, client.phase("generation"):
                waited += grant.waited_ms
                out(m.PhaseChange(a.job, step, "generation", holding=True))
                tokens = np.zeros_like(prompts)
                for t in range(task.length):
                    tokens[:, t] = task.sample(policy.probs(task.inputs(prompts, tokens, t)), u[:, t])
            batch = Batch(prompts, tokens)
            out(m.PhaseChange(a.job, step, "reward", holding=False))
            with client.phase("reward"):
                rewards = task.verify(batch)
                time.sleep(latency_s)  # the modelled remote reward service (see the module doc)
            advantages = task.advantages(rewards)
            x, actions = task.all_inputs(batch)
            out(m.PhaseChange(a.job, step, "waiting", holding=False))
            with client.on_accelerators() as grant:
                waited += grant.waited_ms
                out(m.PhaseChange(a.job, step, "train", holding=True))
                with client.phase("train"):
                    loss = policy.train(x, actions, np.repeat(advantages, task.length))
                out(m.PhaseChange(a.job, step, "weight_sync", holding=True))
                with client.phase("weight_sync"):
                    policy.sync()
            reward = float(rewards.mean())
            out(m.StepDone(a.job, step, reward, loss, waited, (time.perf_counter() - t0) * 1000))
        # Reading the weights is accelerator work too: once released, the state may be off the device.
        with client.on_accelerators(), client.phase("checkpoint"):
            out(m.PhaseChange(a.job, a.steps, "checkpoint", holding=True))
            state = policy.state()
        loop_s = time.perf_counter() - start
        np.savez(a.out, **state)  # type: ignore[arg-type]
        out(m.Done(a.job, a.steps, loop_s, a.out, digest(state), handler.suspends, handler.resumes, reward))
        # Stay registered until the runner says every job of the run is done: a job leaving while its
        # state is on the accelerator and another job takes over would fail that switch's snapshot.
        wait_for("exit", GO_TIMEOUT_S)
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m timeslice_cli.demo._job", description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--nats-url", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--out", required=True, help="where to write the final weights (.npz)")
    p.add_argument("--backend", choices=("torch", "numpy"), required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--length", type=int, default=8, help="digits per prompt")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="answers sampled per prompt (GRPO group)")
    p.add_argument(
        "--reward-latency-ms", type=float, default=500.0, help="modelled latency of the remote reward service, per step"
    )
    p.add_argument("--lease-s", type=float, default=30.0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    out = _Out()
    try:
        return run(a, out)
    except Exception as exc:
        out(m.Failed(a.job, f"{exc.__class__.__name__}: {exc}"[:2000]))
        raise


if __name__ == "__main__":
    sys.exit(main())
