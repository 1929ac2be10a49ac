"""The demo's policy in plain numpy (for machines without torch): the same MLP, backprop and Adam
written out, every array updated in place so the offload handler's references stay valid."""

from __future__ import annotations

from typing import Any

import numpy as np
from timeslice_client.handlers import WorkloadHandler
from timeslice_client.numpy_offload import NumpyOffloadHandler

__all__ = ["NumpyPolicy"]

Array = np.ndarray[Any, Any]


class NumpyPolicy:
    """``features → hidden → hidden → vocab`` with tanh, float32; trainer, rollout copy, Adam."""

    backend = "numpy"

    def __init__(self, features: int, hidden: int, vocab: int, *, seed: int, lr: float) -> None:
        rng = np.random.default_rng(seed)
        shapes = [(features, hidden), (hidden,), (hidden, hidden), (hidden,), (hidden, vocab), (vocab,)]
        self.params: list[Array] = []
        for shape in shapes:
            bound = 1.0 / np.sqrt(shape[0] if len(shape) == 2 else hidden)
            self.params.append(rng.uniform(-bound, bound, size=shape).astype(np.float32))
        self.rollout = [p.copy() for p in self.params]
        self.m = [np.zeros_like(p) for p in self.params]
        self.v = [np.zeros_like(p) for p in self.params]
        self.lr, self.beta1, self.beta2, self.eps = np.float32(lr), 0.9, 0.999, 1e-8
        self.t = 0

    def handler(self) -> WorkloadHandler:
        """The trainer's and rollout copy's weights (tag ``weights``) and Adam's moments (``optimizer``)."""
        return NumpyOffloadHandler(weights=[*self.params, *self.rollout], optimizer=[*self.m, *self.v])

    @staticmethod
    def _forward(w: list[Array], x: Array) -> tuple[Array, Array, Array]:
        h1 = np.tanh(x @ w[0] + w[1])
        h2 = np.tanh(h1 @ w[2] + w[3])
        return h1, h2, h2 @ w[4] + w[5]

    @staticmethod
    def _softmax(z: Array) -> Array:
        e = np.exp(z - z.max(axis=1, keepdims=True))
        out: Array = e / e.sum(axis=1, keepdims=True)
        return out

    def probs(self, x: Array) -> Array:
        return self._softmax(self._forward(self.rollout, x)[2])

    def train(self, x: Array, actions: Array, weights: Array) -> float:
        """One policy-gradient step: minimise -mean(weight · log π(action | x)), then Adam."""
        w = self.params
        h1, h2, z = self._forward(w, x)
        p = self._softmax(z)
        rows = np.arange(x.shape[0])
        loss = float(-(weights * np.log(p[rows, actions] + 1e-30)).mean())
        dz = p
        dz[rows, actions] -= 1.0
        dz *= (weights / x.shape[0])[:, None]
        d2 = (dz @ w[4].T) * (1.0 - h2 * h2)
        d1 = (d2 @ w[2].T) * (1.0 - h1 * h1)
        grads = [x.T @ d1, d1.sum(axis=0), h1.T @ d2, d2.sum(axis=0), h2.T @ dz, dz.sum(axis=0)]
        self.t += 1
        c1 = 1.0 - self.beta1**self.t
        c2 = 1.0 - self.beta2**self.t
        for i, g in enumerate(grads):  # in place: the handler holds these very arrays
            self.m[i] *= np.float32(self.beta1)
            self.m[i] += np.float32(1 - self.beta1) * g
            self.v[i] *= np.float32(self.beta2)
            self.v[i] += np.float32(1 - self.beta2) * g * g
            denom = np.sqrt(self.v[i] / np.float32(c2)) + np.float32(self.eps)
            w[i] -= (self.lr / np.float32(c1)) * self.m[i] / denom
        return loss

    def sync(self) -> None:
        """Weight sync: the trainer's weights into the rollout copy (in place)."""
        for dst, src in zip(self.rollout, self.params, strict=True):
            dst[...] = src

    def state(self) -> dict[str, Array]:
        out = {f"weights/{i}": p.copy() for i, p in enumerate(self.params)}
        out.update({f"optimizer/{i}.exp_avg": m.copy() for i, m in enumerate(self.m)})
        out.update({f"optimizer/{i}.exp_avg_sq": v.copy() for i, v in enumerate(self.v)})
        return out
