"""Shared plumbing of the bench scripts: the stack's processes, CPU accounting, machine facts, result files.

Private to ``bench/``: each script imports it as ``_common`` (the scripts run as ``python bench/X.py``,
so ``bench/`` is on ``sys.path``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    from tests.cluster import NatsCluster

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
LOADGEN = BENCH / "_loadgen.py"
GO_SUBJECT = "bench.go"  # the load generators start when this arrives
STOP_SUBJECT = "bench.stop"  # ... and stop early when this does
JOBS = 4  # jobs per group in scale.py and recovery.py
T = TypeVar("T")


def loop_run(coro: Coroutine[Any, Any, T]) -> T:
    """Run with uvloop when installed (as the orchestrator and the clients do), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def pct(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank) of ``xs``; NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def run_and_report(
    coro: Coroutine[Any, Any, dict[str, Any]], report: Callable[[dict[str, Any]], bool], json_out: str | None
) -> NoReturn:
    """Run a bench (``coro``), print its report, write its result file (``--json-out``); exit 0 when the report
    says its goals were met, else 1."""
    res = loop_run(coro)
    ok = report(res)
    write_json(json_out, res)
    sys.exit(0 if ok else 1)


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, from ``/proc/<pid>/stat`` (utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> float:
    return os.getloadavg()[0]


def machine_facts() -> dict[str, Any]:
    """Cores, CPU model, memory, Python and bus versions, load: the header of every result."""
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_gb = int(Path("/proc/meminfo").read_text().split()[1]) / 1024**2
    nats_version = "unknown"
    with contextlib.suppress(Exception):
        from timeslice_orchestrator.embedded import find_nats_server

        out = subprocess.run([find_nats_server(), "--version"], capture_output=True, text=True, timeout=10, check=False)
        nats_version = out.stdout.strip() or out.stderr.strip()
    nats_py = "unknown"
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        nats_py = version("nats-py")
    return {
        "utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gb": round(mem_gb, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nats_server": nats_version,
        "nats_py": nats_py,
        "loadavg_1m": round(loadavg(), 2),
    }


def write_json(path: str | os.PathLike[str] | None, result: dict[str, Any]) -> None:
    """Write a result file (``--json-out``), creating its folder."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2, default=str) + "\n")


def write_result(
    path: str | os.PathLike[str] | None, bench: str, machine: dict[str, Any], figures: dict[str, Any]
) -> None:
    """Write a bench's result file (``--json-out``, nothing without one): which bench, the command that ran it, the
    machine's facts at its start, then its figures."""
    write_json(path, {"bench": bench, "command": command_line(), "machine": machine, **figures})


def trials_args(doc: str, trials: int, quick: int) -> tuple[int, str | None]:
    """The command line of a bench that times ``--trials`` attempts each way (``--quick``: ``quick`` of them, to
    check the pipeline): how many to run, and where ``--json-out`` writes the result."""
    p = argparse.ArgumentParser(description=doc.split("\n\n", maxsplit=1)[0])
    p.add_argument("--trials", type=int, default=trials)
    p.add_argument("--quick", action="store_true", help=f"{quick} trials each way (checks the pipeline)")
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    return (quick if a.quick else a.trials), a.json_out


def command_line() -> str:
    """The command that produced this result, as a person would type it."""
    script = Path(sys.argv[0])
    with contextlib.suppress(ValueError):
        script = script.resolve().relative_to(ROOT)
    return " ".join(["python", str(script), *sys.argv[1:]])


def child_env() -> dict[str, str]:
    """Environment for the stack's processes: quiet logs (unless $TIMESLICE_LOG_LEVEL says otherwise), the
    repository's packages importable."""
    paths = [str(ROOT / "libs"), str(ROOT / "services" / "orchestrator"), str(ROOT / "services" / "agent")]
    old = os.environ.get("PYTHONPATH")
    pythonpath = os.pathsep.join([*paths, *([old] if old else [])])
    env = dict(os.environ, PYTHONPATH=pythonpath)
    env.setdefault("TIMESLICE_LOG_LEVEL", "warning")
    return env


class Orchestrator:
    """``python -m timeslice_orchestrator orchestrator --nats-url URL`` as its own process."""

    def __init__(self, url: str, log_path: Path, args: Sequence[str] = ()) -> None:
        self.url = url
        self.log_path = log_path
        self.args = tuple(args)  # more flags, e.g. ``("--replicas", "3")``
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0  # time.monotonic() just before the spawn

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the orchestrator is not running"
        return self.proc.pid

    def start(self) -> None:
        log = self.log_path.open("ab")
        try:
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "timeslice_orchestrator", "orchestrator", "--nats-url", self.url, *self.args],
                cwd=ROOT,
                env=child_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            log.close()

    async def wait_ready(self, js: Any, timeout: float = 60.0) -> float:
        """Seconds from spawn until its durable consumer is bound (stream and buckets exist before that)."""
        from timeslice_client.protocol import STREAM

        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"the orchestrator exited; see {self.log_path}")
            with contextlib.suppress(Exception):
                info = await js.consumer_info(STREAM, "orchestrator")
                if info.push_bound:
                    return time.monotonic() - self.started_at
            if time.monotonic() > deadline:
                raise TimeoutError(f"the orchestrator was not ready within {timeout} s; see {self.log_path}")
            await asyncio.sleep(0.01)  # polling the server for the consumer, bounded by the deadline above

    def kill(self) -> float:
        """SIGKILL and reap; returns time.monotonic() of the kill."""
        assert self.proc is not None
        t = time.monotonic()
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None
        return t

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 15 s. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def flags(**values: object) -> list[str]:
    """A child script's flags from keywords, in order: ``flags(go_timeout=3, out=path)`` is ``["--go-timeout", "3",
    "--out", str(path)]``."""
    return [arg for name, value in values.items() for arg in (f"--{name.replace('_', '-')}", str(value))]


