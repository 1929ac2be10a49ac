"""Runs the demo's jobs as processes against the stack.

A :func:`started_jobs` set is started early (interpreters start, import torch and build their models
while nothing is measured: the solo and the shared sets start together), then :meth:`JobSet.run` tells
its jobs to register with the agent, waits until all are ready, and tells them ``go``: all together
(shared) or one after the other (solo, back to back). A job's wall time is from its ``go`` to its final
checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from . import _messages as m
from ._progress import Progress
from ._stack import Stack

__all__ = ["DemoError", "JobResult", "JobSet", "JobSpec", "RunResult", "started_jobs"]

BUILT_TIMEOUT_S = 180.0  # interpreter start, torch import, model build: several at once on a loaded machine
READY_TIMEOUT_S = 60.0  # registration with the agent
EXIT_TIMEOUT_S = 30.0
STEP_TIMEOUT_S = 60.0  # per step, generous: the whole run's bound is this times the steps
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class DemoError(RuntimeError):
    """A demo job failed or did not answer; the message names the job and its log."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    job: str
    seed: int
    backend: str  # "torch" or "numpy"
    steps: int
    hidden: int
    reward_latency_ms: float


@dataclass(slots=True)
class JobResult:
    spec: JobSpec
    group: str
    log: Path
    built: m.Built | None = None
    ready: m.Ready | None = None
    done: m.Done | None = None
    failed: m.Failed | None = None
    go_t: float = 0.0  # monotonic, when the runner said go
    wall_s: float = 0.0  # go -> this job's Done, as the runner saw it
    go_ms: int = 0  # wall clock at go and when its Done arrived (its window of the stream)
    done_ms: int = 0
    offloads: list[m.Offload] = field(default_factory=list)


@dataclass(slots=True)
class RunResult:
    label: str  # "solo" or "shared"
    jobs: dict[str, JobResult]
    wall_s: float  # the sum, over the waves of jobs told go together, of go -> the wave's last Done


def _now_ms() -> int:
    return int(time.time() * 1000)


def _command(spec: JobSpec, stack: Stack, group: str, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "timeslice_cli.demo._job",
        "--job",
        spec.job,
        "--group",
        group,
        "--nats-url",
        stack.nats_url,
        "--node-id",
        stack.node_id,
        "--out",
        str(out),
        "--backend",
        spec.backend,
        "--steps",
        str(spec.steps),
        "--seed",
        str(spec.seed),
        "--hidden",
        str(spec.hidden),
        "--reward-latency-ms",
        str(spec.reward_latency_ms),
    ]


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@dataclass(slots=True)
class _Proc:
    proc: asyncio.subprocess.Process
    res: JobResult
    built: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    async def follow(self, label: str, progress: Progress) -> None:
        """Read the job's stdout until it closes (every event is set then: waiters look at the result)."""
        assert self.proc.stdout is not None
        res = self.res
        while line := await self.proc.stdout.readline():
            try:
                msg = m.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not a job message (a library printing to stdout): ignore it
            if isinstance(msg, m.Built):
                res.built = msg
                self.built.set()
            elif isinstance(msg, m.Ready):
                res.ready = msg
                self.ready.set()
            elif isinstance(msg, m.Offload):
                res.offloads.append(msg)
            elif isinstance(msg, m.Done):
                res.done = msg
                res.wall_s = time.monotonic() - res.go_t
                res.done_ms = _now_ms()
                self.finished.set()
            elif isinstance(msg, m.Failed):
                res.failed = msg
                break
            progress.update(label, msg)
        for ev in (self.built, self.ready, self.finished):
            ev.set()

    async def tell(self, word: str) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(word.encode() + b"\n")
        await stdin.drain()

    async def check(self, what: str) -> None:
        """Raise DemoError unless the job reached ``what`` (built, ready, done)."""
        res = self.res
        if getattr(res, what) is None and res.failed is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EXIT_TIMEOUT_S):
                    await self.proc.wait()
        if res.failed is not None:
            raise DemoError(f"job {res.spec.job} failed: {res.failed.error} (log: {res.log})\n{_tail(res.log)}")
        if getattr(res, what) is None:
            raise DemoError(
                f"job {res.spec.job} exited (status {self.proc.returncode}) before it was {what} "
                f"(log: {res.log})\n{_tail(res.log)}"
            )


