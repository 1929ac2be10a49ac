"""Constructed ``TIMESLICE`` streams for the replay tests: real wire messages on real subjects, with the
stream sequences and timestamps chosen by the test."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from timeslice_client.protocol import (
    Acquire,
    JobRegistered,
    OpKind,
    Phase,
    Release,
    Tick,
    encode,
    subjects,
)
from timeslice_orchestrator.replay import StreamEvent

from .op_messages import AgentOp

MB = 1024 * 1024


def op_id(group: str, epoch: int, kind: str, node: str) -> str:
    """The op id the core gives the operation (``_work.Work.op``)."""
    return f"{group}:{epoch}:{kind}:{node}"


@dataclass
class StreamBuilder:
    """Messages may be added out of time order; :attr:`events` is the stream: sorted by time (stably),
    numbered from 1."""

    group: str = "g"
    _added: list[tuple[int, str, bytes]] = field(default_factory=list)

    @property
    def events(self) -> list[StreamEvent]:
        ordered = sorted(self._added, key=lambda m: m[0])
        return [StreamEvent(seq=i, ts_ms=ts, subject=s, data=d) for i, (ts, s, d) in enumerate(ordered, 1)]

    def add(self, ts: int, subject: str, msg: msgspec.Struct) -> None:
        self._added.append((ts, subject, encode(msg)))

    def register(self, ts: int, job: str, node: str) -> None:
        self.add(ts, subjects.agent_event(node, self.group), JobRegistered(group=self.group, job=job, node=node))

    def acquire(self, ts: int, job: str, rid: str, **kw: int) -> None:
        self.add(ts, subjects.job(self.group, job, "acquire"), Acquire(group=self.group, job=job, request_id=rid, **kw))

    def release(self, ts: int, job: str, rid: str, epoch: int) -> None:
        self.add(
            ts,
            subjects.job(self.group, job, "release"),
            Release(group=self.group, job=job, request_id=rid, epoch=epoch),
        )

    def tick(self, ts: int) -> None:
        self.add(ts, subjects.ctl(self.group, "tick"), Tick(group=self.group))

    def phase(self, ts: int, job: str, name: str, edge: str) -> None:
        self.add(
            ts,
            subjects.job(self.group, job, "phase"),
            Phase(group=self.group, job=job, name=name, edge="start" if edge == "start" else "end"),
        )

    def op(
        self,
        start: int,
        end: int,
        node: str,
        job: str,
        kind: str,
        epoch: int,
        *,
        ok: bool = True,
        nbytes: int = 0,
        error: str | None = None,
        overlapped: bool = False,
    ) -> None:
        """The agent's OpStarted at ``start`` and its OpResult at ``end`` (elapsed = end - start)."""
        op = AgentOp(self.group, op_id(self.group, epoch, kind, node), node, job, OpKind(kind), epoch)
        self.add(start, subjects.agent_op(node), op.started(backend="app_channel", overlapped=overlapped))
        elapsed_ms = float(end - start)
        result = op.result(
            ok, error=error, backend="app_channel", bytes_moved=nbytes, device_bytes_freed=nbytes, elapsed_ms=elapsed_ms
        )
        self.add(end, subjects.agent_event(node, self.group), result)


@dataclass(frozen=True)
class Expected:
    holds: list[tuple[str, int, int, int | None]]  # job, epoch, start, end
    end_ms: int


def alternating(
    rounds: int,
    *,
    group: str = "g",
    node: str = "n1",
    t0: int = 1_000_000,
    nbytes: int = 256 * MB,
    overlap: bool = False,
) -> tuple[list[StreamEvent], Expected]:
    """Jobs a and b on one node take turns ``rounds`` times: the holder trains while the other queues, then
    releases; the core snapshots the holder and restores the other. Returns the stream and the holds.
    ``overlap``: from the second switch on, the restore runs beside the snapshot (10-60 ms into the switch,
    the snapshot 5-85 ms), as an agent with room on the node does."""
    b = StreamBuilder(group)
    t = t0
    b.register(t, "a", node)
    b.register(t, "b", node)
    t += 100
    b.acquire(t, "a", "a-0")
    b.op(t + 5, t + 45, node, "a", "restore", 1)  # a never ran: IDLE -> RUNNING, nothing to move
    t += 45
    holds: list[tuple[str, int, int, int | None]] = []
    holder, other, rid, epoch, start = "a", "b", "a-0", 1, t
    for r in range(rounds):
        b.phase(t + 1, holder, "train", "start")
        b.acquire(t + 300, other, f"{other}-{r}")
        b.phase(t + 800, holder, "train", "end")
        t += 810
        b.release(t, holder, rid, epoch)
        holds.append((holder, epoch, start, t))
        b.phase(t + 1, holder, "reward", "start")
        epoch += 1
        b.op(t + 5, t + 85, node, holder, "snapshot", epoch, nbytes=nbytes)
        if overlap and r:
            b.op(t + 10, t + 60, node, other, "restore", epoch, nbytes=nbytes, overlapped=True)
        else:
            b.op(t + 88, t + 148, node, other, "restore", epoch, nbytes=nbytes if r else 0)
        b.phase(t + 400, holder, "reward", "end")
        t += 85 if overlap and r else 148
        holder, other, rid, start = other, holder, f"{other}-{r}", t
    t += 300
    b.release(t, holder, rid, epoch)
    holds.append((holder, epoch, start, t))
    return b.events, Expected(holds=holds, end_ms=t)
