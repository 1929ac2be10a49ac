"""The workload channel answers on a thread of its own (``timeslice_client._channel_thread``): its own event loop and
NATS connection, the handler run right there. The job's event loop stays free while a handler runs, a command
and a suspend begun at the release never run the handler at the same time, and ``close()`` ends the thread."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest
from nats.aio.client import Client as NATS
from timeslice_client import HandlerResult, SuspendMode, Unavailable, WorkloadChannel
from timeslice_client._channel_thread import Responder
from timeslice_client.bus import connect
from timeslice_client.protocol import WorkloadCommand, WorkloadReply, encode, subjects

from .helpers import eventually

NODE = "node-t"
WAIT = 10.0  # bound on every wait for the handler's thread


class _Blocking:
    """A handler that records the thread of each call and holds its suspends until ``go`` is set."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.entered = threading.Event()
        self.go = threading.Event()
        self.running = 0
        self.overlapped = False

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        self.running += 1
        self.overlapped |= self.running > 1
        try:
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            if not self.go.wait(WAIT):
                raise TimeoutError("the test never let the suspend go on")
            return HandlerResult(bytes_moved=3, device_bytes_freed=3)
        finally:
            self.running -= 1

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        self.threads.append(threading.current_thread().name)
        return HandlerResult(bytes_moved=3)


def _encoded(action: str, op: str) -> bytes:
    return encode(WorkloadCommand(op_id=op, action=action, mode=SuspendMode.OFFLOAD, tags=(), epoch=1))  # type: ignore[arg-type]


async def _command(nc: NATS, job: str, action: str, op: str) -> WorkloadReply:
    """What the agent sends: a request on the workload's subject."""
    msg = await nc.request(subjects.workload_rpc(NODE, job), _encoded(action, op), timeout=WAIT)
    return msgspec.json.decode(msg.data, type=WorkloadReply)


def _threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


async def test_a_command_runs_on_the_channels_thread_while_the_jobs_loop_stays_free(nc: NATS) -> None:
    h = _Blocking()
    ch = WorkloadChannel(nc, "j1", "g", h, node_id=NODE)
    await ch._open()
    try:
        suspend = asyncio.create_task(_command(nc, "j1", "suspend", "op-1"))
        # This loop's own wait for the handler: it could not run if the handler held this loop.
        assert await asyncio.to_thread(h.entered.wait, WAIT), "the suspend never reached the handler"
        assert not ch.suspend_early(), "a command holds the state: no early suspend beside it"
        h.go.set()
        reply = await suspend
        assert reply.ok and reply.bytes_moved == 3 and not reply.began_at_release
        assert (await _command(nc, "j1", "resume", "op-2")).ok
        assert (await _command(nc, "j1", "resume", "op-2")).ok, "a retry gets the same answer"
        assert h.threads == ["timeslice-workload-j1"] * 2, "both ran on the channel's thread, the retry did not"
        assert threading.current_thread().name not in h.threads
    finally:
        await ch.close()
    assert not _threads_named("timeslice-workload-j1"), "close() ended the channel's thread"


async def test_a_command_that_comes_during_an_early_suspend_takes_it_once_it_is_done(nc: NATS) -> None:
    h = _Blocking()
    ch = WorkloadChannel(nc, "j2", "g", h, node_id=NODE)
    await ch._open()
    try:
        assert ch.suspend_early()
        assert await asyncio.to_thread(h.entered.wait, WAIT)
        answers = await nc.subscribe(inbox := nc.new_inbox(), max_msgs=1)
        await nc.publish(subjects.workload_rpc(NODE, "j2"), _encoded("suspend", "op-1"), reply=inbox)
        await nc.flush()  # the server has the command while the handler still runs
        h.go.set()
        reply = msgspec.json.decode((await answers.next_msg(timeout=WAIT)).data, type=WorkloadReply)
        assert reply.ok and reply.began_at_release and reply.bytes_moved == 3
        assert h.threads == ["timeslice-workload-j2"] and not h.overlapped and ch.suspended
        assert ch.early_taken == 1 and not await ch.settle(), "taken by the command: nothing to settle"
    finally:
        await ch.close()


async def test_close_waits_for_an_early_suspend_nobody_took_and_is_idempotent(nc: NATS) -> None:
    h = _Blocking()
    ch = WorkloadChannel(nc, "j3", "g", h, node_id=NODE)
    await ch._open()
    assert ch.suspend_early()
    assert await asyncio.to_thread(h.entered.wait, WAIT)
    closing = asyncio.create_task(ch.close())
    await eventually(lambda: ch._closed, what="close() began")
    assert not closing.done(), "close() returned while the handler still ran"
    h.go.set()
    async with asyncio.timeout(WAIT):
        await closing
    await ch.close()
    assert ch.suspended, "an early suspend nobody took is left as it is"
    assert not ch.suspend_early() and await ch.settle() is False
    assert not _threads_named("timeslice-workload-j3")


async def test_a_channel_needs_a_connected_nc_or_a_url(nats_url: str) -> None:
    idle = NATS()  # never connected
    with pytest.raises(Unavailable, match="not connected"):
        await WorkloadChannel(idle, "j4", "g", _Blocking(), node_id=NODE).start()
    assert not _threads_named("timeslice-workload-j4"), "a failed start leaves no thread behind"
    ch = WorkloadChannel(idle, "j4", "g", _Blocking(), node_id=NODE, nats_url=nats_url)
    await ch._open()  # its own connection is made from the URL alone
    await ch.close()
    assert not _threads_named("timeslice-workload-j4")


async def test_a_channel_whose_server_does_not_answer_says_so_and_leaves_no_thread() -> None:
    ch = WorkloadChannel(
        NATS(), "j5", "g", _Blocking(), node_id=NODE, nats_url="nats://127.0.0.1:1", request_timeout_s=0.5
    )
    with pytest.raises(Unavailable, match="cannot connect"):
        await ch.start()
    assert not _threads_named("timeslice-workload-j5")


async def test_responder_runs_coroutines_on_its_thread_and_stops_once() -> None:
    r = Responder("timeslice-test-responder")
    r.start()

    async def where() -> str:
        return threading.current_thread().name

    assert await r.call(where()) == "timeslice-test-responder"
    with pytest.raises(RuntimeError, match="started already"):
        r.start()
    assert await r.stop() and await r.stop()
    coro = where()
    with pytest.raises(RuntimeError, match="not running"):
        r.submit(coro)
    assert not _threads_named("timeslice-test-responder")


async def test_a_job_whose_event_loop_is_blocked_still_answers(nats_url: str, nc: NATS) -> None:
    h = _Blocking()
    h.go.set()
    ch = WorkloadChannel(nc, "j6", "g", h, node_id=NODE)
    await ch._open()
    agent = Responder("timeslice-test-agent")  # the agent's side, on a thread and connection of its own
    agent.start()

    async def ask() -> WorkloadReply:
        conn = await connect(nats_url)
        try:
            return await _command(conn, "j6", "suspend", "op-1")
        finally:
            await conn.close()

    try:
        # Blocks this (the job's) event loop until the answer is in: only the channel's own thread can answer.
        reply = agent.submit(ask()).result(timeout=WAIT)
        assert reply.ok and h.threads == ["timeslice-workload-j6"]
    finally:
        await agent.stop()
        await ch.close()
