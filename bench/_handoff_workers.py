"""The worker processes of ``bench/handoff.py`` (``python bench/handoff.py --role ROLE ...``): the jobs that ping-pong
or re-acquire a group through the async, blocking and gRPC clients, and the raw NATS, JetStream and gRPC requesters
and responders of its baselines. Each writes what it timed (CLOCK_MONOTONIC, ns) as JSON to ``--out``."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from _common import blocking_timed_cycles, loop_run, push_consumer, timed_cycles


async def _pingpong(url: str, group: str, job: str, n: int, gap: float, out: str) -> None:
    from timeslice_client import AsyncTimeSliceClient

    rows: list[tuple[str, int, int]] = []
    async with AsyncTimeSliceClient(job, group, url, lease_s=30) as c:
        rows.append(("c", 0, time.process_time_ns()))  # this process's CPU, connected: its start left out
        for _ in range(n):
            g = await c.acquire(timeout=60)
            rows.append(("g", g.epoch, time.monotonic_ns()))
            await asyncio.sleep(gap)  # the idle gap before the release
            rows.append(("r", g.epoch, time.monotonic_ns()))
            await c.release()
        rows.append(("c", 1, time.process_time_ns()))
    Path(out).write_text(json.dumps(rows))


async def _reacquire(url: str, group: str, n: int, gap: float, out: str, plain: bool) -> None:
    from timeslice_client import AsyncTimeSliceClient

    async with AsyncTimeSliceClient("solo", group, url, fast_reacquire=not plain) as c:
        cycles = await timed_cycles(c, n, gap)
    Path(out).write_text(json.dumps([acquire_ns for acquire_ns, _ in cycles]))


def _pingpong_sync(url: str, group: str, job: str, n: int, gap: float, out: str) -> None:
    """``_pingpong`` through the blocking ``TimeSliceClient``."""
    from timeslice_client import TimeSliceClient

    rows: list[tuple[str, int, int]] = []
    with TimeSliceClient(job, group, url, lease_s=30) as c:
        for _ in range(n):
            g = c.acquire(timeout=60)
            rows.append(("g", g.epoch, time.monotonic_ns()))
            time.sleep(gap)  # the idle gap before the release
            rows.append(("r", g.epoch, time.monotonic_ns()))
            c.release()
    Path(out).write_text(json.dumps(rows))


def _reacquire_sync(url: str, group: str, n: int, gap: float, out: str) -> None:
    """``_reacquire`` (claims on) through the blocking ``TimeSliceClient``."""
    from timeslice_client import TimeSliceClient

    with TimeSliceClient("solo-sync", group, url) as c:
        cycles = blocking_timed_cycles(c, n, gap)
    Path(out).write_text(json.dumps([acquire_ns for acquire_ns, _ in cycles]))


async def _responder(url: str, ready: str) -> None:
    from timeslice_client.bus import connect

    nc = await connect(url)

    async def cb(msg: Any) -> None:
        await msg.respond(msg.data)

    await nc.subscribe("bench.echo", cb=cb)
    await asyncio.sleep(0)
    await nc.flush()
    Path(ready).write_text("ok")
    await asyncio.Event().wait()


_FLOOR_STREAM = "BENCH_FLOOR"
_FLOOR_IN, _FLOOR_OUT = "bench.floor.in", "bench.floor.out"


async def _js_responder(url: str, ready: str) -> None:
    from nats.js.api import StreamConfig
    from timeslice_client.bus import connect

    nc = await connect(url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=_FLOOR_STREAM, subjects=["bench.floor.>"]))  # file storage, as TIMESLICE

    async def cb(msg: Any) -> None:
        await nc.publish(_FLOOR_OUT, msg.data)
        await msg.ack()

    await push_consumer(nc, js, _FLOOR_STREAM, "floor", _FLOOR_IN, cb)
    Path(ready).write_text("ok")
    await asyncio.Event().wait()


async def _js_requester(url: str, n: int, gap: float, out: str) -> None:
    from timeslice_client.bus import connect

    nc = await connect(url)
    js = nc.jetstream()
    answer: asyncio.Future[None] | None = None

    async def cb(msg: Any) -> None:
        if answer is not None and not answer.done():
            answer.set_result(None)

    await nc.subscribe(_FLOOR_OUT, cb=cb)
    await asyncio.sleep(0)  # else flush() after subscribe() is no barrier (docs/nats.md)
    await nc.flush()
    lat: list[tuple[int, int]] = []  # (until the PubAck, until the answer)
    for _ in range(n):
        await asyncio.sleep(gap)
        answer = asyncio.get_running_loop().create_future()
        t0 = time.monotonic_ns()
        await js.publish(_FLOOR_IN, b"x" * 200, timeout=5)
        t1 = time.monotonic_ns()
        await asyncio.wait_for(answer, 5)
        lat.append((t1 - t0, time.monotonic_ns() - t0))
    await nc.close()
    Path(out).write_text(json.dumps(lat))


async def _requester(url: str, n: int, gap: float, out: str) -> None:
    from timeslice_client.bus import connect

    nc = await connect(url)
    lat: list[int] = []
    for _ in range(n):
        await asyncio.sleep(gap)
        t0 = time.monotonic_ns()
        await nc.request("bench.echo", b"x" * 200, timeout=5)
        lat.append(time.monotonic_ns() - t0)
    await nc.close()
    Path(out).write_text(json.dumps(lat))


def _grpc_calls(target: str) -> tuple[Any, Any, Any]:
    import grpc
    from timeslice_client._grpc import timeslice_orchestrator_pb2 as pb

    ch = grpc.insecure_channel(target)
    svc = "/timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService"
    acquire = ch.unary_unary(
        f"{svc}/Acquire",
        request_serializer=pb.AcquireRequest.SerializeToString,
        response_deserializer=pb.AcquireResponse.FromString,
    )
    yield_ = ch.unary_unary(
        f"{svc}/Yield",
        request_serializer=pb.YieldRequest.SerializeToString,
        response_deserializer=pb.YieldResponse.FromString,
    )
    return ch, acquire, yield_


def _grpc_pingpong(target: str, group: str, job: str, n: int, gap: float, out: str) -> None:
    from timeslice_client._grpc import timeslice_orchestrator_pb2 as pb

    ch, acquire, yield_ = _grpc_calls(target)
    rows: list[tuple[str, str, int]] = []
    for _ in range(n):
        acquire(pb.AcquireRequest(job_id=job, group_id=group), timeout=60)
        rows.append(("g", job, time.monotonic_ns()))
        time.sleep(gap)  # the idle gap before the yield
        rows.append(("r", job, time.monotonic_ns()))
        yield_(pb.YieldRequest(job_id=job, group_id=group), timeout=60)
    ch.close()
    Path(out).write_text(json.dumps(rows))


def _grpc_requester(target: str, n: int, gap: float, out: str) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        check = health_pb2_grpc.HealthStub(ch).Check  # type: ignore[attr-defined]  # generated at runtime
        lat: list[int] = []
        for _ in range(n):
            time.sleep(gap)
            t0 = time.monotonic_ns()
            check(health_pb2.HealthCheckRequest(), timeout=5)
            lat.append(time.monotonic_ns() - t0)
    Path(out).write_text(json.dumps(lat))


def run_role(a: argparse.Namespace) -> None:
    """Be the worker ``a.role`` names, with the arguments the driver gave it."""
    if a.role == "pingpong":
        loop_run(_pingpong(a.url, a.group, a.job, a.n, a.gap, a.out))
    elif a.role == "pingpong-sync":
        _pingpong_sync(a.url, a.group, a.job, a.n, a.gap, a.out)
    elif a.role == "reacquire-sync":
        _reacquire_sync(a.url, a.group, a.n, a.gap, a.out)
    elif a.role in ("reacquire", "reacquire-plain"):
        loop_run(_reacquire(a.url, a.group, a.n, a.gap, a.out, a.role == "reacquire-plain"))
    elif a.role == "responder":
        loop_run(_responder(a.url, a.out))
    elif a.role == "requester":
        loop_run(_requester(a.url, a.n, a.gap, a.out))
    elif a.role == "js-responder":
        loop_run(_js_responder(a.url, a.out))
    elif a.role == "js-requester":
        loop_run(_js_requester(a.url, a.n, a.gap, a.out))
    elif a.role == "grpc-pingpong":
        _grpc_pingpong(a.url, a.group, a.job, a.n, a.gap, a.out)
    elif a.role == "grpc-requester":
        _grpc_requester(a.url, a.n, a.gap, a.out)
    else:
        raise SystemExit(f"unknown --role {a.role!r}")
