"""The agent acts only on processes a job proved to own (issue 24, item 4).

A job proves which process it is through the agent's node-local Unix socket (the kernel's peer credentials) and
registers on ``ts.rpc.agent.<node>.register.<job>`` with the token it got. The agent then takes only that process,
its descendants and its own process group, running as its uid; never pid <= 1, the agent's own process or group; a
process-level backend without a proof is refused. Everything runs for real: the agent as a process (or in this
process where a fake /proc root is needed), a nats-server, the Unix socket, child processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS
from timeslice_agent import Agent, AgentConfig
from timeslice_client import AgentRefused, CallbackHandler, register_workload
from timeslice_client._agent_socket import MAX_LINE, Answer, ProofUnavailable, prove
from timeslice_client._internal.bus_layout import ensure_bus
from timeslice_client.protocol import (
    AgentReply,
    JobContext,
    JobState,
    OpResult,
    RegisterJob,
    Restore,
    Snapshot,
    UnregisterJob,
    encode,
    subjects,
)

from .agent_harness import NODE, ROOT
from .helpers import eventually, running
from .test_agent_untrusted import OwnSessionAgent, all_acknowledged, publish_command

NOBODY = 65534


class SocketAgent(OwnSessionAgent):
    """The agent process (a session of its own) with more flags (``--socket``, ``--allow-uid``)."""

    def __init__(self, nats_url: str, node: str, log_path: Path, *args: str) -> None:
        super().__init__(nats_url, node, log_path)
        self.args = args


@pytest.fixture
def sock(agent_socket_dir: Path) -> str:
    return str(agent_socket_dir / f"agent-{NODE}.sock")


@pytest.fixture
async def agent(nats_url: str, tmp_path: Path) -> AsyncIterator[SocketAgent]:
    async with SocketAgent(nats_url, NODE, tmp_path / "agent.log") as a:
        yield a


def _sleeper(**kw: Any) -> subprocess.Popen[bytes]:
    """A child process of this test that runs until killed, in a session (and process group) of its own."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        **kw,
    )


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    p = _sleeper()
    try:
        yield p
    finally:
        p.kill()
        p.wait(10)


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1 and len(out) < 4096:
        with open(f"/proc/{pid}/stat", "rb") as f:
            pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        out.append(pid)
    return out


@pytest.fixture
def stranger() -> Iterator[int]:
    """A process of this uid that is no descendant of this test (started through a parent that exited at once): a
    process of another job, as far as the agent can tell. Its own session, so its group is its pid."""
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True,"
        " stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid)"
    )
    pid = int(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    )
    try:
        assert os.getpid() not in _ancestors(pid), "the stranger is a descendant of the test after all"
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def _noop_handler() -> CallbackHandler:
    return CallbackHandler(lambda mode, tags: None, lambda mode, tags: None)


async def _register_raw(nc: NATS, req: RegisterJob, *, job: str | None = None, node: str = NODE) -> AgentReply:
    msg = await nc.request(subjects.agent_rpc(node, "register", job or req.job), encode(req), timeout=5)
    return msgspec.json.decode(msg.data, type=AgentReply)


async def _refused(job: str, nats_url: str, code: str, match: str, **kw: Any) -> AgentRefused:
    with pytest.raises(AgentRefused) as info:
        await register_workload(job, "g", _noop_handler(), node_id=NODE, nats_url=nats_url, **kw)
    assert info.value.code == code and match in info.value.reason, info.value
    return info.value


# --------------------------------------------------------------------------- refusals


