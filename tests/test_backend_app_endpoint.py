"""The ``app_endpoint`` backend against small local HTTP servers that speak vLLM's and SGLang's sleep APIs,
and through the real agent and orchestrator."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

import pytest
from timeslice_agent import Agent, AgentConfig, AppEndpointBackend, BackendError, OpContext
from timeslice_agent._app_endpoint import HttpError, http_post, parse_endpoint
from timeslice_client import AsyncTimeSliceClient, HandlerResult, JobState, SuspendMode
from timeslice_client.errors import TimeSliceError
from timeslice_client.protocol import JobContext

from .helpers import eventually, group_record, loopback_url, running


@dataclass
class Engine:
    """A serving engine's memory API on a real socket: ``vllm`` (``/sleep``, ``/wake_up``, ``/is_sleeping``;
    404 unless ``dev_mode``) or ``sglang`` (``/release_memory_occupation``, ``/resume_memory_occupation``)."""

    app: str
    dev_mode: bool = True
    fail_with: int | None = None  # answer every sleep request with this status
    hang_sleep: bool = False  # never answer a sleep request (but do go to sleep)
    chunked: bool = False
    asleep: bool = False
    requests: list[tuple[str, str, dict[str, list[str]], object]] = field(default_factory=list)
    server: asyncio.Server | None = None

    def sleeping(self) -> bool:
        return self.asleep

    @property
    def url(self) -> str:
        return loopback_url(self.server, f"{self.app}+http")

    async def __aenter__(self) -> Engine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
            method, target, _ = head[0].split(" ")
            headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
            raw = await reader.readexactly(int(headers.get("content-length", "0")))
            url = urlsplit(target)
            body = json.loads(raw) if raw else None
            self.requests.append((method, url.path, parse_qs(url.query), body))
            status, payload = self._route(method, url.path, parse_qs(url.query))
            if status == 0:  # hang: the client's timeout must end it
                await reader.read()
                return
            writer.write(self._response(status, payload))
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def _route(self, method: str, path: str, query: dict[str, list[str]]) -> tuple[int, bytes]:
        sleep, wake = (
            ("/sleep", "/wake_up")
            if self.app == "vllm"
            else ("/release_memory_occupation", "/resume_memory_occupation")
        )
        if self.app == "vllm" and not self.dev_mode:
            return 404, b'{"detail":"Not Found"}'
        if path == sleep and method == "POST":
            if self.fail_with is not None:
                return self.fail_with, b'{"detail":"engine is busy"}'
            self.asleep = True
            return (0, b"") if self.hang_sleep else (200, b"")
        if path == wake and method == "POST":
            self.asleep = False
            return 200, b""
        if path == "/is_sleeping":
            return 200, json.dumps({"is_sleeping": self.asleep}).encode()
        return 404, b'{"detail":"Not Found"}'

    def _response(self, status: int, payload: bytes) -> bytes:
        reason = {200: "OK", 404: "Not Found"}.get(status, "Error")
        if self.chunked:
            body = (f"{len(payload):x}\r\n".encode() + payload + b"\r\n" if payload else b"") + b"0\r\n\r\n"
            return f"HTTP/1.1 {status} {reason}\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + body
        return f"HTTP/1.1 {status} {reason}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload


def ctx(*endpoints: str, mode: SuspendMode = SuspendMode.OFFLOAD, tags: tuple[str, ...] = ()) -> JobContext:
    return JobContext(
        node="n1",
        job="vllm-job",
        group="g",
        state=JobState.RUNNING,
        backends=("app_endpoint",),
        endpoints=endpoints,
        mode=mode,
        tags=tags,
    )


def op(seconds: float = 5.0) -> OpContext:
    return OpContext(op_id="op", epoch=1, deadline=time.monotonic() + seconds)


def calls(engine: Engine) -> list[tuple[str, dict[str, list[str]], object]]:
    return [(path, query, body) for _, path, query, body in engine.requests]


async def test_vllm_sleep_levels_and_wake_up_tags() -> None:
    be = AppEndpointBackend()
    async with Engine("vllm") as e:
        await be.snapshot(ctx(e.url), op())
        assert e.sleeping() and calls(e) == [("/sleep", {"level": ["1"]}, None)]
        await be.restore(ctx(e.url), op())
        assert not e.sleeping() and calls(e)[-1] == ("/wake_up", {}, None)
        await be.snapshot(ctx(e.url, mode=SuspendMode.DISCARD, tags=("weights", "kv_cache")), op())
        await be.restore(ctx(e.url, mode=SuspendMode.DISCARD, tags=("weights", "kv_cache")), op())
        assert calls(e)[-2:] == [
            ("/sleep", {"level": ["2"]}, None),
            ("/wake_up", {"tags": ["weights", "kv_cache"]}, None),
        ]


async def test_sglang_release_and_resume_with_tags() -> None:
    be = AppEndpointBackend()
    async with Engine("sglang", chunked=True) as e:
        await be.snapshot(ctx(e.url, tags=("kv_cache",)), op())
        assert e.sleeping()
        await be.restore(ctx(e.url, tags=("kv_cache",)), op())
        await be.snapshot(ctx(e.url), op())
        assert calls(e) == [
            ("/release_memory_occupation", {}, {"tags": ["kv_cache"]}),
            ("/resume_memory_occupation", {}, {"tags": ["kv_cache"]}),
            ("/release_memory_occupation", {}, {}),
        ]


async def test_vllm_without_sleep_mode_says_how_to_start_it() -> None:
    async with Engine("vllm", dev_mode=False) as e:
        with pytest.raises(BackendError) as err:
            await AppEndpointBackend().snapshot(ctx(e.url), op())
    text = str(err.value)
    assert err.value.rolled_back is True
    assert "HTTP 404" in text and "--enable-sleep-mode" in text and "VLLM_SERVER_DEV_MODE=1" in text
    assert "POST /sleep?level=1" in text and "vllm-job" in text


async def test_a_snapshot_that_times_out_wakes_the_server_again() -> None:
    async with Engine("vllm", hang_sleep=True) as e:
        with pytest.raises(BackendError) as err:
            await AppEndpointBackend().snapshot(ctx(e.url), op(seconds=0.3))
        assert "no answer within" in str(err.value) and "woke" in str(err.value)
        assert err.value.rolled_back is True and not e.sleeping()
        assert [p for p, _, _ in calls(e)] == ["/sleep", "/wake_up"]


async def test_one_failing_server_of_a_job_wakes_the_others() -> None:
    async with Engine("vllm") as ok, Engine("sglang", fail_with=503) as bad:
        with pytest.raises(BackendError) as err:
            await AppEndpointBackend().snapshot(ctx(ok.url, bad.url), op())
        assert err.value.rolled_back is True
        assert "HTTP 503" in str(err.value) and "engine is busy" in str(err.value)
        assert not ok.sleeping() and [p for p, _, _ in calls(ok)] == ["/sleep", "/wake_up"]
        assert [p for p, _, _ in calls(bad)] == ["/release_memory_occupation"]  # it never slept


async def test_an_unreachable_server_is_a_clear_error() -> None:
    async with Engine("vllm") as e:
        url = e.url
    with pytest.raises(BackendError) as err:
        await AppEndpointBackend().snapshot(ctx(url), op())
    assert url.removeprefix("vllm+") in str(err.value) and "Connect" in str(err.value)
    with pytest.raises(BackendError) as err:
        await AppEndpointBackend().restore(ctx(url), op())
    assert err.value.rolled_back is False


async def test_http_client_bounds_and_parses() -> None:
    async with Engine("vllm", hang_sleep=True) as e:
        port = parse_endpoint(e.url).port
        resp = await http_post("127.0.0.1", port, "/is_sleeping", None, timeout=2)
        assert resp.status == 200 and json.loads(resp.body) == {"is_sleeping": False}
        with pytest.raises(HttpError) as err:
            await http_post("127.0.0.1", port, "/sleep?level=1", None, timeout=0.2)
        assert err.value.timed_out


@pytest.mark.parametrize("spec", ["http://127.0.0.1:8000", "triton+http://h:1", "vllm+https://h:1", "vllm+h:1"])
def test_malformed_endpoints_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match=r"vllm\+http|plain http"):
        parse_endpoint(spec)


def test_endpoint_with_a_path_prefix() -> None:
    ep = parse_endpoint("sglang+http://10.0.0.2:30000/engine/")
    assert (ep.app, ep.host, ep.port, ep.base_path) == ("sglang", "10.0.0.2", 30000, "/engine")


# --------------------------------------------------------------------------- through the agent


class Untouched:
    """The workload's own handler: never called for an app_endpoint job."""

    def __init__(self) -> None:
        self.calls = 0

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        self.calls += 1
        return HandlerResult()

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        self.calls += 1
        return HandlerResult()


