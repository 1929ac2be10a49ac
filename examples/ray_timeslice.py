"""Two RL jobs whose rollout and trainer are Ray actors share one group of accelerators through timeslice
(docs/integrations.md, "Ray").

Each job is a driver and two Ray actors, a rollout and a trainer: three processes, one job id, one hold. The driver
takes the group for the job's accelerator phases (generation, the update and the weight sync) with one
``TimeSliceClient`` and gives it back while it scores the rollouts; each actor registers its own state (a torch
policy and its KV cache, the model and its optimizer) with its node's agent, through a client of the job that never
acquires. The agent keeps both registrations as parts of the job, so every switch moves both actors' state at once:
the lines to add are the ``# timeslice`` ones.

With the stack running (``./scripts/timeslice up``; the agent of this host is ``$TIMESLICE_NODE_ID`` or the host
name)::

    python examples/ray_timeslice.py --jobs ray-a,ray-b --steps 6

runs both jobs at once in one local Ray instance (one driver thread each), then prints one JSON line: each job's
final weights digest, suspends and resumes per actor, the wall time, and when it held the accelerators and when it
scored (``perf_counter`` seconds, one clock for both jobs). ``--plain`` runs them one after the other
without timeslice: the same digests, bit for bit (a fixed seed per job; torch on one thread per actor).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
import torch

DIM = 64  # the policy's width
BATCH = 32
GPU_S = 0.06  # the "accelerator" part of each phase (generation, update): slept, as a GPU would keep the CPU free
REWARD_S = 0.25  # scoring the rollouts, on the CPU, without the accelerators (sandboxed code, a remote judge)


def _policy(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh(), torch.nn.Linear(DIM, DIM))


def _digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.state_dict().values():
        h.update(p.detach().clone().numpy().tobytes())
    return h.hexdigest()


class _Shared:
    """What an actor needs to register its state: the job, group, bus and node (None: ``--plain``)."""

    def __init__(self, job: str, group: str, nats_url: str | None, node_id: str | None) -> None:
        self.job, self.group, self.nats_url, self.node_id = job, group, nats_url, node_id


def _register(share: _Shared | None, handler: Any) -> Any:
    """The actor's state, registered with its node's agent as a part of its job (# timeslice). Returns the client."""
    if share is None:
        return None
    from timeslice_client import TimeSliceClient

    client = TimeSliceClient(share.job, share.group, nats_url=share.nats_url, bind_process=False)
    client.register_workload(handler, node_id=share.node_id)  # timeslice
    return client


class _Actor:
    """What both actors answer the driver: their handler's suspends and resumes, and closing their client."""

    handler: Any
    client: Any

    def counts(self) -> tuple[int, int]:
        c = self.handler.counts
        return c.suspends, c.resumes

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


@ray.remote
class Rollout(_Actor):
    """Generates a batch with its copy of the policy; keeps a KV cache on the "device"."""

    def __init__(self, seed: int, share: _Shared | None) -> None:
        from timeslice_client.integrations._counting import CountingHandler
        from timeslice_client.torch_offload import TorchOffloadHandler

        torch.set_num_threads(1)
        self.policy = _policy(seed)
        self.kv = torch.zeros(BATCH, DIM)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.handler = CountingHandler(TorchOffloadHandler(self.policy, tensors={"kv": self.kv}, device="cpu"))
        self.client = _register(share, self.handler)

    def generate(self) -> torch.Tensor:
        prompts = torch.randn(BATCH, DIM, generator=self.gen)
        with torch.no_grad():
            out = self.policy(prompts)
            self.kv.copy_(out)
        time.sleep(GPU_S)
        return torch.cat([prompts, out], dim=1)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.policy.state_dict().items():
                p.copy_(weights[name])


@ray.remote
class Trainer(_Actor):
    """Updates the policy from scored rollouts (Adam: optimizer state on the "device" too)."""

    def __init__(self, seed: int, share: _Shared | None) -> None:
        from timeslice_client.integrations._counting import CountingHandler
        from timeslice_client.torch_offload import TorchOffloadHandler

        torch.set_num_threads(1)
        self.model = _policy(seed)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.handler = CountingHandler(TorchOffloadHandler(self.model, self.opt, device="cpu"))
        self.client = _register(share, self.handler)

    def train(self, batch: torch.Tensor, rewards: torch.Tensor) -> float:
        prompts, out = batch[:, :DIM], batch[:, DIM:]
        loss = -(rewards[:, None] * (self.model(prompts) * out.sign()).tanh()).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        time.sleep(GPU_S)
        return float(loss)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def digest(self) -> str:
        return _digest(self.model)


def _score(batch: torch.Tensor, reward_s: float) -> torch.Tensor:
    """The reward, off the accelerators (``reward_s`` of CPU-side time): how close each output is to its prompt's sign
    pattern."""
    time.sleep(reward_s)
    prompts, out = batch[:, :DIM], batch[:, DIM:]
    return (prompts.sign() * out).mean(dim=1)


def run_job(job: str, seed: int, steps: int, share: _Shared | None, reward_s: float = REWARD_S) -> dict[str, Any]:
    """One job: its actors, then ``steps`` rounds of generate (held), score (not held), update + weight sync (held)."""
    rollout, trainer = Rollout.remote(seed, share), Trainer.remote(seed, share)  # type: ignore[attr-defined]
    client = None
    if share is not None:
        from timeslice_client import TimeSliceClient

        client = TimeSliceClient(job, share.group, nats_url=share.nats_url, bind_process=False)

    def held() -> contextlib.AbstractContextManager[Any]:
        return client.on_accelerators() if client is not None else contextlib.nullcontext()  # timeslice

    ray.get([trainer.weights.remote(), rollout.counts.remote()])  # both actors up before the clock runs
    holds: list[tuple[float, float]] = []  # when the job had the accelerators (perf_counter: one clock per process)
    scores: list[tuple[float, float]] = []  # when it scored, off them

    @contextlib.contextmanager
    def timed(into: list[tuple[float, float]]) -> Iterator[None]:
        start = time.perf_counter()
        yield
        into.append((start, time.perf_counter()))

    t0 = time.perf_counter()
    for _ in range(steps):
        with held(), timed(holds):
            batch = ray.get(rollout.generate.remote())
        with timed(scores):
            rewards = _score(batch, reward_s)
        with held(), timed(holds):
            ray.get(trainer.train.remote(batch, rewards))
            ray.get(rollout.load.remote(ray.get(trainer.weights.remote())))
    wall = time.perf_counter() - t0
    with held():  # the weights are read inside a hold: between holds they may be off the device
        digest = ray.get(trainer.digest.remote())
        # Counted inside the hold too: after its release, a switch may be moving one actor out and not yet the other.
        counts = {"rollout": ray.get(rollout.counts.remote()), "trainer": ray.get(trainer.counts.remote())}
    ray.get([rollout.close.remote(), trainer.close.remote()])
    if client is not None:
        client.close()
    return {"job": job, "digest": digest, "wall_s": wall, "suspends_resumes": counts, "holds": holds, "scores": scores}


@contextlib.contextmanager
def _ray(env: dict[str, str]) -> Iterator[None]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        yield
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--jobs", default="ray-a,ray-b", help="job ids, comma-separated (each runs with its own seed)")
    p.add_argument("--group", default="ray-gpus", help="the group the jobs share")
    p.add_argument("--steps", type=int, default=6, help="rounds of generate, score and update per job")
    p.add_argument("--nats-url", default=None, help="the bus (default: as every client finds it)")
    p.add_argument("--node-id", default=None, help="the node agent's id (default: $TIMESLICE_NODE_ID or host name)")
    p.add_argument(
        "--reward-s",
        type=float,
        default=REWARD_S,
        help="seconds each step scores its rollouts on the CPU, without the accelerators (the other job's turn)",
    )
    p.add_argument("--plain", action="store_true", help="without timeslice, one job after the other (the baseline)")
    args = p.parse_args()
    jobs = [j for j in args.jobs.split(",") if j]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {k: v for k, v in os.environ.items() if k.startswith("TIMESLICE_")}
    results: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    with _ray(env):
        if args.plain:
            for seed, job in enumerate(jobs, 1):
                results[job] = run_job(job, seed, args.steps, None, args.reward_s)
        else:
            errors: list[BaseException] = []

            def one(seed: int, job: str) -> None:
                try:
                    share = _Shared(job, args.group, args.nats_url, args.node_id)
                    results[job] = run_job(job, seed, args.steps, share, args.reward_s)
                except BaseException as exc:  # reported below, not lost in a thread
                    errors.append(exc)

            threads = [threading.Thread(target=one, args=(seed, job)) for seed, job in enumerate(jobs, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
    print(
        json.dumps(
            {
                "plain": args.plain,
                "wall_s": time.perf_counter() - t0,
                "jobs_wall_s": sum(r["wall_s"] for r in results.values())
                if args.plain
                else max(r["wall_s"] for r in results.values()),
                "jobs": results,
            }
        )
    )


if __name__ == "__main__":
    main()
