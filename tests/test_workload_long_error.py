"""A handler's error of any length reaches the agent as the job's failure, cut to the wire's bound: an answer past
``WorkloadReply.error``'s 2,048 characters used to be refused by the agent as garbage, so the operation failed with
"answered suspend with garbage" instead of the handler's reason."""

from __future__ import annotations

from timeslice_agent import Agent, AgentConfig
from timeslice_client import AsyncTimeSliceClient, HandlerResult, SuspendMode
from timeslice_client.protocol import OpKind

from .helpers import eventually, running


class Wordy:
    """A handler whose suspend fails with a 10,000-character reason."""

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        raise RuntimeError("the device is busy: " + "x" * 10_000)

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return HandlerResult()


async def test_a_handlers_long_error_is_its_failure_cut_to_the_bound(nats_url: str) -> None:
    async with (
        running(Agent(AgentConfig(node_id="node-1", nats_url=nats_url))) as agent,
        AsyncTimeSliceClient("x", "g-long", nats_url) as x,
    ):
        await x.register_workload(Wordy(), node_id="node-1")
        op_id = await agent.run_standalone("x", OpKind.SNAPSHOT)
        status = await eventually(
            lambda: (s := agent.operation(op_id)) is not None and s.done and s, what="the snapshot's end"
        )
        assert status.result is not None and not status.result.ok
        error = status.result.error or ""
        assert "the device is busy: xxx" in error and "garbage" not in error, error[:300]