def spawn(script: Path, *args: str, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """A bench worker (``python bench/<script> ...``) in its own process."""
    return _python(str(script), *args, log_path=log_path)


def start_agent(url: str, node: str, log_path: Path, *flags: str) -> subprocess.Popen[bytes]:
    """``node``'s agent (``python -m timeslice_agent``) in its own process, its output in ``log_path``."""
    return _python("-m", "timeslice_agent", "--node-id", node, "--nats-url", url, *flags, log_path=log_path)


def _python(*args: str, log_path: Path | None) -> subprocess.Popen[bytes]:
    out: Any = log_path.open("ab") if log_path else None
    try:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
    finally:
        if out is not None:
            out.close()


def wait_file(path: Path, proc: subprocess.Popen[bytes], timeout: float, what: str = "worker") -> None:
    """Until a worker process writes ``path`` (its ready or done mark); an error naming ``what`` as soon as the
    worker has exited, or once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready: {path} did not appear within {timeout:g} s")
        time.sleep(0.01)  # polling a file another process writes; bounded by the deadline


async def wait_all_ready(
    marks: Sequence[tuple[Path, subprocess.Popen[bytes]]], timeout: float, logs: str, what: str = "trace job"
) -> None:
    """Until each process writes its ready file (``marks``: the file and the process); an error naming ``what``
    and where the logs are (``logs``) as soon as one has exited, or once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    for ready, p in marks:
        while not ready.exists():
            if p.poll() is not None:
                raise RuntimeError(f"{what} exited with {p.returncode}; see {logs}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}s did not start within {timeout:g} s")
            await asyncio.sleep(0.02)  # polling the file the worker writes, bounded


async def wait_procs(procs: Sequence[subprocess.Popen[bytes]], timeout: float, what: str) -> None:
    """Wait for worker processes to exit; raise (naming the log) if one fails or they overrun."""
    async with asyncio.timeout(timeout):
        for p in procs:
            rc = await asyncio.to_thread(p.wait)
            if rc != 0:
                raise RuntimeError(f"{what} exited with {rc} (args: {p.args!r})")


async def wait_agent(url: str, node: str, timeout: float = 30.0, check: Callable[[], None] | None = None) -> None:
    """Until ``node``'s agent answers its status request (workers register with it at once). ``check`` runs
    before each try: it raises when a service process has exited, so the wait ends at once."""
    from timeslice_client.bus import connect
    from timeslice_client.protocol import subjects

    nc = await connect(url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if check is not None:
                check()
            try:
                await nc.request(subjects.agent_rpc(node, "status"), b"", timeout=1)
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {node!r}'s agent did not answer within {timeout:.0f} s") from exc
                await asyncio.sleep(0.05)
    finally:
        await nc.close()


async def push_consumer(nc: Any, js: Any, stream: str, durable: str, subject: str, cb: Any) -> None:
    """A durable push consumer of ``stream``'s ``subject`` (explicit acks) delivering to ``cb``, its delivery
    subscription in place before the consumer exists."""
    from nats.js.api import AckPolicy, ConsumerConfig

    deliver = nc.new_inbox()
    await nc.subscribe(deliver, cb=cb)
    await asyncio.sleep(0)  # else flush() after subscribe() is no barrier (docs/nats.md)
    await nc.flush()
    await js.add_consumer(
        stream,
        ConsumerConfig(
            durable_name=durable, deliver_subject=deliver, ack_policy=AckPolicy.EXPLICIT, filter_subject=subject
        ),
    )


def stop_procs(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def scratch_dir(prefix: str) -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix=prefix))


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


async def nats_cluster(tmp: Path, name: str) -> NatsCluster:
    """Three clustered NATS servers under ``tmp/nats``, started and ready: for the benches that kill or cut off a
    server under a replicated stream (chaos.py, stream_leader.py); the caller closes it."""
    from tests.cluster import NatsCluster

    cluster = NatsCluster(tmp / "nats", size=3, name=name)
    cluster.start()
    await cluster.ready()
    return cluster


# ---------------------------------------------------------------------- load generators


async def start_loadgens(
    url: str, tmp: Path, tag: str, groups: int, procs: int, mode: str, extra: tuple[str, ...] = (), prefix: str = "g"
) -> list[tuple[Any, Path, Path]]:
    """Start ``procs`` load generators (``_loadgen.py``) sharing ``groups``; wait until each has subscribed."""
    out = []
    per, rest = divmod(groups, procs)
    first = 0
    for k in range(procs):
        n = per + (1 if k < rest else 0)
        if n == 0:
            continue
        ready, res = tmp / f"{tag}-{k}.ready", tmp / f"{tag}-{k}.json"
        argv = flags(url=url, mode=mode, prefix=f"{prefix}{k}", first=first, count=n, jobs=JOBS, ready=ready, out=res)
        out.append((spawn(LOADGEN, *argv, *extra, log_path=tmp / f"{tag}-{k}.log"), ready, res))
    await wait_all_ready([(ready, p) for p, ready, _ in out], 120, f"{tmp}/{tag}-*.log", "load generator")
    return out


async def go(nc: Any, warmup: float, duration: float) -> tuple[float, float]:
    """Start the load generators: measure from ``warmup`` s from now, for ``duration`` s, then stop."""
    t0 = time.monotonic()
    w0, w1 = t0 + warmup, t0 + warmup + duration
    await nc.publish(GO_SUBJECT, json.dumps({"window_start": w0, "window_end": w1, "stop": w1}).encode())
    await nc.flush()
    return w0, w1


async def go_future(nc: Any) -> asyncio.Future[dict[str, float]]:
    """A job's side of :func:`go`: subscribed on ``nc``, the go message's window once it arrives."""
    went: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()

    async def on_go(msg: Any) -> None:
        if not went.done():
            went.set_result(json.loads(msg.data))

    await nc.subscribe(GO_SUBJECT, cb=on_go)
    return went


async def ready_then_go(nc: Any, went: asyncio.Future[dict[str, float]], ready: str, timeout: float) -> float:
    """Say the job is ready (its subscriptions reached the server, then the file ``ready`` written) and wait, at
    most ``timeout`` s, for the go (``went``: :func:`go_future`'s); the measured window's start."""
    await asyncio.sleep(0)  # else flush() after subscribe() is no barrier (docs/nats.md)
    await nc.flush()
    Path(ready).write_text("ready")
    async with asyncio.timeout(timeout):
        return float((await went)["window_start"])


async def timed_cycles(client: Any, n: int, gap: float, *, hold: float = 0.0) -> list[tuple[int, int]]:
    """Time ``n`` acquire/release cycles of an open ``AsyncTimeSliceClient``, each after ``gap`` s idle, holding
    ``hold`` s between its acquire and its release: each cycle's (acquire, release) in ns of CLOCK_MONOTONIC. A first
    cycle, untimed, makes the connection's subscriptions and the group's record, so that none is in the timings."""
    await client.acquire(timeout=30)
    await client.release()
    out: list[tuple[int, int]] = []
    for _ in range(n):
        await asyncio.sleep(gap)
        t0 = time.monotonic_ns()
        await client.acquire(timeout=30)
        t1 = time.monotonic_ns()
        if hold:
            await asyncio.sleep(hold)
        t2 = time.monotonic_ns()
        await client.release()
        out.append((t1 - t0, time.monotonic_ns() - t2))
    return out


def blocking_timed_cycles(client: Any, n: int, gap: float, *, hold: float = 0.0) -> list[tuple[int, int]]:
    """:func:`timed_cycles` through the blocking ``TimeSliceClient``: each cycle's (acquire, release) in ns."""
    client.acquire(timeout=30)
    client.release()
    out: list[tuple[int, int]] = []
    for _ in range(n):
        time.sleep(gap)
        t0 = time.monotonic_ns()
        client.acquire(timeout=30)
        t1 = time.monotonic_ns()
        if hold:
            time.sleep(hold)
        t2 = time.monotonic_ns()
        client.release()
        out.append((t1 - t0, time.monotonic_ns() - t2))
    return out


async def sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))  # the measurement window's planned edges


