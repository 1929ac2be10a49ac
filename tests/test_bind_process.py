"""A job that only acquires and releases (``with client.on_accelerators():``, no handler registered) gets its GPU
state moved on every switch: its client binds its process to the node's agent at the first acquire, the agent gives
it its default backend (the driver checkpoint, here over a fake driver that keeps the real one's state rules), and
the orchestrator switches it like any registered job. ``timeslice agent-status`` shows it bound to its pid."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeslice_agent import Agent, AgentConfig
from timeslice_agent._cuda import CudaBackend, ProcessState, cuda_unavailable_reason, make_cuda_backend
from timeslice_agent._nvml import GpuAccounting
from timeslice_agent.backends import register_backend
from timeslice_client import AsyncTimeSliceClient

from .agent_harness import timeslice
from .helpers import eventually, running
from .test_backend_cuda import GB, RuleDriver

ROOT = Path(__file__).resolve().parents[1]
NODE = "n-bind"
GROUP = "g-bind"

JOB = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from timeslice_client import TimeSliceClient

    def say(line):
        with out.open("a") as f:
            f.write(line + "\\n")

    job, group, url, rounds, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5])
    with TimeSliceClient(job, group, url, acquire_timeout_s=60) as client:
        for i in range(rounds):
            with client.on_accelerators():
                say(f"held {i}")
                time.sleep(0.3)  # stands for the training step's GPU work (not a wait): another job waits meanwhile
            time.sleep(0.05)  # stands for the step's CPU part (not a wait): the other job's turn
        say("done")
        sys.stdin.read()  # the test's go-ahead to close: it closes our stdin
""")


class AnyProcessDriver(RuleDriver):
    """The fake driver, for processes it learns as it is asked about them (the job processes start later)."""

    def state(self, pid: int) -> ProcessState:
        with self._mu:
            if pid not in self.states:
                self.states[pid], self.memory[pid] = ProcessState.RUNNING, GB
        return super().state(pid)


@pytest.fixture
def driver() -> Iterator[AnyProcessDriver]:
    drv = AnyProcessDriver({})
    be = CudaBackend(drv, GpuAccounting(None))
    register_backend("cuda", lambda nc, node: be)  # no probe: this node "can run" cuda
    try:
        yield drv
    finally:
        register_backend("cuda", make_cuda_backend, probe=cuda_unavailable_reason)
        be.close()


async def test_a_job_that_only_acquires_is_checkpointed_and_restored_on_every_switch(
    orchestrator: object, nats_url: str, tmp_path: Path, driver: AnyProcessDriver
) -> None:
    env = dict(os.environ, TIMESLICE_NODE_ID=NODE, PYTHONPATH=os.pathsep.join(sys.path))
    async with running(Agent(AgentConfig(node_id=NODE, nats_url=nats_url)), timeout=30) as agent:
        procs = {
            job: subprocess.Popen(
                [sys.executable, "-c", JOB, job, GROUP, nats_url, "3", str(tmp_path / f"{job}.out")],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
            )
            for job in ("a", "b")
        }
        try:

            def finished() -> bool:
                for job, p in procs.items():
                    assert p.poll() is None, f"job {job} exited with {p.returncode}"
                return (
                    all(
                        "done" in (tmp_path / f"{j}.out").read_text() for j in procs if (tmp_path / f"{j}.out").exists()
                    )
                    and len(list(tmp_path.glob("*.out"))) == 2
                )

            await eventually(finished, timeout=90, what="both jobs through their rounds")
            jobs = agent.jobs()
            for job, p in procs.items():
                assert jobs[job].backends == ("cuda",) and jobs[job].pids == (p.pid,), jobs[job]
            rc, out = await timeslice(nats_url, "agent-status", "--node-id", NODE)
            assert rc == 0, out
            for job, p in procs.items():
                (line,) = [ln for ln in out.splitlines() if ln.startswith(f"{job} ")]
                assert f"pid {p.pid}" in line, out
        finally:
            for p in procs.values():
                assert p.stdin is not None
                p.stdin.close()  # the go-ahead to close
            for p in procs.values():
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        assert all(p.returncode == 0 for p in procs.values()), [p.returncode for p in procs.values()]
        # Each job's process was checkpointed when it yielded to the other, and restored when it came back.
        for p in procs.values():
            assert driver.calls.count(("checkpoint", p.pid)) >= 1, driver.calls
            assert driver.calls.count(("restore", p.pid)) >= 1, driver.calls
        await eventually(lambda: not agent.jobs(), what="both jobs unbound once their processes exited")


