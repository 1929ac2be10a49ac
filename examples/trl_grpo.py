"""A TRL GRPO job that shares its accelerators with other jobs through timeslice (docs/integrations.md, "TRL").

With the stack running (``./scripts/timeslice up``), start two of them; they share group ``gpus-0``::

    python examples/trl_grpo.py --job grpo-a --seed 1 &
    python examples/trl_grpo.py --job grpo-b --seed 2

Each trains a small randomly initialised Llama (built from a config: nothing is downloaded) with TRL's
``GRPOTrainer`` on an in-memory dataset; its reward function sleeps ``--reward-ms`` per batch, standing for a reward
model or a remote judge, which is when the other job gets the accelerators. ``--plain`` runs the same job without
timeslice (the baseline). Needs ``pip install 'timeslice-client[trl]'``.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from typing import Any

import torch
from datasets import Dataset
from timeslice_client import TimeSliceClient
from timeslice_client.integrations.trl import attach
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

WORDS = ["<pad>", "<eos>", "<unk>", *(f"w{i}" for i in range(61))]


def tiny_llama(seed: int, vocab_size: int, hidden: int, layers: int) -> LlamaForCausalLM:
    """A small Llama, randomly initialised from ``seed`` (nothing is downloaded); token 0 pads, 1 ends."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        )
    )


def build(a: argparse.Namespace, output_dir: str) -> GRPOTrainer:
    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    model = tiny_llama(a.seed, len(WORDS), a.hidden, a.layers)
    dataset = Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % 61}" for j in range(4)) for i in range(256)]})

    def reward(completions: list[str], **_: Any) -> list[float]:
        time.sleep(a.reward_ms / 1000)  # the reward model's time: the other job's turn on the accelerators
        return [c.split().count("w3") - 0.1 * len(c.split()) for c in completions]

    args = GRPOConfig(
        output_dir=output_dir,  # nothing is saved (save_strategy="no")
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=a.steps,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        seed=a.seed,
        use_cpu=not torch.cuda.is_available(),  # TRL trains in bf16 on a GPU; on the CPU it must be told
        disable_tqdm=True,
        logging_steps=a.steps,
    )
    return GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset, processing_class=tokenizer)


def weights_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone().numpy().tobytes())
    return h.hexdigest()


def run(a: argparse.Namespace, trainer: GRPOTrainer) -> None:
    if a.plain:
        t0 = time.perf_counter()
        trainer.train()
        print(
            f"{a.job}: {a.steps} steps in {time.perf_counter() - t0:.2f} s, plain; "
            f"weights sha256 {weights_sha256(trainer.model)}"
        )
        return
    with TimeSliceClient(job_id=a.job, group_id=a.group) as client:
        callback = attach(trainer, client)  # the one line: holds, offload handler, reward phase released
        t0 = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - t0
        with client.on_accelerators():  # after train() the state may be off the device: read it in a hold
            sha = weights_sha256(trainer.model)
        c = callback.counts
        print(
            f"{a.job}: {a.steps} steps in {elapsed:.2f} s, waited {c.waited_ms / 1000:.2f} s for the group; "
            f"moved out {c.offload.suspends}x ({c.offload.suspend_ms:.0f} ms), in {c.offload.resumes}x "
            f"({c.offload.resume_ms:.0f} ms), {c.offload.last_suspend_bytes / 1e6:.1f} MB each; "
            f"weights sha256 {sha}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", default="grpo-a")
    p.add_argument("--group", default="gpus-0")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--reward-ms", type=float, default=300.0)
    p.add_argument("--plain", action="store_true", help="without timeslice (the baseline)")
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as output_dir:
        run(a, build(a, output_dir))


if __name__ == "__main__":
    main()
