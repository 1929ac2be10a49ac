"""The toy RL task of the demo: sort a sequence of digits, scored by a verifier.

A prompt is ``length`` random digits; the policy writes ``length`` digits, one at a time
(autoregressively); the verifier compares the answer with the sorted prompt by edit distance
(Levenshtein, computed in plain Python: CPU work, like a real verifier) and gives a bonus for an
exact answer. Everything here is numpy and pure Python: the "accelerator" work lives in the policy.

The policy sees, at position ``t``: the prompt (one-hot per position), the digits it wrote so far
(one-hot, zeros for positions not written yet) and ``t`` (one-hot), concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Batch", "SortTask", "edit_distance"]

Array = np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's rollouts: ``prompts`` (n, L) and the answers ``tokens`` (n, L), int64."""

    prompts: Array
    tokens: Array


def edit_distance(a: list[int], b: list[int]) -> int:
    """Levenshtein distance (insertions, deletions, substitutions each cost 1)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


class SortTask:
    """Prompts, policy inputs, the verifier and GRPO's group-relative advantages."""

    vocab = 10

    def __init__(self, *, length: int = 8, prompts: int = 16, group: int = 8, seed: int = 0) -> None:
        if length < 1 or prompts < 1 or group < 2:
            raise ValueError(f"need length >= 1, prompts >= 1 and group >= 2, not {length}, {prompts}, {group}")
        self.length = length
        self.prompts = prompts
        self.group = group
        self.rng = np.random.default_rng(seed)

    @property
    def n(self) -> int:
        """Rollouts per step: ``prompts`` x ``group``."""
        return self.prompts * self.group

    @property
    def features(self) -> int:
        return 2 * self.length * self.vocab + self.length

    def sample_prompts(self) -> Array:
        """This step's prompts, each repeated ``group`` times (the GRPO group), shape (n, L)."""
        p = self.rng.integers(0, self.vocab, size=(self.prompts, self.length))
        return np.repeat(p, self.group, axis=0)

    def uniforms(self) -> Array:
        """The random numbers the sampler uses this step, shape (n, L): drawn here, so sampling is
        a function of the probabilities alone (the same on every backend and run)."""
        return self.rng.random((self.n, self.length))

    def inputs(self, prompts: Array, tokens: Array, t: int) -> Array:
        """The policy's input at position ``t`` for every rollout, float32 (n, features)."""
        n, L, V = prompts.shape[0], self.length, self.vocab
        x = np.zeros((n, self.features), dtype=np.float32)
        rows = np.arange(n)
        for i in range(L):
            x[rows, i * V + prompts[:, i]] = 1.0
        for i in range(t):
            x[rows, L * V + i * V + tokens[:, i]] = 1.0
        x[:, 2 * L * V + t] = 1.0
        return x

    def all_inputs(self, batch: Batch) -> tuple[Array, Array]:
        """Inputs and actions of every position of every rollout (teacher forcing): (n·L, features), (n·L,)."""
        xs = [self.inputs(batch.prompts, batch.tokens, t) for t in range(self.length)]
        x = np.stack(xs, axis=1).reshape(-1, self.features)
        return x, batch.tokens.reshape(-1)

    @staticmethod
    def sample(probs: Array, u: Array) -> Array:
        """Inverse-CDF sampling of one token per row of ``probs`` (float32 (n, V)) with uniforms ``u`` (n,)
        in [0, 1): the first token whose cumulative probability exceeds ``u`` (never one of probability 0)."""
        cdf = np.cumsum(probs.astype(np.float64), axis=1)
        tok = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
        out: Array = np.minimum(tok, probs.shape[1] - 1).astype(np.int64)
        return out

    def verify(self, batch: Batch) -> Array:
        """Reward of each rollout: 1 - edit distance to the sorted prompt / L, plus 1 when exact."""
        out = np.empty(batch.tokens.shape[0], dtype=np.float64)
        for i, (p, a) in enumerate(zip(batch.prompts.tolist(), batch.tokens.tolist(), strict=True)):
            want = sorted(p)
            d = edit_distance(a, want)
            out[i] = 1.0 - d / self.length + (1.0 if d == 0 else 0.0)
        return out

    def advantages(self, rewards: Array) -> Array:
        """GRPO: each reward relative to its group's mean, over the group's standard deviation."""
        r = rewards.reshape(self.prompts, self.group)
        a = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + 1e-6)
        out: Array = a.reshape(-1).astype(np.float32)
        return out