async def test_a_client_told_not_to_bind_and_a_host_without_agent_keep_the_lock_alone(
    orchestrator: object, nats_url: str, driver: AnyProcessDriver
) -> None:
    async with running(Agent(AgentConfig(node_id=NODE, nats_url=nats_url)), timeout=30) as agent:
        async with AsyncTimeSliceClient("quiet", GROUP, nats_url, bind_process=False, node_id=NODE) as c:
            await c.acquire(timeout=10)
            await c.release()
        assert "quiet" not in agent.jobs()
        async with AsyncTimeSliceClient("elsewhere", GROUP, nats_url, node_id="no-agent-here") as c:
            await c.acquire(timeout=10)  # no socket for that node here: the lock alone, at once
            await c.release()
    assert driver.calls == []


async def test_a_node_whose_default_is_none_leaves_a_bound_job_to_the_lock(orchestrator: object, nats_url: str) -> None:
    cfg = AgentConfig(node_id=NODE, nats_url=nats_url, default_backend="none")
    async with running(Agent(cfg), timeout=30) as agent:
        async with AsyncTimeSliceClient("plain", GROUP, nats_url, node_id=NODE) as c:
            await c.acquire(timeout=10)
            assert c._binding is not None and c._binding.backends == ()
            await c.release()
        assert agent.jobs() == {}


async def test_a_registered_handler_stays_the_jobs_when_its_client_binds(
    orchestrator: object, nats_url: str, driver: AnyProcessDriver
) -> None:
    from .agent_harness import Recorder

    log: list[str] = []
    async with (
        running(Agent(AgentConfig(node_id=NODE, nats_url=nats_url)), timeout=30) as agent,
        AsyncTimeSliceClient("trainer", GROUP, nats_url, node_id=NODE) as c,
    ):
        await c.register_workload(Recorder("trainer", log), node_id=NODE)
        await c.acquire(timeout=10)
        assert c._binding is not None and c._binding.kept
        assert agent.jobs()["trainer"].backends == ("app_channel",)  # not the node's default (cuda here)
        await c.release()
    assert driver.calls == []


async def test_hostile_bind_fields_are_refused_recorded_and_the_agent_goes_on(
    orchestrator: object, nats_url: str
) -> None:
    """The fields this change added to the wire are bounded: an oversized registration token or bind answer is
    refused as undecodable (counted in the agent's refusals), and the agent keeps serving."""
    import msgspec
    from timeslice_client.bus import connect
    from timeslice_client.protocol import AgentReply, subjects

    async with running(Agent(AgentConfig(node_id=NODE, nats_url=nats_url)), timeout=30) as agent:
        nc = await connect(nats_url)
        try:
            for bad in ({"channel": "x" * 65}, {"bind": "yes"}):
                raw = msgspec.json.encode({"type": "register", "group": GROUP, "job": "evil", "backends": [], **bad})
                msg = await nc.request(subjects.agent_rpc(NODE, "register", "evil"), raw, timeout=5)
                reply = msgspec.json.decode(msg.data, type=AgentReply)
                assert not reply.ok and reply.code == "undecodable", reply
            assert "evil" not in agent.jobs()
            refused = agent.metrics.registry.get_sample_value(
                "timeslice_agent_refused_total", {"source": "rpc", "reason": "undecodable"}
            )
            assert refused is not None and refused >= 2
            with pytest.raises(msgspec.ValidationError):  # a bind answer naming too many backends
                msgspec.json.decode(
                    msgspec.json.encode({"type": "agent_reply", "ok": True, "backends": ["b"] * 9}), type=AgentReply
                )
        finally:
            await nc.close()
        async with AsyncTimeSliceClient("after", GROUP, nats_url, node_id=NODE) as c:  # still serving
            await c.acquire(timeout=10)
            await c.release()