@pytest.fixture
async def agent(nats_url: str) -> AsyncIterator[Agent]:
    async with running(Agent(AgentConfig(node_id="n1", nats_url=nats_url))) as a:
        yield a


@pytest.mark.usefixtures("orchestrator")
async def test_switching_jobs_puts_the_vllm_server_to_sleep_and_wakes_it(nats_url: str, agent: Agent) -> None:
    handler = Untouched()
    async with (
        Engine("vllm") as engine,
        AsyncTimeSliceClient("gen", "ge", nats_url) as gen,
        AsyncTimeSliceClient("train", "ge", nats_url) as train,
    ):
        await gen.register_workload(
            handler, node_id="n1", backends=("app_endpoint",), endpoints=(engine.url,), tags=("weights", "kv_cache")
        )
        await train.register_workload(Untouched(), node_id="n1", backends=("noop",))
        await gen.acquire(timeout=10)
        t = asyncio.create_task(train.acquire(timeout=10))
        await eventually(lambda: _queued(gen, "train"))
        await gen.release()
        await t
        assert engine.sleeping() and agent.jobs()["gen"].state is JobState.SAVED
        g = asyncio.create_task(gen.acquire(timeout=10))
        await eventually(lambda: _queued(train, "gen"))
        await train.release()
        grant = await g
        assert grant.context_restored and not engine.sleeping()
        assert calls(engine) == [
            ("/sleep", {"level": ["1"]}, None),
            ("/wake_up", {"tags": ["weights", "kv_cache"]}, None),
        ]
        # the agent marks the job running once its own bookkeeping of the restore is stored, which may come a moment
        # after the grant it made possible
        await eventually(lambda: agent.jobs()["gen"].state is JobState.RUNNING)
        assert handler.calls == 0
        await gen.release()