class JobSet:
    """Job processes started by :func:`started_jobs`; :meth:`run` runs them once."""

    def __init__(self, label: str, procs: dict[str, _Proc], progress: Progress, workdir: Path) -> None:
        self.label = label
        self._procs = procs
        self._progress = progress
        self._workdir = workdir

    async def wait_built(self) -> None:
        try:
            async with asyncio.timeout(BUILT_TIMEOUT_S):
                for p in self._procs.values():
                    await p.built.wait()
        except TimeoutError as exc:
            raise DemoError(
                f"the {self.label} jobs did not start within {BUILT_TIMEOUT_S:.0f} s; logs in {self._workdir}"
            ) from exc
        for p in self._procs.values():
            await p.check("built")

    async def run(self, *, sequential: bool) -> RunResult:
        """Register every job, then go: all at once, or one after the other (``sequential``)."""
        procs = self._procs
        await self.wait_built()
        self._progress.start(self.label, list(procs), max(p.res.spec.steps for p in procs.values()))
        try:
            for p in procs.values():
                await p.tell("register")
            try:
                async with asyncio.timeout(READY_TIMEOUT_S):
                    for p in procs.values():
                        await p.ready.wait()
            except TimeoutError as exc:
                raise DemoError(
                    f"the {self.label} jobs did not register within {READY_TIMEOUT_S:.0f} s; logs in {self._workdir}"
                ) from exc
            for p in procs.values():
                await p.check("ready")
            wall = 0.0
            for wave in [[j] for j in procs] if sequential else [list(procs)]:
                for job in wave:
                    res = procs[job].res
                    res.go_t, res.go_ms = time.monotonic(), _now_ms()
                    await procs[job].tell("go")
                bound = STEP_TIMEOUT_S * max(procs[j].res.spec.steps for j in wave) + 60
                try:
                    async with asyncio.timeout(bound):
                        for job in wave:
                            await procs[job].finished.wait()
                except TimeoutError as exc:
                    raise DemoError(
                        f"the {self.label} run did not finish within {bound:.0f} s; logs in {self._workdir}"
                    ) from exc
                for job in wave:
                    await procs[job].check("done")
                wall += max(procs[j].res.wall_s for j in wave)
            for p in procs.values():  # all done: now they may leave (unregister) without racing a switch
                await p.tell("exit")
            for job, p in procs.items():
                try:
                    async with asyncio.timeout(EXIT_TIMEOUT_S):
                        code = await p.proc.wait()
                except TimeoutError:
                    code = None
                if code != 0:
                    raise DemoError(
                        f"job {job} exited with {code} after its run (log: {p.res.log})\n{_tail(p.res.log)}"
                    )
        finally:
            self._progress.finish()
        return RunResult(self.label, {j: p.res for j, p in procs.items()}, wall)


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(EXIT_TIMEOUT_S):
                await proc.wait()


@contextlib.asynccontextmanager
async def started_jobs(
    stack: Stack, specs: list[JobSpec], *, label: str, groups: dict[str, str], workdir: Path, progress: Progress
) -> AsyncIterator[JobSet]:
    """Start a process per spec (job ``j`` will register in group ``groups[j]``); on the way out, kill
    those still running."""
    env = dict(os.environ, TIMESLICE_LOG_LEVEL="warning", **dict.fromkeys(_THREAD_ENV, "1"))
    procs: dict[str, _Proc] = {}
    failed: Exception | None = None
    async with asyncio.TaskGroup() as tg:
        try:
            for s in specs:
                res = JobResult(s, groups[s.job], workdir / f"{label}-{s.job}.log")
                log = await asyncio.to_thread(open, res.log, "ab")
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *_command(s, stack, res.group, workdir / f"{label}-{s.job}.npz"),
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=log,
                        env=env,
                    )
                finally:
                    log.close()
                procs[s.job] = _Proc(proc, res)
                tg.create_task(procs[s.job].follow(label, progress))
            yield JobSet(label, procs, progress, workdir)
        except Exception as exc:  # the body's own error: raised as it is, not in the group's wrapper
            failed = exc
        finally:
            for p in procs.values():
                await _kill(p.proc)
    if failed is not None:
        raise failed
