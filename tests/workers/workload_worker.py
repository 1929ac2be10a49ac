"""A workload as a standalone process: real state, registered with its node's snapshot agent.

Run as::

    python -m tests.workers.workload_worker --nats-url URL --group G --job J --node-id N --out FILE \
        --control-file CTL [--mb 8] [--backend app_channel|freeze|app_channel+freeze|noop] \
        [--handler torch|numpy|failing|slow|none] [--counter-ms 10] [...]

It holds state of about ``--mb`` MB (a torch model + Adam optimizer behind ``TorchOffloadHandler``, or a
numpy buffer behind a ``CallbackHandler`` that really frees and reallocates it), registers with the
agent of ``--node-id`` through ``AsyncTimeSliceClient.register_workload`` (with ``freeze`` the agent
signals this very process, whose pid the channel registers), then obeys commands the test appends to
``--control-file``, one per line:

* ``acquire``: acquire the group, then do one step of "GPU work" (a training step / ``buf += 1``);
* ``release``: release the group;
* ``unblock``: let a ``slow`` handler's blocked suspend go on;
* ``exit``: close the client (unregisters the workload) and exit 0.

Everything it does goes to ``--out`` as JSON lines, flushed one by one (``t`` is ``time.time()``)::

    {"ev": "ready", "pid": 1, "device_bytes": 8388608, "host_bytes": 0, "checksum": "…", "ids": [..]}
    {"ev": "granted", "epoch": 2, "context_restored": true, "waited_ms": 4, "checksum": …, "ids": …}
    {"ev": "worked", "step": 1, "epoch": 2, "checksum": …, "device_bytes": …}
    {"ev": "releasing", "epoch": 2, "checksum": …} / {"ev": "released", "epoch": 2, "pending": 1}
    {"ev": "suspend_start", "op_id": …, "device_bytes": …, "checksum": …}    # from the agent's request
    {"ev": "suspended", "device_bytes_before": …, "device_bytes_after": 0, "host_bytes_after": …,
     "bytes_moved": …, "device_bytes_freed": …, "elapsed_ms": …}
    {"ev": "suspend_failed", "error": …, "device_bytes": …, "checksum": …}
    {"ev": "resume_start", …} / {"ev": "resumed", "device_bytes": …, "checksum": …, "ids": …, …}
    {"ev": "tick", "n": 17}                                                  # --counter-ms > 0
    {"ev": "error", "where": "acquire", "type": "JobFaulted", "msg": …}

``ids`` are the ``id()`` of the objects the training loop uses (parameters and optimizer state tensors,
or the numpy array): a restore must bring the bytes back into the same objects.

Handlers: ``torch`` and ``numpy`` move the state; ``failing`` fails every suspend (the first
``--fail-suspends`` ones when that is not negative) before touching anything, so the state stays as it
was; ``slow`` logs ``suspend_start`` and then blocks until ``unblock`` (or ``--slow-s``) before moving
the numpy state; ``none`` is for ``freeze``/``noop`` jobs (the agent never calls it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from timeslice_client import AsyncTimeSliceClient, HandlerResult, SuspendMode

from .event_log import EventLog
from .job_flags import job_parser

MB = 1024 * 1024


# --------------------------------------------------------------------------- state


class NumpyState:
    """A float64 buffer standing for device memory. Suspend copies it to a host buffer and frees the
    original's memory in place (``ndarray.resize(0)``: same object, no data); resume reallocates it in
    place and copies the bytes back."""

    def __init__(self, mb: float) -> None:
        import numpy as np

        self._np = np
        n = max(1, int(mb * MB) // 8)
        self.buf = np.random.default_rng(1234).standard_normal(n)
        self._n = n
        self._host: Any = None

    def device_bytes(self) -> int:
        return int(self.buf.nbytes)

    def host_bytes(self) -> int:
        return 0 if self._host is None else int(self._host.nbytes)

    def ids(self) -> list[int]:
        return [id(self.buf)]

    def checksum(self) -> str:
        return hashlib.sha256(self.buf.tobytes()).hexdigest()

    def work(self, step: int) -> None:
        if self.buf.size != self._n:
            raise RuntimeError(f"working on a suspended buffer ({self.buf.size} of {self._n} elements)")
        self.buf += step

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        if self.buf.size == 0:
            return HandlerResult()  # already suspended (a repeated request)
        size = self.device_bytes()
        self._host = self.buf.copy() if mode is SuspendMode.OFFLOAD else None
        self.buf.resize(0, refcheck=False)
        return HandlerResult(bytes_moved=self.host_bytes(), device_bytes_freed=size)

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        if self.buf.size == self._n:
            return HandlerResult()  # already resident
        self.buf.resize(self._n, refcheck=False)
        moved = 0
        if self._host is not None:
            self.buf[:] = self._host
            moved = int(self._host.nbytes)
            self._host = None
        else:
            self.buf[:] = 0.0  # discarded: the job rebuilds it
        return HandlerResult(bytes_moved=moved, device_bytes_freed=self.device_bytes())


class TorchState:
    """A small MLP and its Adam optimizer (about ``mb`` MB of parameters + optimizer state) behind
    :class:`timeslice_client.torch_offload.TorchOffloadHandler`."""

    def __init__(self, mb: float, device: str) -> None:
        import torch
        from timeslice_client.torch_offload import TorchOffloadHandler

        self._torch = torch
        torch.manual_seed(1234)
        width = 256
        # Adam keeps two more tensors per parameter: parameters are a third of the total.
        layers = max(1, int(mb * MB / 3 / 4 / (width * width + width)))
        mods: list[Any] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
        self.model = torch.nn.Sequential(*mods).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(32, width, device=device)
        self.step(0)  # materialize the optimizer state before the handler sees it
        self.handler = TorchOffloadHandler(self.model, self.opt)  # tags "weights" and "optimizer"

    def tensors(self) -> list[Any]:
        out = [p for p in self.model.parameters()]
        for p in self.model.parameters():
            for _, v in sorted(self.opt.state.get(p, {}).items()):
                if isinstance(v, self._torch.Tensor):
                    out.append(v)
        return out

    def device_bytes(self) -> int:
        return int(self.handler.device_bytes())

    def host_bytes(self) -> int:
        return int(self.handler.host_bytes())

    def ids(self) -> list[int]:
        return [id(t) for t in self.tensors()]

    def checksum(self) -> str:
        h = hashlib.sha256()
        for t in self.tensors():
            # A copy: ``.numpy()`` on the tensor itself would make its storage non-resizable for good.
            h.update(t.detach().to("cpu", copy=True).contiguous().numpy().tobytes())
        return h.hexdigest()

    def step(self, step: int) -> None:
        loss = self.model(self.x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def work(self, step: int) -> None:
        self.step(step)

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return self.handler.suspend(mode, tags)

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return self.handler.resume(mode, tags)


class NoState:
    """For jobs whose context is handled outside the process (``freeze``, ``noop``)."""

    def device_bytes(self) -> int:
        return 0

    def host_bytes(self) -> int:
        return 0

    def ids(self) -> list[int]:
        return []

    def checksum(self) -> str:
        return ""

    def work(self, step: int) -> None:
        pass

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return HandlerResult()

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return HandlerResult()


class InjectedFailure(RuntimeError):
    pass


class LoggingHandler:
    """The handler the agent drives: logs every call around the state's own suspend/resume and injects the
    failures and delays the test asked for."""

    def __init__(self, a: argparse.Namespace, state: Any, log: EventLog) -> None:
        self.a = a
        self.state = state
        self.log = log
        self.unblock = threading.Event()
        self.suspends = 0
        self._lock = threading.Lock()

    def describe(self) -> dict[str, Any]:
        return {
            "device_bytes": self.state.device_bytes(),
            "host_bytes": self.state.host_bytes(),
            "checksum": self.state.checksum(),
            "ids": self.state.ids(),
        }

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        with self._lock:
            self.suspends += 1
            before = self.state.device_bytes()
            self.log("suspend_start", n=self.suspends, mode=str(mode), **self.describe())
            t0 = time.perf_counter()
            try:
                if self.a.handler == "failing" and (self.a.fail_suspends < 0 or self.suspends <= self.a.fail_suspends):
                    raise InjectedFailure(f"cannot offload right now (injected failure {self.suspends})")
                if self.a.handler == "slow":
                    released = self.unblock.wait(self.a.slow_s)
                    self.log("suspend_unblocked", by_command=released)
                r = self.state.suspend(mode, tags)
            except Exception as exc:
                self.log("suspend_failed", error=f"{exc.__class__.__name__}: {exc}", **self.describe())
                raise
            self.log(
                "suspended",
                device_bytes_before=before,
                device_bytes_after=self.state.device_bytes(),
                host_bytes_after=self.state.host_bytes(),
                bytes_moved=r.bytes_moved,
                device_bytes_freed=r.device_bytes_freed,
                elapsed_ms=(time.perf_counter() - t0) * 1000,
            )
            return r

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        with self._lock:
            before = self.state.device_bytes()
            self.log("resume_start", device_bytes=before, host_bytes=self.state.host_bytes())
            t0 = time.perf_counter()
            try:
                r = self.state.resume(mode, tags)
            except Exception as exc:
                self.log("resume_failed", error=f"{exc.__class__.__name__}: {exc}")
                raise
            self.log(
                "resumed",
                device_bytes_before=before,
                bytes_moved=r.bytes_moved,
                device_bytes_taken=r.device_bytes_freed,
                elapsed_ms=(time.perf_counter() - t0) * 1000,
                **self.describe(),
            )
            return r


# --------------------------------------------------------------------------- the job


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = job_parser("workload_worker", __doc__, node=True, out_help="JSON-lines event log (appended)")
    p.add_argument("--control-file", required=True, help="commands, one per line (appended by the test)")
    p.add_argument("--mb", type=float, default=8.0, help="size of the state in MB")
    p.add_argument("--backend", default="app_channel", help="backends joined by '+', e.g. app_channel+freeze")
    p.add_argument("--handler", choices=("torch", "numpy", "failing", "slow", "none"), default="numpy")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1 …)")
    p.add_argument("--mode", choices=[m.value for m in SuspendMode], default=SuspendMode.OFFLOAD.value)
    p.add_argument("--fail-suspends", type=int, default=-1, help="failing: fail this many suspends (-1: all)")
    p.add_argument("--slow-s", type=float, default=60.0, help="slow: block a suspend at most this long")
    p.add_argument("--counter-ms", type=float, default=0.0, help="run a counter thread ticking every N ms")
    p.add_argument("--op-timeout", type=float, default=120.0, help="seconds the agent gives each operation")
    p.add_argument("--acquire-timeout", type=float, default=60.0)
    p.add_argument("--lease-seconds", type=float, default=30.0)
    p.add_argument("--waiter-ttl", type=float, default=5.0)
    return p.parse_args(argv)


def make_state(a: argparse.Namespace) -> Any:
    if a.handler == "torch":
        return TorchState(a.mb, a.device)
    if a.handler == "none":
        return NoState()
    return NumpyState(a.mb)


def counter(log: EventLog, every_s: float, stop: threading.Event) -> None:
    """Counts and logs each tick: in a frozen process neither happens."""
    n = 0
    while not stop.wait(every_s):
        n += 1
        log("tick", n=n)


async def commands(path: Path, handler: LoggingHandler, queue: asyncio.Queue[str]) -> None:
    """Follow the control file; ``unblock`` is handled at once, the rest goes to the main loop in order."""
    offset, partial = 0, ""
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
        except FileNotFoundError:
            chunk = ""
        partial += chunk
        *lines, partial = partial.split("\n")
        for line in lines:
            cmd = line.strip()
            if cmd == "unblock":
                handler.unblock.set()
            elif cmd:
                await queue.put(cmd)
        await asyncio.sleep(0.01)  # polling a file: the test appends to it


async def run(a: argparse.Namespace, log: EventLog) -> int:
    state = make_state(a)
    handler = LoggingHandler(a, state, log)
    stop = threading.Event()
    client = AsyncTimeSliceClient(
        a.job,
        a.group,
        a.nats_url,
        lease_s=a.lease_seconds,
        acquire_timeout_s=a.acquire_timeout,
        waiter_ttl_s=a.waiter_ttl,
    )
    async with client:
        await client.register_workload(
            handler, node_id=a.node_id, backends=tuple(a.backend.split("+")), mode=a.mode, op_timeout_s=a.op_timeout
        )
        log("ready", job=a.job, pid=os.getpid(), backends=a.backend.split("+"), handler=a.handler, **handler.describe())
        if a.counter_ms > 0:
            threading.Thread(target=counter, args=(log, a.counter_ms / 1000, stop), daemon=True).start()
        queue: asyncio.Queue[str] = asyncio.Queue()
        follower = asyncio.get_running_loop().create_task(commands(Path(a.control_file), handler, queue))
        step = 0
        try:
            while True:
                cmd = await queue.get()
                log("command", cmd=cmd)
                if cmd == "exit":
                    break
                if cmd == "acquire":
                    try:
                        g = await client.acquire(a.acquire_timeout)
                    except Exception as exc:
                        log.failure("acquire", exc)
                        continue
                    log(
                        "granted",
                        epoch=g.epoch,
                        context_restored=g.context_restored,
                        waited_ms=g.waited_ms,
                        **handler.describe(),
                    )
                    step += 1
                    try:
                        await asyncio.to_thread(state.work, step)
                    except Exception as exc:
                        log.failure("work", exc, epoch=g.epoch)
                        continue
                    log(
                        "worked", step=step, epoch=g.epoch, checksum=state.checksum(), device_bytes=state.device_bytes()
                    )
                elif cmd == "release":
                    epoch = client.epoch
                    log("releasing", epoch=epoch, checksum=state.checksum(), device_bytes=state.device_bytes())
                    try:
                        r = await client.release()
                    except Exception as exc:
                        log.failure("release", exc, epoch=epoch)
                        continue
                    log("released", epoch=r.epoch, pending=r.pending_waiters)
                else:
                    log("error", where="command", type="UnknownCommand", msg=cmd)
        finally:
            stop.set()
            follower.cancel()
    log("exited")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    log = EventLog(a.out)
    return log.run(lambda: asyncio.run(run(a, log)))


if __name__ == "__main__":
    sys.exit(main())