async def test_registration_with_bad_endpoints_is_refused(nats_url: str, agent: Agent) -> None:
    async with AsyncTimeSliceClient("gen", "ge", nats_url) as gen:
        with pytest.raises(TimeSliceError, match=r"vllm\+http://"):
            await gen.register_workload(
                Untouched(), node_id="n1", backends=("app_endpoint",), endpoints=("http://127.0.0.1:8000",)
            )
        with pytest.raises(TimeSliceError, match="needs the job's endpoints"):
            await gen.register_workload(Untouched(), node_id="n1", backends=("app_endpoint",))
    assert "gen" not in agent.jobs()


async def _queued(c: AsyncTimeSliceClient, job: str):  # type: ignore[no-untyped-def]
    rec = await group_record(c)
    return rec if job in [w.job for w in rec.queue] else None


async def test_grpc_snapshot_agent_service_drives_an_sglang_server(nats_url: str, agent: Agent) -> None:
    """``SnapshotAgentService`` with ``AppEndpointConfig`` (app and plain URLs) reaches the server."""
    from timeslice_client.agent_client import AppEndpoint, AsyncSnapshotAgentClient

    from .grpc_helpers import shim_target

    async with (
        shim_target(agent) as target,
        Engine("sglang") as engine,
        AsyncTimeSliceClient("gen", "ge", nats_url) as gen,
        AsyncSnapshotAgentClient(target, timeout=5, wait_timeout_s=20) as c,
    ):
        await gen.register_workload(Untouched(), node_id="n1", backends=("noop",))
        url = engine.url.removeprefix("sglang+")
        op = await c.snapshot_and_wait("gen", backend=AppEndpoint(app="sglang", endpoints=[url], tags=("kv_cache",)))
        assert op.ok, op.error
        assert engine.sleeping() and agent.jobs()["gen"].endpoints == (f"sglang+{url}",)
        op = await c.restore_and_wait("gen")
        assert op.ok and not engine.sleeping()
        assert calls(engine) == [
            ("/release_memory_occupation", {}, {"tags": ["kv_cache"]}),
            ("/resume_memory_occupation", {}, {"tags": ["kv_cache"]}),
        ]


async def test_a_standalone_vllm_snapshot_of_a_job_the_agent_never_saw(nats_url: str, agent: Agent) -> None:
    """The reference guide's standalone example: ``Snapshot`` with an ``AppEndpointConfig`` for a job that never
    registered puts the vLLM server to sleep, and ``Restore`` wakes it (it used to fail with FAILED_PRECONDITION)."""
    from timeslice_client.agent_client import AppEndpoint, AsyncSnapshotAgentClient

    from .grpc_helpers import shim_target

    async with (
        shim_target(agent) as target,
        Engine("vllm") as engine,
        AsyncSnapshotAgentClient(target, timeout=5, wait_timeout_s=20) as c,
    ):
        assert "serve" not in agent.jobs()
        url = engine.url.removeprefix("vllm+")
        op = await c.snapshot_and_wait("serve", backend=AppEndpoint(app="vllm", endpoints=[url]))
        assert op.ok, op.error
        assert engine.sleeping() and agent.jobs()["serve"].endpoints == (f"vllm+{url}",)
        op = await c.restore_and_wait("serve")
        assert op.ok and not engine.sleeping()
