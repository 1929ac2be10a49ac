"""One real TRL GRPO job as a process, with the timeslice TRL integration attached.

Run as::

    python -m tests.workers.trl_grpo_job --job J --group G --nats-url URL --node-id N --out RESULT.json \
        [--seed 0] [--steps 6] [--reward-ms 300] [--async-reward] [--hidden 32] [--layers 2]

Nothing is downloaded: the model is a tiny randomly initialised ``LlamaForCausalLM`` built from a config, the
tokenizer a word-level one built here with ``tokenizers``, the dataset an in-memory ``datasets.Dataset`` and the
reward a Python function (``--async-reward``: an async one) that scores the completion and then sleeps
``--reward-ms``, standing for a reward model or a remote judge (workload, not a wait).

Protocol with the test, one line each: the job prints ``TSJOB built`` once everything is built and the client is
connected, waits for ``go`` on stdin, trains (``attach(trainer, client)``, ``trainer.train()``), reads its final
weights and optimizer state inside a hold, writes ``--out`` (JSON: wall clock at the start and end of ``train()``,
the sha256 of the state, the integration's counts) and prints ``TSJOB done``; it then waits for ``exit`` on stdin
before it closes its client (unregistering while another job's switch may still want its state would fail that
switch). Other lines on stdout are TRL's logs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from timeslice_cli.demo._job import wait_for as demo_wait_for
from timeslice_client import TimeSliceClient
from timeslice_client.integrations.trl import attach
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from .job_flags import job_parser

WORDS = ["<pad>", "<eos>", "<unk>", *(f"w{i}" for i in range(29))]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
WAIT_S = 300.0  # for the test's next word: it starts every job early and runs them in turn


def tokenizer() -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model(seed: int, hidden: int, layers: int) -> LlamaForCausalLM:
    """The example's model (examples/trl_grpo.py), over this job's smaller vocabulary."""
    spec = importlib.util.spec_from_file_location("trl_grpo_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    built: LlamaForCausalLM = example.tiny_llama(seed, len(WORDS), hidden, layers)
    return built


def dataset() -> Dataset:
    return Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % 29}" for j in range(4)) for i in range(64)]})


def score(completion: str) -> float:
    """More w3s, fewer words."""
    words = completion.split()
    return float(words.count("w3")) - 0.1 * len(words)


def reward_function(reward_s: float, use_async: bool) -> Any:
    def reward(completions: list[str], **_: Any) -> list[float]:
        time.sleep(reward_s)  # the reward model's time (see the module doc)
        return [score(c) for c in completions]

    async def reward_async(completions: list[str], **_: Any) -> list[float]:
        await asyncio.sleep(reward_s)
        return [score(c) for c in completions]

    return reward_async if use_async else reward


def digest(trainer: GRPOTrainer) -> tuple[str, int]:
    """sha256 over the model's state dict and the optimizer's state (names, dtypes, shapes, bytes); the tensors."""
    h = hashlib.sha256()
    n = 0
    named = sorted(trainer.model.state_dict().items())
    opt = trainer.optimizer.state_dict()["state"]
    named += [
        (f"optimizer/{i}.{k}", v) for i in sorted(opt) for k, v in sorted(opt[i].items()) if isinstance(v, torch.Tensor)
    ]
    for name, t in named:
        a = t.detach().cpu().contiguous().clone()  # never .numpy() on the live tensor: it pins the storage
        h.update(f"{name}|{a.dtype}|{tuple(a.shape)}|".encode())
        h.update(a.reshape(-1).view(torch.uint8).numpy().tobytes())
        n += 1
    return h.hexdigest(), n


def wait_for(word: str) -> None:
    demo_wait_for(word, WAIT_S, sender="the test")  # the demo job's handshake: this worker is paced as it is


def say(word: str) -> None:
    sys.stdout.write(f"TSJOB {word}\n")
    sys.stdout.flush()


def run(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    args = GRPOConfig(
        output_dir=str(Path(a.out).parent / f"trl-{a.job}-{a.group}"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=a.steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=a.seed,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model(a.seed, a.hidden, a.layers),
        reward_funcs=reward_function(a.reward_ms / 1000, a.async_reward),
        args=args,
        train_dataset=dataset(),
        processing_class=tokenizer(),
    )
    with TimeSliceClient(a.job, a.group, a.nats_url, lease_s=30, acquire_timeout_s=120) as client:
        say("built")
        wait_for("go")
        callback = attach(trainer, client, node_id=a.node_id)
        start = time.time()
        trainer.train()
        end = time.time()
        with client.on_accelerators():  # the state may be off the device since train() released
            sha, tensors = digest(trainer)
            # In the hold, so every suspend so far has been resumed (after it, the other job may move us out again).
            counts = dataclasses.asdict(callback.counts)
        result = {
            "job": a.job,
            "group": a.group,
            "start": start,
            "end": end,
            "train_s": end - start,
            "sha256": sha,
            "tensors": tensors,
            "steps": trainer.state.global_step,
            "counts": counts,
        }
        Path(a.out).write_text(json.dumps(result))
        say("done")
        wait_for("exit")


def main(argv: Sequence[str] | None = None) -> int:
    p = job_parser(None, __doc__, node=True, out_help="where to write the result (JSON)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--reward-ms", type=float, default=300.0)
    p.add_argument("--async-reward", action="store_true")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
