"""The demo's policy as a torch MLP (trainer and rollout copy) with Adam, on CPU, one thread.

Imported only when the job runs with torch: nothing else in the demo needs torch.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from timeslice_client.handlers import WorkloadHandler
from timeslice_client.torch_offload import TorchOffloadHandler

__all__ = ["TorchPolicy"]

Array = np.ndarray[Any, Any]


class TorchPolicy:
    """``features → hidden → hidden → vocab`` with tanh; the trainer learns, the rollout copy generates
    (as an inference engine would) and receives the trainer's weights at each weight sync."""

    backend = "torch"

    def __init__(self, features: int, hidden: int, vocab: int, *, seed: int, lr: float) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.trainer = torch.nn.Sequential(
            torch.nn.Linear(features, hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(hidden, vocab),
        )
        self.rollout = copy.deepcopy(self.trainer).requires_grad_(False)
        self.opt = torch.optim.Adam(self.trainer.parameters(), lr=lr)

    def handler(self) -> WorkloadHandler:
        """The trainer's and rollout copy's weights (tag ``weights``) and Adam's state (``optimizer``)."""
        return TorchOffloadHandler(
            modules={"weights": [self.trainer, self.rollout]}, optimizers={"optimizer": self.opt}, device="cpu"
        )  # the model lives on the CPU

    def probs(self, x: Array) -> Array:
        with torch.no_grad():
            p = torch.softmax(self.rollout(torch.from_numpy(x)), dim=-1)
        return np.asarray(p.numpy())  # typed as an ndarray whether or not torch's stubs are installed

    def train(self, x: Array, actions: Array, weights: Array) -> float:
        """One policy-gradient step: minimise -mean(weight · log π(action | x))."""
        logp = torch.log_softmax(self.trainer(torch.from_numpy(x)), dim=-1)
        taken = logp.gather(1, torch.from_numpy(actions).unsqueeze(1)).squeeze(1)
        loss = -(torch.from_numpy(weights) * taken).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call, unused-ignore]  # untyped in torch; Any without it
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def sync(self) -> None:
        """Weight sync: the trainer's weights into the rollout copy."""
        with torch.no_grad():
            for dst, src in zip(self.rollout.parameters(), self.trainer.parameters(), strict=True):
                dst.copy_(src)

    def state(self) -> dict[str, Array]:
        """Copies of the trainer's weights and Adam's state, by name (never ``.numpy()`` on the tensors
        themselves: that would pin their storage and the next suspend would be refused)."""
        out = {f"weights/{k}": v.detach().clone().numpy() for k, v in self.trainer.state_dict().items()}
        for i, st in enumerate(self.opt.state_dict()["state"].values()):
            for k, v in sorted(st.items()):
                if isinstance(v, torch.Tensor):
                    out[f"optimizer/{i}.{k}"] = v.detach().clone().reshape(-1).numpy()
        return out