async def stop_loadgens(nc: Any, after_next_grant: float | None = None) -> None:
    """Tell the load generators to stop now, or ``after_next_grant`` seconds after each sees its next grant."""
    await nc.publish(
        STOP_SUBJECT, b"" if after_next_grant is None else json.dumps({"after_next_grant": after_next_grant}).encode()
    )
    await nc.flush()


class Spin:
    """What the spinning thread of ``python_spinning`` got: its CPU time and the wall time it was on (both 0 when
    off). ``cpu_share``: the part of that wall time it ran, about 1 when it had a core of its own; near 0 on a machine
    too loaded to run it, where it cannot take the GIL from anyone, so a comparison against it says nothing."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.wall_s = 0.0

    @property
    def cpu_share(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


@contextlib.contextmanager
def python_spinning(on: bool = True) -> Iterator[Spin]:
    """While inside, another thread of this process runs Python without pause (a job scoring rewards after it
    yielded), once it runs: a new thread needs the GIL to begin, so this waits until it holds it once. The ``Spin``
    it yields is filled on the way out."""
    stop, spinning = threading.Event(), threading.Event()
    got = Spin()

    def spin() -> None:
        spinning.set()
        t0, c0 = time.perf_counter(), time.thread_time()
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i * i
        got.cpu_s, got.wall_s = time.thread_time() - c0, time.perf_counter() - t0

    t = threading.Thread(target=spin, daemon=True)
    if on:
        t.start()
        if not spinning.wait(10):
            raise RuntimeError("the spinning thread did not start within 10 s")
    try:
        yield got
    finally:
        stop.set()
        if on:
            t.join(10)
