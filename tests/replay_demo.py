"""A real run to look at: two RL-style jobs share one group through real processes, then ``timeslice replay``
draws it. Makes ``docs/replay.png`` (``scripts/replay_screenshot``).

Processes: a private nats-server, ``timeslice orchestrator``, the node's snapshot agent, and two jobs
(``python -m tests.replay_demo job …``), each with a torch model + Adam optimizer behind
``TorchOffloadHandler`` (CPU tensors stand in for the device). Each job loops: under the lock a
``generate`` phase (matrix products) and a ``train`` phase (a real forward/backward/step); outside it a
``reward`` phase. The jobs want the group at the same time, so every round is a handoff: the agent
snapshots the holder's state to host buffers and restores the other's.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .helpers import run_text, stop_process

ROOT = Path(__file__).resolve().parents[1]
GROUP = "gpus-0"
NODE = "node-1"


def _busy(ms: float) -> None:
    import torch

    a = torch.randn(192, 192)
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


async def _job(a: argparse.Namespace) -> int:
    import torch
    from timeslice_client import AsyncTimeSliceClient
    from timeslice_client.torch_offload import TorchOffloadHandler

    torch.manual_seed(a.seed)
    torch.set_num_threads(1)  # two jobs share two cores with the services: no oversubscription
    width = 1024
    layers = max(1, int(a.mb * 1024 * 1024 / 3 / (width * width * 4)))  # weights + Adam's two moments
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def train_step() -> None:
        loss = model(torch.randn(64, width)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    train_step()  # the optimizer's state exists from here on
    async with AsyncTimeSliceClient(a.job, GROUP, a.nats_url, lease_s=30) as client:
        await client.register_workload(TorchOffloadHandler(model, opt, device="cpu"), node_id=NODE)
        if a.start_with_reward:
            async with client.phase("reward"):
                await asyncio.to_thread(_busy, a.reward_ms / 2)
        for _ in range(a.rounds):
            async with client.on_accelerators(timeout=120):
                async with client.phase("generate"):
                    await asyncio.to_thread(_busy, a.generate_ms)
                async with client.phase("train"):
                    for _ in range(a.train_steps):
                        await asyncio.to_thread(train_step)
            async with client.phase("reward"):
                await asyncio.to_thread(_busy, a.reward_ms)
    return 0


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT
        )


def _stop(p: subprocess.Popen[bytes]) -> None:
    stop_process(p)


def _demo(a: argparse.Namespace) -> int:
    from timeslice_orchestrator.embedded import NatsServer

    from .agent_harness import AgentProcess
    from .chromium import chromium, screenshot
    from .conftest import OrchestratorProcess

    browser = chromium()
    if browser is None:
        print("replay_demo: chromium is not installed (apt-get install -y chromium)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="timeslice-replay-demo-"))
    server = NatsServer(work / "nats")
    url = server.start()
    orch = OrchestratorProcess(url, work / "orchestrator.log")
    agent = AgentProcess(url, NODE, work / "agent.log")
    jobs: list[subprocess.Popen[bytes]] = []
    try:
        orch.start()
        orch.wait_ready()
        agent.start()
        asyncio.run(agent.wait_ready())
        common = ["--nats-url", url, "--rounds", str(a.rounds), "--mb", str(a.mb)]
        jobs.append(
            _start(
                ["-m", "tests.replay_demo", "job", "--job", "rl-policy-a", "--seed", "1", *common], work / "job-a.log"
            )
        )
        jobs.append(
            _start(
                [
                    "-m",
                    "tests.replay_demo",
                    "job",
                    "--job",
                    "rl-policy-b",
                    "--seed",
                    "2",
                    "--start-with-reward",
                    *common,
                ],
                work / "job-b.log",
            )
        )
        for p, name in zip(jobs, ("a", "b"), strict=True):
            rc = p.wait(a.timeout)
            if rc != 0:
                print((work / f"job-{name}.log").read_text(errors="replace")[-3000:], file=sys.stderr)
                raise RuntimeError(f"job {name} exited with {rc}; logs in {work}")
        html = Path(a.html) if a.html else work / "replay.html"
        replay = run_text(
            [
                sys.executable,
                "-m",
                "timeslice_cli",
                "--log-level",
                "warning",
                "replay",
                "--nats-url",
                url,
                "--group",
                GROUP,
                "--html",
                str(html),
            ],
            timeout=120,
            check=True,
        )
        print(replay.stdout, end="")
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        screenshot(browser, html, out, work / "chromium", window=(a.width, a.height))
        print(f"screenshot written to {out}")
    finally:
        for p in jobs:
            _stop(p)
        agent.stop()
        orch.stop()
        server.stop()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="replay_demo", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="the whole run, then the replay and its screenshot (default)")
    job = sub.add_parser("job", help="one job process")
    for q in (p, demo):
        q.add_argument("--out", default=str(ROOT / "docs" / "replay.png"), help="the screenshot (PNG)")
        q.add_argument("--html", default=None, help="also keep the replay page here")
        q.add_argument("--rounds", type=int, default=4)
        q.add_argument("--mb", type=float, default=48.0, help="each job's state (weights + optimizer) in MB")
        q.add_argument("--width", type=int, default=1500)
        q.add_argument("--height", type=int, default=700)
        q.add_argument("--timeout", type=float, default=300.0, help="seconds the jobs may take")
        q.add_argument("--keep", action="store_true", help="keep the work directory (logs, data)")
    job.add_argument("--nats-url", required=True)
    job.add_argument("--job", required=True)
    job.add_argument("--seed", type=int, default=0)
    job.add_argument("--rounds", type=int, default=4)
    job.add_argument("--mb", type=float, default=48.0)
    job.add_argument("--generate-ms", type=float, default=300.0)
    job.add_argument("--train-steps", type=int, default=3)
    job.add_argument("--reward-ms", type=float, default=350.0)
    job.add_argument("--start-with-reward", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.command == "job":
        return asyncio.run(_job(a))
    return _demo(a)


if __name__ == "__main__":
    sys.exit(main())
