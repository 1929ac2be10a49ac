"""A registered CPU tensor that the training loop read with ``.numpy()`` (issue 25, item 5): the switch that
cannot free it faults the job with words that name the call and the fix, end to end (orchestrator, agent, two
jobs with ``TorchOffloadHandler`` on CPU tensors)."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from timeslice_agent import Agent, AgentConfig  # noqa: E402
from timeslice_client import AsyncTimeSliceClient, JobFaulted  # noqa: E402
from timeslice_client.torch_offload import TorchOffloadHandler  # noqa: E402
from timeslice_orchestrator.service import Orchestrator, OrchestratorConfig  # noqa: E402

from .helpers import eventually, group_record, running  # noqa: E402


async def test_numpy_on_a_registered_tensor_faults_the_switch_naming_the_call(nats_url: str) -> None:
    weights = torch.randn(256)
    async with (
        running(Orchestrator(OrchestratorConfig(nats_url=nats_url))),
        running(Agent(AgentConfig(node_id="node-1", nats_url=nats_url))),
        AsyncTimeSliceClient("a", "gnp", nats_url) as a,
        AsyncTimeSliceClient("b", "gnp", nats_url) as b,
    ):
        await a.register_workload(TorchOffloadHandler(tensors={"weights": weights}, device="cpu"), node_id="node-1")
        await b.register_workload(
            TorchOffloadHandler(tensors={"weights": torch.randn(256)}, device="cpu"), node_id="node-1"
        )
        async with a.on_accelerators(timeout=10):
            float(weights.numpy().sum())  # the mistake: a log line that reads the registered tensor itself
            tb = asyncio.create_task(b.acquire(timeout=20))

            async def b_waits() -> bool:
                return [w.job for w in (await group_record(a)).queue] == ["b"]

            await eventually(b_waits, what="b waits for the group")
        await asyncio.wait_for(tb, 20)  # b still gets the group: a's suspend was refused before anything moved

        async def faulted() -> str | None:
            return (await group_record(b)).faulted.get("a")

        reason = await eventually(faulted, what="a is faulted in the group")
        assert "`tensor.numpy()`" in reason and "`.clone()`" in reason and "'weights'" in reason, reason
        assert weights.untyped_storage().nbytes() == 256 * 4  # still on the "device": nothing was freed
        with pytest.raises(JobFaulted, match=r"tensor\.numpy\(\)"):
            await a.acquire(timeout=5)
        await b.release()
