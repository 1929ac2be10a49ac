"""Harness for the agent process tests: the agent and workload processes, CLI and stream helpers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Self

import msgspec
import pytest
from timeslice_client import AsyncTimeSliceClient, Grant, GroupRecord, HandlerResult, SuspendMode
from timeslice_client.bus import connect
from timeslice_client.protocol import OpResult, OpStarted, decode_input, subjects
from timeslice_orchestrator.invariants import StreamChecker

from .helpers import all_closed, eventually, group_record, stop_process
from .workers import log_events, read_stream, worker_command

ROOT = Path(__file__).resolve().parents[1]
NODE = "n1"
START = 30.0  # seconds a fresh interpreter (torch included) may take on a loaded 2-core machine
MB = 1024 * 1024
AGENT_TTL = 6.0  # the agents bucket's TTL (BusConfig.agent_ttl_s)

# --------------------------------------------------------------------------- processes


class AgentProcess:
    """``python -m timeslice_agent`` for one node (``own_session``: in a session of its own, its process group its
    pid, never the test's)."""

    own_session: ClassVar[bool] = False

    def __init__(self, nats_url: str, node: str, log_path: Path) -> None:
        self.nats_url, self.node, self.log_path = nats_url, node, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.args: tuple[str, ...] = ()  # more flags for the next start(), e.g. ("--no-overlap-restores",)

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it; closed right after the fork
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "timeslice_agent",
                    "--node-id",
                    self.node,
                    "--nats-url",
                    self.nats_url,
                    *self.args,
                ],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=self.own_session,
            )
        finally:
            log.close()

    async def jobs(self) -> dict[str, dict[str, Any]]:
        """The agent's job contexts, by job (its ``status`` request/reply)."""
        nc = await connect(self.nats_url)
        try:
            msg = await nc.request(subjects.agent_rpc(self.node, "status"), b"", timeout=2)
            return {j["job"]: j for j in msgspec.json.decode(msg.data)}
        finally:
            await nc.close()

    async def wait_states(self, states: dict[str, str], *, exact: bool = False) -> dict[str, dict[str, Any]]:
        """The agent's jobs once the named ones are in the given states (``exact``: and no other job)."""

        async def check() -> dict[str, dict[str, Any]] | None:
            jobs = await self.jobs()
            now = {j: c["state"] for j, c in jobs.items() if exact or j in states}
            return jobs if now == states else None

        return await eventually(check, interval=0.05, what=f"agent states {states}")

    async def __aenter__(self) -> Self:
        """Started and answering; stopped at the block's end."""
        self.start()
        try:
            await self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()

    async def wait_ready(self, timeout: float = START) -> None:
        async def answers() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"agent exited: {self.describe()}"
            try:
                await self.jobs()
            except Exception:
                return False
            return True

        await eventually(answers, timeout=timeout, interval=0.05, what=f"agent {self.node} answers")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def describe(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"agent rc={self.proc.poll() if self.proc else None} log={text[-3000:]!r}"


@pytest.fixture(name="agent")
async def node_agent(orchestrator: object, nats_url: str, tmp_path: Path) -> AsyncIterator[AgentProcess]:
    """The fixture ``agent``: ``NODE``'s agent process (its log ``tmp_path / "agent.log"``), started and answering,
    beside the in-process orchestrator. Every test module's (conftest.py imports it); a module's own ``agent``
    fixture overrides it."""
    async with AgentProcess(nats_url, NODE, tmp_path / "agent.log") as a:
        yield a


class Workload:
    """One ``tests.workers.workload_worker`` process: commands go to its control file, events come from
    its JSON-lines log."""

    def __init__(self, tmp: Path, nats_url: str, group: str, job: str, node: str, **opts: Any) -> None:
        self.job = job
        self.out = tmp / f"workload-{group}-{job}.jsonl"
        self.control = tmp / f"workload-{group}-{job}.ctl"
        self.stderr_path = tmp / f"workload-{group}-{job}.stderr"
        self.control.write_text("")
        args = worker_command(
            "workload_worker", nats_url, group, job, self.out, node_id=node, control_file=self.control, **opts
        )
        err = open(self.stderr_path, "ab")  # noqa: SIM115 - the child holds it; closed right after the fork
        try:
            self.proc = subprocess.Popen(
                args,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        finally:
            err.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, *cmds: str) -> None:
        with open(self.control, "a", encoding="utf-8") as f:
            f.write("".join(c + "\n" for c in cmds))

    def events(self, ev: str | None = None) -> list[dict[str, Any]]:
        return log_events(self.out, ev)

    def last(self, ev: str) -> dict[str, Any] | None:
        found = self.events(ev)
        return found[-1] if found else None

    async def wait(self, ev: str, n: int = 1, timeout: float = 15.0) -> dict[str, Any]:
        """The ``n``-th ``ev`` event (1-based), once it is there; fails early on a worker error."""

        def check() -> dict[str, Any] | None:
            found = self.events(ev)
            if len(found) >= n:
                return found[n - 1]
            errors = [e for e in self.events("error") if ev != "error"]
            assert not errors or ev == "error", f"{self.job} failed while waiting for {ev}: {errors}"
            assert self.proc.poll() is None, f"{self.job} exited while waiting for {ev}: {self.describe()}"
            return None

        return await eventually(check, timeout=timeout, interval=0.02, what=f"{self.job}: {ev} #{n}")

    def proc_state(self) -> str:
        """The process state letter from /proc (R, S, T = stopped, …)."""
        with open(f"/proc/{self.pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()

    def describe(self) -> str:
        err = self.stderr_path.read_text(errors="replace")[-3000:] if self.stderr_path.exists() else ""
        return f"workload {self.job} rc={self.proc.poll()} events={self.events()[-8:]} output={err!r}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # also ends a stopped (frozen) process
        self.proc.wait(10)


Spawn = Callable[..., Workload]


@pytest.fixture(name="spawn")
def node_workloads(agent: AgentProcess, tmp_path: Path, nats_url: str) -> Iterator[Spawn]:
    """Workload processes of ``NODE`` beside the ``agent`` fixture's agent, all closed at the test's end (a module
    may define its own ``spawn``)."""

    def workload(group: str, job: str, **opts: Any) -> Workload:
        return Workload(tmp_path, nats_url, group, job, NODE, **opts)

    with all_closed(workload) as made:
        yield made


@pytest.fixture(name="observer")
async def records_observer(nats_url: str) -> AsyncIterator[AsyncTimeSliceClient]:
    """A client that only reads group records (a module may define its own ``observer``)."""
    async with AsyncTimeSliceClient("observer", "observer", nats_url) as c:
        yield c


def up_command(tmp_path: Path, *extra: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of ``timeslice up`` for a test: its data and URL file under ``tmp_path``, warnings
    only, no gRPC port and no metrics ports (``extra`` comes last: a flag there wins), no credentials of another bus."""
    env = dict(os.environ, TIMESLICE_URL_FILE=str(tmp_path / "nats.url"), TIMESLICE_LOG_LEVEL="warning")
    env.pop("TIMESLICE_CREDS", None)
    args = [sys.executable, "-m", "timeslice_cli", "up", "--data-dir", str(tmp_path / "data"), "--node-id", "n-up"]
    args += ["--grpc-port", "-1", "--metrics-port", "-1", "--agent-metrics-port", "-1", *extra]
    return args, env


def up_fields(line: str) -> dict[str, str]:
    """The ``key=value`` fields of ``timeslice up``'s first line (``nats=<url>`` ...)."""
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


async def start_cli(
    nats_url: str, sub: str, *rest: str, log_level: str = "warning", merged: bool = False
) -> asyncio.subprocess.Process:
    """Start ``timeslice <sub> --nats-url <nats_url> <rest>`` (``python -m timeslice_cli``, logging warnings only
    unless ``log_level`` says), its stdout and stderr piped (``merged``: both in one pipe, stdout, for a test that
    reads its log lines as they come)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "timeslice_cli",
        "--log-level",
        log_level,
        sub,
        "--nats-url",
        nats_url,
        *rest,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT if merged else asyncio.subprocess.PIPE,
    )


async def timeslice(nats_url: str, *args: str) -> tuple[int, str]:
    """Run the ``timeslice`` command (``python -m timeslice_cli``); returns (rc, stdout)."""
    proc = await start_cli(nats_url, *args)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    if proc.returncode != 0:
        return proc.returncode, out.decode() + err.decode()
    return proc.returncode, out.decode()


def queued(obs: AsyncTimeSliceClient, group: str, job: str) -> Callable[[], Any]:
    async def check() -> GroupRecord | None:
        rec = await group_record(obs, group)
        return rec if job in [w.job for w in rec.queue] else None

    return check


async def hold_then_queue(a: Workload, b: Workload, observer: AsyncTimeSliceClient, group: str) -> dict[str, Any]:
    """``a`` acquires and works, then ``b`` asks and waits behind it (the record shows it queued): a switch from a
    to b set up, up to a's release. Returns a's ``worked`` event."""
    a.send("acquire")
    worked = await a.wait("worked")
    b.send("acquire")
    await eventually(queued(observer, group, b.job), what=f"{b.job} queued behind {a.job}")
    return worked


async def switch_under_way(a: Workload, b: Workload, observer: AsyncTimeSliceClient) -> None:
    """``a`` holds, ``b`` waits, ``a`` releases: the switch's snapshot of ``a`` runs, blocked in ``a``'s handler
    (a ``slow`` one) until the test lets it go on."""
    await a.wait("ready")
    await b.wait("ready")
    a.send("acquire")
    await a.wait("granted")
    b.send("acquire")
    await eventually(queued(observer, observer.group_id, b.job), what=f"{b.job} waiting")
    a.send("release")
    await a.wait("suspend_start")


async def queue_behind(
    holder: AsyncTimeSliceClient,
    waiter: AsyncTimeSliceClient,
    *,
    wait_s: float = 10.0,
    observer: AsyncTimeSliceClient | None = None,
) -> tuple[Grant, asyncio.Task[Grant]]:
    """``holder`` takes its group, then ``waiter`` asks and waits behind it (the record, read through ``observer``,
    default the holder, shows it queued): a switch set up, up to the holder's release. Returns the holder's grant
    and the waiter's acquire, still pending (``wait_s``: its timeout)."""
    grant = await holder.acquire(timeout=10)
    task = asyncio.create_task(waiter.acquire(timeout=wait_s))
    obs = observer or holder
    await eventually(queued(obs, obs.group_id, waiter.job_id), what=f"{waiter.job_id} queued behind {holder.job_id}")
    return grant, task


async def recorded_switch(
    a: AsyncTimeSliceClient, b: AsyncTimeSliceClient, log: list[str], node: str, *, wait_s: float = 10.0
) -> Grant:
    """Jobs ``a`` and ``b`` register :class:`Recorder` workloads on ``node`` (one ``log``); ``a`` holds, ``b`` queues
    behind it and ``a`` releases: returns b's grant, which the switch's snapshot of a and restore of b came before."""
    await a.register_workload(Recorder(a.job_id, log), node_id=node)
    await b.register_workload(Recorder(b.job_id, log), node_id=node)
    _, tb = await queue_behind(a, b, wait_s=wait_s)
    await a.release()
    return await tb


async def switch_back(a: Workload, b: Workload, observer: AsyncTimeSliceClient, group: str) -> dict[str, Any]:
    """``a``, which held ``group`` before ``b``, asks again and waits behind ``b`` (the record shows it queued); ``b``
    releases. Returns a's second ``granted`` event."""
    a.send("acquire")
    await eventually(queued(observer, group, a.job), what=f"{a.job} queued behind {b.job}")
    b.send("release")
    return await a.wait("granted", n=2)


async def op_events(nats_url: str, group: str) -> tuple[list[OpResult], list[OpStarted], StreamChecker]:
    """Operation outcomes and starts of ``NODE`` in ``group``, and the stream folded by the invariant checker."""
    stream = await read_stream(nats_url)
    results = [
        ev
        for _, _, subj, data in stream
        if subj == subjects.agent_event(NODE, group) and isinstance(ev := decode_input(data), OpResult)
    ]
    started = [
        msgspec.json.decode(data, type=OpStarted)
        for _, _, subj, data in stream
        if subj == subjects.agent_op(NODE) and msgspec.json.decode(data)["group"] == group
    ]
    checker = StreamChecker()
    checker.feed_all(stream)
    return results, started, checker


def one(items: list[Any], what: str) -> Any:
    assert len(items) == 1, f"expected one {what}, got {items}"
    return items[0]


# --------------------------------------------------------------------------- in-process workload handlers


class Recorder:
    """A workload handler that appends ``<name>:suspend`` / ``<name>:resume`` to ``log`` (``fail_suspend``: its
    suspend raises instead, having moved nothing)."""

    def __init__(self, name: str, log: list[str], fail_suspend: bool = False) -> None:
        self.name, self.log, self.fail_suspend = name, log, fail_suspend

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        if self.fail_suspend:
            raise RuntimeError("cannot offload right now")
        self.log.append(f"{self.name}:suspend")
        return HandlerResult(bytes_moved=100, device_bytes_freed=100)

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        self.log.append(f"{self.name}:resume")
        return HandlerResult(bytes_moved=100, device_bytes_freed=0)


class Blocking(Recorder):
    """Its suspend holds (in the handler's worker thread) until the test sets ``go``."""

    def __init__(self, name: str, log: list[str], go: threading.Event, wait_s: float = 30.0) -> None:
        super().__init__(name, log)
        self.go, self.wait_s = go, wait_s

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        self.log.append(f"{self.name}:suspend start")
        if not self.go.wait(self.wait_s):
            raise RuntimeError("the test never let the suspend finish")
        return super().suspend(mode, tags)