async def test_processes_the_job_does_not_own_are_refused(
    agent: SocketAgent, nats_url: str, stranger: int, child: subprocess.Popen[bytes]
) -> None:
    # (job, code, what the reason says, the processes it names), each registered with the freeze backend
    refusals: list[tuple[str, str, str, dict[str, Any]]] = [
        # Another job's process and its process group: no descendant of the registering process (this test).
        ("j1", "not_owned", f"pid {stranger} is not process {os.getpid()}", {"pids": (stranger,)}),
        ("j2", "not_owned", f"process group {stranger} is not the registering process's own", {"pgid": stranger}),
        ("j3", "not_owned", f"pid {stranger}", {"pids": (child.pid, stranger)}),
        # Never init, never a group a kill(2) would widen, never the agent itself or its group: a proof changes
        # nothing.
        ("j4", "forbidden_process", "pid 1 is not a job's process id", {"pids": (1,)}),
        *((f"j5-{g}", "forbidden_process", f"pgid {g} is not a job's process group", {"pgid": g}) for g in (0, 1)),
        ("j6", "forbidden_process", f"pid {agent.pid} is the agent's own process", {"pids": (agent.pid,)}),
        ("j7", "forbidden_process", f"pgid {agent.pid} is the agent's own process group", {"pgid": agent.pid}),
    ]
    for job, code, match, processes in refusals:
        await _refused(job, nats_url, code, match, backends=("freeze",), **processes)
    assert await agent.jobs() == {}, "a refused registration was stored"
    assert _state(stranger) != "T" and _state(agent.pid) != "T"


async def test_a_process_level_backend_without_a_proof_is_refused(
    agent: SocketAgent, nc: NATS, child: subprocess.Popen[bytes]
) -> None:
    # What an attacker with bus access (or a job without the socket) sends: the child's group, no proof.
    reply = await _register_raw(nc, RegisterJob(group="g", job="j", backends=("freeze",), pgid=child.pid))
    assert (reply.ok, reply.code) == (False, "unproven") and "did not prove" in (reply.error or ""), reply
    for backends in (("freeze",), ("app_channel", "freeze")):  # (cuda: the same, where the node has it)
        reply = await _register_raw(nc, RegisterJob(group="g", job="j", backends=backends, pids=(child.pid,)))
        assert (reply.ok, reply.code) == (False, "unproven"), (backends, reply)
    # Backends that touch no process need no proof (their pids only say when the job is gone).
    reply = await _register_raw(nc, RegisterJob(group="g", job="j", backends=("noop",), pids=(child.pid,)))
    assert reply.ok, reply
    jobs = await agent.jobs()
    assert jobs["j"]["owner"] is None and jobs["j"]["backends"] == ["noop"]


async def test_the_subjects_job_is_the_one_acted_for_and_a_proof_serves_one_registration(
    agent: SocketAgent, nc: NATS, sock: str, child: subprocess.Popen[bytes]
) -> None:
    token = await prove("j", NODE, path=sock)
    # A payload naming another job than its subject: refused, typed (permissions let only job j publish here).
    reply = await _register_raw(nc, RegisterJob(group="g", job="victim", backends=("noop",)), job="j")
    assert (reply.ok, reply.code) == (False, "wrong_job") and "names job 'victim'" in (reply.error or ""), reply
    msg = await nc.request(
        subjects.agent_rpc(NODE, "unregister", "j"), encode(UnregisterJob(group="g", job="x")), timeout=5
    )
    assert msgspec.json.decode(msg.data, type=AgentReply).code == "wrong_job"
    # A message of another kind on a subject is refused (a registration sent as a clear_fault).
    msg = await nc.request(subjects.agent_rpc(NODE, "clear_fault"), encode(RegisterJob(group="g", job="j")), timeout=5)
    assert msgspec.json.decode(msg.data, type=AgentReply).code == "undecodable"
    # A proof asked for job j does not serve job k; and it is used up by that try.
    reply = await _register_raw(nc, RegisterJob(group="g", job="k", backends=("freeze",), pgid=child.pid, proof=token))
    assert (reply.ok, reply.code) == (False, "unproven") and "asked for job 'j'" in (reply.error or ""), reply
    reply = await _register_raw(nc, RegisterJob(group="g", job="j", backends=("freeze",), pgid=child.pid, proof=token))
    assert (reply.ok, reply.code) == (False, "unproven") and "unknown, used or expired" in (reply.error or "")
    reply = await _register_raw(
        nc, RegisterJob(group="g", job="j", backends=("freeze",), pgid=child.pid, proof="0" * 32)
    )
    assert (reply.ok, reply.code) == (False, "unproven"), reply
    # A fresh one works, once.
    token = await prove("j", NODE, path=sock)
    reply = await _register_raw(
        nc, RegisterJob(group="g", job="j", backends=("freeze",), pgid=child.pid, pids=(), proof=token)
    )
    assert reply.ok, reply
    owner = (await agent.jobs())["j"]["owner"]
    assert (owner["pid"], owner["uid"], owner["gid"]) == (os.getpid(), os.getuid(), os.getgid()), owner


