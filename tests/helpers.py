"""Test helpers: bounded waiting, never a bare sleep."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription
    from timeslice_client import AsyncTimeSliceClient, TimeSliceClient
    from timeslice_client.protocol import GroupRecord

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]


class Service(Protocol):
    """What the orchestrator and the agent share: ``run()`` until ``shutdown()``, ``ready`` once serving."""

    @property
    def ready(self) -> asyncio.Event: ...

    async def run(self) -> None: ...

    def shutdown(self) -> None: ...


S = TypeVar("S", bound=Service)


@contextlib.asynccontextmanager
async def running(service: S, *, timeout: float = 20.0) -> AsyncIterator[S]:
    """Run ``service`` in this event loop while the block runs: ready on entry, shut down (and awaited) on exit.
    A service that exits before it is ready fails the test with its own error."""
    task = asyncio.get_running_loop().create_task(service.run())
    ready = asyncio.get_running_loop().create_task(service.ready.wait())
    done, _ = await asyncio.wait({task, ready}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        ready.cancel()
        task.result()
    if ready not in done:
        ready.cancel()
        raise AssertionError(f"{type(service).__name__} did not become ready within {timeout} s")
    try:
        yield service
    finally:
        service.shutdown()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout)


@contextlib.asynccontextmanager
async def running_agents(nats_url: str, nodes: list[str]) -> AsyncIterator[None]:
    """An in-process agent for each of ``nodes``, all running while the block runs."""
    from timeslice_agent import Agent, AgentConfig

    async with contextlib.AsyncExitStack() as stack:
        for node in nodes:
            await stack.enter_async_context(running(Agent(AgentConfig(node_id=node, nats_url=nats_url))))
        yield


class Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)


@contextlib.contextmanager
def all_closed(make: Callable[..., C]) -> Iterator[Callable[..., C]]:
    """``make`` (a process's constructor, say), and everything it made closed when the block ends."""
    made: list[C] = []

    def _make(*args: Any, **kwargs: Any) -> C:
        c = make(*args, **kwargs)
        made.append(c)
        return c

    try:
        yield _make
    finally:
        for c in made:
            c.close()


async def eventually(
    check: Callable[[], Awaitable[T] | T], *, timeout: float = 10.0, interval: float = 0.01, what: str = ""
) -> T:
    """Call ``check`` until it returns a truthy value (or stops raising AssertionError), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            result = check()
            if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
                result = await result  # type: ignore[misc]
            if result:
                return result  # type: ignore[return-value]
            last = None
        except AssertionError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {what or check}") from last
        await asyncio.sleep(interval)


def eventually_sync(check: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.01, what: str = "") -> T:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            result = check()
            if result:
                return result
            last = None
        except AssertionError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {what or check}") from last
        time.sleep(interval)


def loopback_url(server: asyncio.Server | None, scheme: str) -> str:
    """``<scheme>://127.0.0.1:<port>`` of a server a test started on 127.0.0.1 with port 0 (the system chose the
    port): the address its clients are given."""
    assert server is not None, "the server is not started"
    return f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def strike_point(ready: Callable[[], bool], finished: Callable[[], bool], rng: random.Random, what: str) -> bool:
    """For the fault tests: wait (60 s at most) until ``ready()`` or until every job ``finished()``, then a random
    instant of up to 10 ms more. Whether to strike there (False: the jobs are done, nothing is left to strike)."""
    eventually_sync(lambda: ready() or finished(), timeout=60, what=what)
    if finished():
        return False
    time.sleep(rng.uniform(0.0, 0.01))  # a random instant to strike at, not a wait for anything
    return True


async def group_record(client: AsyncTimeSliceClient, group: str | None = None) -> GroupRecord:
    """The orchestrator's stored record of ``group`` (default: the client's), read through ``client``'s connection:
    what a test checks the orchestrator's bookkeeping against (request ids, confirmations, the switch), which
    ``status()``'s public view leaves out."""
    from timeslice_client._group_reads import read_record

    return await read_record(await client._groups_kv(), group or client.group_id, client.nats_url)


def group_record_sync(client: TimeSliceClient, group: str | None = None) -> GroupRecord:
    """:func:`group_record` through a blocking client."""
    inner = client._client
    return client._run(group_record(inner, group), client._margin(inner.request_timeout_s))


async def example_line(script: str, job: str, *extra: str, env: dict[str, str], timeout: float) -> str:
    """Run ``examples/<script>`` as job ``job`` for 3 steps with 10 ms rewards (``extra``: more flags) and return its
    summary line (``<job>: 3 steps in ...``); a nonzero exit fails the test with the end of its stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / script),
        "--job",
        job,
        "--steps",
        "3",
        "--reward-ms",
        "10",
        *extra,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    (line,) = [ln for ln in out.decode().splitlines() if ln.startswith(f"{job}: 3 steps in")]
    return line


def stop_process(proc: subprocess.Popen[bytes], *, grace_s: float = 15.0, kill_wait_s: float = 10.0) -> None:
    """End ``proc`` if it runs: SIGTERM, then SIGKILL when it has not exited within ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(kill_wait_s)


def run_text(
    args: Sequence[str],
    *,
    timeout: float,
    cwd: Path | str = ROOT,
    env: Mapping[str, str] | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` to its end (in ``cwd``, default the repository; ``env`` None: this process's), its stdout and
    stderr captured as text: how the tests run a command or a script and read what it said. ``check``: a nonzero
    exit raises ``CalledProcessError``; else the caller asserts on ``returncode`` with the output in the message."""
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=check)


def overlap_s(a: Iterable[Sequence[float]], b: Iterable[Sequence[float]]) -> float:
    """Seconds that the intervals of ``a`` and of ``b`` (each ``(start, end)``, one clock) have in common, summed over
    every pair."""
    bs = list(b)
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in bs)


async def subscribed(nc: NATS, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> Subscription:
    """``nc.subscribe(subject, cb=cb)`` that the server has seen on return: a yield lets nats-py put the SUB on the
    socket first, else ``flush()`` after ``subscribe()`` is no barrier (1-2% of requests found no responders;
    docs/nats.md)."""
    sub = await nc.subscribe(subject, cb=cb)
    await asyncio.sleep(0)
    await nc.flush()
    return sub
