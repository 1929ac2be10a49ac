"""Jobs found through their pods (``_pod_discovery``): the agent lists this node's labelled pods from a fake Kubernetes
API, finds their processes in a fake proc root (the processes themselves are real ``sleep``s, so the agent's liveness
check sees them alive), and keeps the jobs' registrations current; the fake-driver ``cuda`` backend then checkpoints
and restores them on every switch, though the jobs call nothing of ours to register."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeslice_agent import Agent, AgentConfig
from timeslice_agent._cuda import CudaBackend, cuda_unavailable_reason, make_cuda_backend
from timeslice_agent._errors import PodListError
from timeslice_agent._nvml import GpuAccounting
from timeslice_agent._pod_discovery import PodDiscovery, PodProcess, select
from timeslice_agent._pods import Pod, is_pod_channel
from timeslice_agent.backends import register_backend
from timeslice_client import AsyncTimeSliceClient
from timeslice_client.protocol import JobContext

from .agent_harness import Recorder, timeslice
from .helpers import eventually, running
from .pod_fakes import FakeKubeApi, cid, fake_process, pod_json, remove_process
from .test_backend_cuda import GB, DriverNvml, RuleDriver

NODE = "node-a"
GROUP = "g-pods"
UID_A = "aaaaaaaa-5d6e-4f70-8a9b-0c1d2e3f4a5b"
UID_B = "bbbbbbbb-5d6e-4f70-8a9b-0c1d2e3f4a5b"
UID_C = "cccccccc-5d6e-4f70-8a9b-0c1d2e3f4a5b"
SANDBOX = cid(99)  # the pod's "pause" container: in its cgroup, never among its containerStatuses


@pytest.fixture(autouse=True)
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """This node has no NVML, even on a GPU machine: a test that wants one passes its own (``Agent(gpus=...)``)."""
    import timeslice_agent.service as service

    monkeypatch.setattr(service, "gpu_source", lambda: None)


@pytest.fixture
def kube_api() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as api:
        yield api


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """Eight real processes standing for the pods' processes, killed at the end."""
    procs = [subprocess.Popen(["sleep", "300"]) for _ in range(8)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(10)


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    return root


def pods_config(nats_url: str, api: FakeKubeApi, proc: Path, **kw: object) -> AgentConfig:
    return AgentConfig(
        node_id=NODE, nats_url=nats_url, pods=True, pod_api=api.url, pod_scan_s=0.05, proc_root=str(proc), **kw
    )  # type: ignore[arg-type]


def discovery(agent: Agent) -> PodDiscovery:
    assert agent._pods is not None
    return agent._pods


async def scans_later(agent: Agent, n: int = 3) -> None:
    """Until ``n`` more scans have completed (each one reads the pods and /proc again)."""
    target = discovery(agent).scans + n
    await eventually(lambda: discovery(agent).scans >= target, what=f"{n} more pod scans")


def refused(agent: Agent, reason: str) -> float:
    value = agent.metrics.registry.get_sample_value(
        "timeslice_agent_refused_total", {"source": "pods", "reason": reason}
    )
    return value or 0.0


# ---------------------------------------------------------------------------------------------- end to end


async def test_jobs_found_through_labelled_pods_are_checkpointed_and_restored_on_every_switch(
    orchestrator: object, nats_url: str, kube_api: FakeKubeApi, proc: Path, sleepers: list[int]
) -> None:
    a1, a2, a3, pause, b1, c1, a4, _ = sleepers
    # On the GPU (the fake NVML lists them while not checkpointed): a1, a3 (another uid), the sandbox's process
    # (never a container's), b1, a4 (it joins later). a2 holds no device memory.
    driver = RuleDriver({a1: 3 * GB, a3: GB, pause: GB, b1: 5 * GB, a4: GB})
    nvml = DriverNvml(driver)
    backend = CudaBackend(driver, GpuAccounting(nvml))
    register_backend("cuda", lambda nc, node: backend)  # no probe: this node "can run" cuda
    fake_process(proc, pause, pod_uid=UID_A, container=SANDBOX, uid=65535, start=50)
    fake_process(proc, a1, pod_uid=UID_A, container=cid(1), uid=1000, start=100)
    fake_process(proc, a2, pod_uid=UID_A, container=cid(1), uid=1000, start=101, systemd=False)
    fake_process(proc, a3, pod_uid=UID_A, container=cid(1), uid=4242, start=102)
    fake_process(proc, b1, pod_uid=UID_B, container=cid(2), uid=1001, start=200, systemd=False)
    fake_process(proc, c1, pod_uid=UID_C, container=cid(3), uid=1002, start=300)
    pod_a = pod_json(UID_A, "ppo-a-trainer", job="ppo-a", group=GROUP, containers=(cid(1),))
    pod_b = pod_json(UID_B, "ppo-b-trainer", job="ppo-b", group=GROUP, containers=(cid(2),))
    pod_c = pod_json(UID_C, "bad", job="not a job id!", group=GROUP, containers=(cid(3),))
    kube_api.set_pods(pod_a, pod_b, pod_c)
    try:
        async with (
            running(Agent(pods_config(nats_url, kube_api, proc), gpus=nvml), timeout=30) as agent,
            AsyncTimeSliceClient("ppo-a", GROUP, nats_url, bind_process=False, node_id=NODE) as ca,
            AsyncTimeSliceClient("ppo-b", GROUP, nats_url, bind_process=False, node_id=NODE) as cb,
        ):

            def bound() -> dict[str, JobContext]:
                jobs = agent.jobs()
                return jobs if {"ppo-a", "ppo-b"} <= set(jobs) else {}

            jobs = await eventually(bound, timeout=20, what="both jobs bound through their pods")
            assert (jobs["ppo-a"].backends, jobs["ppo-a"].pids) == (("cuda",), (a1,)), jobs["ppo-a"]
            assert (jobs["ppo-b"].backends, jobs["ppo-b"].pids) == (("cuda",), (b1,)), jobs["ppo-b"]
            assert jobs["ppo-a"].group == jobs["ppo-b"].group == GROUP
            owner = jobs["ppo-a"].owner
            assert owner is not None and (owner.pid, owner.uid, owner.pid_starts) == (a1, 1000, (100,))
            assert refused(agent, "invalid_id") == 1  # pod C: counted once, however many scans saw it
            assert set(agent.jobs()) == {"ppo-a", "ppo-b"}

            rc, out = await timeslice(nats_url, "agent-status", "--node-id", NODE)
            assert rc == 0, out
            for job, pid in (("ppo-a", a1), ("ppo-b", b1)):
                (line,) = [ln for ln in out.splitlines() if ln.startswith(f"{job} ")]
                assert f"pid {pid} " in line and "cuda" in line, out

            # The test acquires on the jobs' behalf (they call nothing of ours): every switch moves both.
            for _ in range(2):
                for c in (ca, cb):
                    await c.acquire(timeout=30)
                    await c.release()
            # a -> b (b never ran: nothing to restore), b -> a, a -> b. A grant may come before the outgoing job's
            # snapshot ends (the node has room for both: the restore overlaps it), so the last one is waited for.
            counts = {("checkpoint", a1): 2, ("restore", a1): 1, ("checkpoint", b1): 1, ("restore", b1): 1}
            await eventually(
                lambda: all(driver.calls.count(c) == n for c, n in counts.items()),
                what=f"the driver's calls {counts}: {driver.calls}",
            )
            assert {pid for _, pid in driver.calls} == {a1, b1}, driver.calls  # never a2, a3, the sandbox, c1

            # A process of pod A joins the GPU while job A is saved: left until it runs again, then bound.
            await eventually(lambda: agent.jobs()["ppo-a"].state == "SAVED", what="job A saved")
            fake_process(proc, a4, pod_uid=UID_A, container=cid(1), uid=1000, start=400)
            await scans_later(agent)
            assert agent.jobs()["ppo-a"].pids == (a1,)
            await ca.acquire(timeout=30)
            await eventually(lambda: agent.jobs()["ppo-a"].pids == (a1, a4), what="a4 bound once job A runs")
            await ca.release()
            await cb.acquire(timeout=30)  # a -> b: both of A's processes are checkpointed now
            await cb.release()
            await eventually(lambda: ("checkpoint", a4) in driver.calls, what=f"a4 checkpointed: {driver.calls}")
            await eventually(lambda: agent.jobs()["ppo-a"].state == "SAVED", what="job A saved")

            # Pod B goes (deleted): its job is unregistered; the agent and the other job go on.
            kube_api.set_pods(pod_a, pod_c)
            await eventually(lambda: "ppo-b" not in agent.jobs(), what="job B unregistered once its pod is gone")
            before = len(driver.calls)
            await ca.acquire(timeout=30)  # b -> a, with b gone: A's processes restored, nothing of B's touched
            assert {call for call in driver.calls[before:] if call[0] == "restore"} == {
                ("restore", a1),
                ("restore", a4),
            }, driver.calls
            assert b1 not in {pid for _, pid in driver.calls[before:]}
            await ca.release()
            assert "ppo-a" in agent.jobs()
    finally:
        register_backend("cuda", make_cuda_backend, probe=cuda_unavailable_reason)
        backend.close()


# ---------------------------------------------------------------------------------------------- the rules


async def test_without_nvml_every_process_of_the_pods_containers_is_bound_but_never_init_nor_the_agent(
    nats_url: str, kube_api: FakeKubeApi, proc: Path, sleepers: list[int]
) -> None:
    s0, s1, pause, q0 = sleepers[:4]
    for pid, start in ((s0, 10), (s1, 11), (os.getpid(), 12), (1, 1)):
        fake_process(proc, pid, pod_uid=UID_A, container=cid(1), uid=1000, start=start)
    fake_process(proc, pause, pod_uid=UID_A, container=SANDBOX, uid=1000, start=5)
    fake_process(proc, q0, pod_uid=UID_B, container=cid(2), uid=1000, start=20)
    pod_a = pod_json(UID_A, "a", job="job-a", containers=(cid(1),))  # no group label: the agent's default
    pod_b = pod_json(UID_B, "b", job="job-b", containers=(cid(2),))
    kube_api.set_pods(pod_a, pod_b)
    cfg = pods_config(nats_url, kube_api, proc, default_backend="noop", pod_default_group="dflt")
    async with running(Agent(cfg), timeout=30) as agent:
        ctx = await eventually(lambda: agent.jobs().get("job-a"), timeout=20, what="job A bound")
        assert ctx.pids == tuple(sorted((s0, s1))) and ctx.group == "dflt", ctx
        assert is_pod_channel(ctx.channel)
        # A process of the pod exits: the registration follows.
        remove_process(proc, s1)
        await eventually(lambda: agent.jobs()["job-a"].pids == (s0,), what="s1 left the registration")
        # Its pod is gone: so is the job.
        kube_api.set_pods(pod_b)
        await eventually(lambda: "job-a" not in agent.jobs(), what="job A unregistered")
        assert agent.jobs()["job-b"].pids == (q0,)


async def test_a_pod_without_a_group_is_skipped_when_the_agent_has_no_default(
    nats_url: str, kube_api: FakeKubeApi, proc: Path, sleepers: list[int]
) -> None:
    fake_process(proc, sleepers[0], pod_uid=UID_A, container=cid(1))
    fake_process(proc, sleepers[1], pod_uid=UID_B, container=cid(2))
    kube_api.set_pods(
        pod_json(UID_A, "a", job="job-a", containers=(cid(1),)),
        pod_json(UID_B, "b", job="job-b", group="bad group!", containers=(cid(2),)),
    )
    async with running(
        Agent(pods_config(nats_url, kube_api, proc, default_backend="noop"), gpus=None), timeout=30
    ) as agent:
        await scans_later(agent)
        assert agent.jobs() == {}
        assert refused(agent, "invalid_id") == 1  # the bad group label; a missing one is no refusal


async def test_a_job_that_registered_itself_keeps_its_registration(
    orchestrator: object, nats_url: str, kube_api: FakeKubeApi, proc: Path, sleepers: list[int]
) -> None:
    fake_process(proc, sleepers[0], pod_uid=UID_A, container=cid(1))
    kube_api.set_pods(pod_json(UID_A, "a", job="trainer", group=GROUP, containers=(cid(1),)))
    cfg = pods_config(nats_url, kube_api, proc, default_backend="noop")
    async with (
        running(Agent(cfg, gpus=None), timeout=30) as agent,
        AsyncTimeSliceClient("trainer", GROUP, nats_url, node_id=NODE, bind_process=False) as c,
    ):
        await eventually(lambda: "trainer" in agent.jobs(), timeout=20, what="the pod's job bound")
        await c.register_workload(Recorder("trainer", []), node_id=NODE)  # its own handler, through the socket

        def own_only() -> bool:
            ctx = agent.jobs()["trainer"]
            return ctx.backends == ("app_channel",) and not ctx.parts and not is_pod_channel(ctx.channel)

        await eventually(own_only, what="the pod's registration dropped for the job's own")
        await scans_later(agent)
        assert own_only()  # and discovery never adds it back


async def test_a_failed_scan_is_counted_and_the_next_one_recovers(
    nats_url: str, kube_api: FakeKubeApi, proc: Path, sleepers: list[int]
) -> None:
    fake_process(proc, sleepers[0], pod_uid=UID_A, container=cid(1))
    kube_api.set_pods(pod_json(UID_A, "a", job="job-a", group=GROUP, containers=(cid(1),)))
    kube_api.status, kube_api.body = 503, b"apiserver is restarting"
    async with running(
        Agent(pods_config(nats_url, kube_api, proc, default_backend="noop"), gpus=None), timeout=30
    ) as agent:

        def failed() -> float:
            value = agent.metrics.registry.get_sample_value("timeslice_agent_task_errors_total", {"task": "pod_scan"})
            return value or 0.0

        await eventually(lambda: failed() >= 2, what="failed scans counted")
        assert agent.jobs() == {}
        kube_api.status, kube_api.body = 200, None
        await eventually(lambda: "job-a" in agent.jobs(), what="bound once the API answers")


async def test_a_pod_added_is_bound_at_once_through_the_watch_not_at_the_next_scan(
    nats_url: str, kube_api: FakeKubeApi, proc: Path, sleepers: list[int]
) -> None:
    fake_process(proc, sleepers[0], pod_uid=UID_A, container=cid(1))
    fake_process(proc, sleepers[1], pod_uid=UID_B, container=cid(2))
    pod_a = pod_json(UID_A, "a", job="job-a", group=GROUP, containers=(cid(1),))
    kube_api.set_pods(pod_a)
    cfg = pods_config(nats_url, kube_api, proc, default_backend="noop").model_copy(update={"pod_scan_s": 60.0})
    async with running(Agent(cfg, gpus=None), timeout=30) as agent:
        await eventually(lambda: "job-a" in agent.jobs(), timeout=20, what="job A bound at the first scan")
        await eventually(lambda: "watch=1" in kube_api.requests[-1][0], what="the agent watches")
        t0 = time.monotonic()
        kube_api.set_pods(pod_a, pod_json(UID_B, "b", job="job-b", group=GROUP, containers=(cid(2),)))
        await eventually(lambda: "job-b" in agent.jobs(), timeout=20, what="job B bound")
        assert time.monotonic() - t0 < 10, "seen through the watch, not at the next scan 60 s later"
        scans = discovery(agent).scans
        t_stop = time.monotonic()
    assert time.monotonic() - t_stop < 5, "a watch in progress does not hold up the agent's stop"
    assert scans <= 4  # the first scan, one per change seen, no busy loop


def test_an_agent_told_to_find_pods_outside_a_cluster_says_so_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(PodListError, match="KUBERNETES_SERVICE_HOST"):
        Agent(AgentConfig(node_id=NODE, pods=True))


def test_the_flags_and_the_environment_turn_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from timeslice_cli import build_parser

    args = build_parser().parse_args(
        [
            "agent",
            "--pods",
            "--pod-api",
            "http://127.0.0.1:8001",
            "--pod-scan-s",
            "2",
            "--pod-default-group",
            "g",
            "--pod-node-name",
            "gpu-7",
        ]
    )
    assert (args.pods, args.pod_api, args.pod_scan_s, args.pod_default_group, args.pod_node_name) == (
        True,
        "http://127.0.0.1:8001",
        2.0,
        "g",
        "gpu-7",
    )
    monkeypatch.setenv("TIMESLICE_AGENT_PODS", "1")
    monkeypatch.setenv("TIMESLICE_AGENT_POD_SCAN_S", "7.5")
    cfg = AgentConfig()
    assert cfg.pods and cfg.pod_scan_s == 7.5 and cfg.pod_default_group is None


# ---------------------------------------------------------------------------------------------- select (pure)


def _pod(*containers: str) -> Pod:
    return Pod(
        uid=UID_A, namespace="rl", name="p", job="j", group="g", phase="Running", containers=frozenset(containers)
    )


def _p(pid: int, *, c: str | None = cid(1), uid: int = 1000, start: int = 0) -> PodProcess:
    return PodProcess(pid=pid, container_id=c, start=start or pid, uids=(uid, uid, uid, uid), gid=uid)


def test_select_takes_the_oldest_as_owner_and_leaves_other_uids_out() -> None:
    found = [_p(30, uid=1000), _p(20, uid=1000), _p(25, uid=0), _p(10, c=SANDBOX, uid=65535), _p(40, c=None)]
    sel = select(_pod(cid(1)), found, on_gpu=None, kept=(), own_pid=99)
    assert sel is not None
    assert sel.pids == (20, 30) and sel.strangers == (25,)
    assert (sel.owner.pid, sel.owner.uid, sel.owner.pid_starts) == (20, 1000, (20, 30))
    allowed = select(_pod(cid(1)), found, on_gpu=None, kept=(), own_pid=99, allowed_uids=(0,))
    assert allowed is not None and allowed.pids == (20, 25, 30) and not allowed.strangers
    assert select(_pod(cid(1)), found, on_gpu=None, kept=(), own_pid=99, any_uid=True).pids == (20, 25, 30)  # type: ignore[union-attr]


def test_select_with_nvml_keeps_gpu_processes_and_those_already_bound() -> None:
    found = [_p(20), _p(21), _p(22)]
    sel = select(_pod(cid(1)), found, on_gpu=frozenset({21}), kept=(22,), own_pid=99)
    assert sel is not None and sel.pids == (21, 22)  # 22: checkpointed, so NVML no longer lists it
    assert select(_pod(cid(1)), found, on_gpu=frozenset(), kept=(), own_pid=99) is None


def test_select_never_takes_init_nor_the_agent() -> None:
    assert select(_pod(cid(1)), [_p(1), _p(99)], on_gpu=None, kept=(), own_pid=99) is None