# --------------------------------------------------------------------------- a proven freeze works


async def _command(nc: NATS, cmd: Snapshot | Restore) -> OpResult:
    results = await nc.subscribe(subjects.agent_event(NODE, cmd.group))
    try:
        seq = await publish_command(nc, encode(cmd))

        async def answered() -> OpResult | None:
            try:
                msg = await results.next_msg(timeout=0.5)
            except TimeoutError:
                return None
            if msgspec.json.decode(msg.data).get("type") != "op_result":
                return None
            r = msgspec.json.decode(msg.data, type=OpResult)
            return r if r.op_id == cmd.op_id else None

        result = await eventually(answered, timeout=15, what=f"the result of {cmd.op_id}")
        await all_acknowledged(nc, seq)
        return result
    finally:
        await results.unsubscribe()


def _deadline() -> int:
    return int(time.time() * 1000) + 30_000


async def test_a_proven_registration_freezes_and_thaws_its_own_process_group(
    agent: SocketAgent, nc: NATS, nats_url: str, child: subprocess.Popen[bytes]
) -> None:
    grandchild_code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.01)'])\n"
        "while True: time.sleep(0.01)"
    )
    group = subprocess.Popen([sys.executable, "-c", grandchild_code], start_new_session=True)
    members: list[int] = []

    def both() -> list[int] | None:
        found = [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if _pgrp(p) == group.pid]
        return found if len(found) == 2 else None

    try:
        members = await eventually(both, what="both processes of the group started")
        channel = await register_workload(
            "fz", "gf", _noop_handler(), node_id=NODE, nats_url=nats_url, backends=("freeze",), pgid=group.pid
        )
        try:
            r = await _command(
                nc, Snapshot(op_id="s1", group="gf", job="fz", node=NODE, epoch=1, deadline_ms=_deadline())
            )
            assert r.ok, r
            # SIGSTOP takes effect as each process next runs: polled, bounded.
            await eventually(lambda: all(_state(p) == "T" for p in members), timeout=5, what="the group stopped")
            assert _state(child.pid) != "T", "a process outside the job's group was stopped"
            r = await _command(
                nc, Restore(op_id="r1", group="gf", job="fz", node=NODE, epoch=2, deadline_ms=_deadline())
            )
            assert r.ok, r
            await eventually(lambda: all(_state(p) != "T" for p in members), timeout=5, what="the group resumed")
        finally:
            await channel.close()
    finally:
        group.kill()
        group.wait(10)
        for p in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def _pgrp(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


async def test_a_context_in_kv_without_a_proof_is_never_acted_on(
    nats_url: str, nc: NATS, child: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """A job context written before proofs existed (or by anyone but a proven registration): the agent keeps it, but
    freeze does not stop its processes, and says why."""
    buckets = await ensure_bus(nc.jetstream(), AgentConfig().bus)
    old = JobContext(node=NODE, job="old", group="go", state=JobState.RUNNING, backends=("freeze",), pgid=child.pid)
    await buckets.jobs.put(f"{NODE}.old", encode(old))
    a = SocketAgent(nats_url, NODE, tmp_path / "agent.log")
    a.start()
    try:
        await a.wait_ready()
        r = await _command(
            nc, Snapshot(op_id="s-old", group="go", job="old", node=NODE, epoch=1, deadline_ms=_deadline())
        )
        assert not r.ok and "refused (unproven)" in (r.error or ""), r
        assert _state(child.pid) != "T"

        async def running_again() -> bool:  # the agent answers first and stores the state back after
            return bool((await a.jobs())["old"]["state"] == "RUNNING")

        await eventually(running_again, timeout=30, what="the refused job's context RUNNING again")
    finally:
        a.stop()


# --------------------------------------------------------------------------- uids


@pytest.mark.skipif(os.geteuid() != 0, reason="a process of another uid needs root; the simulated test covers it")
async def test_a_process_of_another_uid_is_refused_unless_allowed(nats_url: str, tmp_path: Path) -> None:
    # This test's child, running as nobody (who may not run this test's interpreter: a plain binary).
    other = subprocess.Popen(["sleep", "300"], user=NOBODY, cwd="/", stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        for allowed, args in ((False, ()), (True, ("--allow-uid", str(NOBODY)))):
            a = SocketAgent(nats_url, NODE, tmp_path / f"agent-{allowed}.log", *args)
            a.start()
            try:
                await a.wait_ready()
                if not allowed:
                    await _refused(
                        "u",
                        nats_url,
                        "not_owned",
                        f"pid {other.pid} runs as uid {NOBODY}",
                        backends=("freeze",),
                        pids=(other.pid,),
                    )
                    await _refused(
                        "u", nats_url, "not_owned", f"runs as uid {NOBODY}", backends=("freeze",), pgid=other.pid
                    )
                    continue
                channel = await register_workload(
                    "u", "g", _noop_handler(), node_id=NODE, nats_url=nats_url, backends=("freeze",), pids=(other.pid,)
                )
                await channel.close()
            finally:
                a.stop()
    finally:
        other.kill()
        other.wait(10)


def _fake_proc(root: Path, uid_of: dict[int, int]) -> None:
    """``root`` as /proc: every process there now, linked, except those of ``uid_of``, whose status says they run
    as that uid (their stat is copied: same start time)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        if int(name) in uid_of:
            d = root / name
            d.mkdir()
            (d / "stat").write_bytes(Path(f"/proc/{name}/stat").read_bytes())
            uid = uid_of[int(name)]
            lines = [
                f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}" if line.startswith("Uid:") else line
                for line in Path(f"/proc/{name}/status").read_text().splitlines()
            ]
            (d / "status").write_text("\n".join(lines) + "\n")
        else:
            (root / name).symlink_to(f"/proc/{name}")


async def test_another_uid_simulated_with_a_fake_proc_root(
    nats_url: str, tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    """The same rule where no second uid can be had: the agent's /proc says the child runs as uid 4242."""
    fake = tmp_path / "proc"
    fake.mkdir()
    _fake_proc(fake, {child.pid: 4242})
    for allowed in ((), (4242,)):
        node = f"fake-{len(allowed)}"
        cfg = AgentConfig(node_id=node, nats_url=nats_url, proc_root=str(fake), allowed_uids=allowed)
        async with running(Agent(cfg)) as agent:
            kw: dict[str, Any] = {"node_id": node, "nats_url": nats_url, "backends": ("freeze",), "pids": (child.pid,)}
            if not allowed:
                with pytest.raises(AgentRefused) as info:
                    await register_workload("u", "g", _noop_handler(), **kw)
                assert info.value.code == "not_owned" and f"pid {child.pid} runs as uid 4242" in info.value.reason
                assert agent.jobs() == {}
                continue
            channel = await register_workload("u", "g", _noop_handler(), **kw)
            assert agent.jobs()["u"].owner is not None
            await channel.close()


# --------------------------------------------------------------------------- the socket itself


async def test_the_socket_is_bounded_and_its_directory_is_checked(
    nats_url: str, tmp_path: Path, agent_socket_dir: Path
) -> None:
    path = agent_socket_dir / "made" / "agent.sock"
    a = SocketAgent(nats_url, NODE, tmp_path / "agent.log", "--socket", str(path))
    a.start()
    try:
        await a.wait_ready()
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o755 and stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666

        async def exchange(data: bytes) -> bytes:
            reader, writer = await asyncio.open_unix_connection(str(path))
            try:
                writer.write(data)
                await writer.drain()
                async with asyncio.timeout(10):
                    return await reader.read(4096)
            finally:
                writer.close()

        for data, expected in (
            (b"x" * (MAX_LINE * 4) + b"\n", "at most 512 bytes"),
            (b"{nope\n", "undecodable"),
            (json.dumps({"job": "a.b", "pid": 7}).encode() + b"\n", ""),
        ):
            answer = msgspec.json.decode(await exchange(data), type=Answer)
            assert not answer.ok and expected in (answer.error or ""), (data[:40], answer)
        assert await exchange(b"") == b"", "a caller that sends nothing is answered nothing, and let go"
        answer = msgspec.json.decode(
            await exchange(json.dumps({"job": "j", "pid": os.getpid()}).encode() + b"\n"), type=Answer
        )
        assert answer.ok and answer.pid == os.getpid() and answer.token and len(answer.token) == 32, answer
        with pytest.raises(ProofUnavailable, match="no agent socket"):
            await prove("j", NODE, path=str(tmp_path / "none.sock"))
    finally:
        a.stop()
    assert not path.exists(), "the socket outlived its agent"
    # A directory others may write to is not the agent's: it refuses to start there.
    shared = agent_socket_dir / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    b = SocketAgent(nats_url, NODE, tmp_path / "agent-b.log", "--socket", str(shared / "agent.sock"))
    b.start()
    try:
        assert b.proc is not None and b.proc.wait(60) != 0
        assert "not writable by group or others" in b.log_text(), b.log_text()[-2000:]
    finally:
        b.stop()


# --------------------------------------------------------------------------- a job in a pid namespace of its own

_NS_JOB = """\
import asyncio, os, sys
from timeslice_client import CallbackHandler, register_workload

async def main() -> None:
    channel = await register_workload("nsjob", "g", CallbackHandler(lambda m, t: None, lambda m, t: None),
                                      node_id=sys.argv[2], nats_url=sys.argv[1], backends=("freeze",))
    print("registered", os.getpid(), flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    await channel.close()

asyncio.run(main())
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="a pid namespace of its own needs root and unshare(1)"
)
async def test_a_job_in_a_pid_namespace_of_its_own_registers_its_processes_as_the_agent_sees_them(
    agent: SocketAgent, nats_url: str
) -> None:
    """A pod without hostPID: the job is pid 1 where it runs, and registers that. The agent translates it (the
    NSpid of the processes of the socket peer's namespace) to the pid it has on the node."""
    proc = await asyncio.create_subprocess_exec(
        "unshare",
        "--fork",
        "--pid",
        "--mount-proc",
        sys.executable,
        "-c",
        _NS_JOB,
        nats_url,
        NODE,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        async with asyncio.timeout(60):
            line = (await proc.stdout.readline()).decode()
        assert line.split() == ["registered", "1"], line + (await proc.stdout.read()).decode()[-3000:]
        job = (await agent.jobs())["nsjob"]
        (host_pid,) = job["pids"]
        assert host_pid > 1 and job["owner"]["pid"] == host_pid
        nspid = Path(f"/proc/{host_pid}/status").read_text().split("NSpid:")[1].split("\n")[0].split()
        assert nspid[-1] == "1" and nspid[0] == str(host_pid), nspid
        proc.stdin.write(b"\n")
        await proc.stdin.drain()
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
