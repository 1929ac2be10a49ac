"""Shared by the core tests: constants, small helpers and ``Sim``, a driver of ``apply()``."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
from timeslice_client.protocol import (
    Acquire,
    ControlEvent,
    Granted,
    InputEvent,
    JobEvent,
    JobRegistered,
    Release,
    Renew,
    Restore,
    Snapshot,
    Tick,
    encode,
    subjects,
)
from timeslice_orchestrator.core import Action, Command, Notify, apply, new_record
from timeslice_orchestrator.invariants import check_record

from .op_messages import AgentOp

G = "g"
JOBS = ("a", "b", "c", "d")
NODES = ("n1", "n2")
T0 = 1_000_000
SEQ_GAP = 100  # the state machine's events are SEQ_GAP apart in the stream


# --------------------------------------------------------------------------- helpers


def notices(actions: list[Action], kind: type[Any] | None = None) -> list[Any]:
    out = [a.notice for a in actions if isinstance(a, Notify)]
    return [n for n in out if kind is None or isinstance(n, kind)]


def commands(actions: list[Action]) -> list[Snapshot | Restore]:
    return [a.command for a in actions if isinstance(a, Command)]


def tag(ev: msgspec.Struct) -> str:
    t = type(ev).__struct_config__.tag
    assert isinstance(t, str)
    return t


def input_subject(ev: InputEvent) -> str:
    if isinstance(ev, JobEvent):
        return subjects.job(ev.group, ev.job, tag(ev))
    if isinstance(ev, ControlEvent):
        return subjects.ctl(ev.group, tag(ev))
    return subjects.agent_event(ev.node, ev.group)


def action_message(group: str, a: Action) -> tuple[str, bytes]:
    if isinstance(a, Notify):
        return subjects.notice(group, a.notice.job), encode(a.notice)
    if isinstance(a, Command):
        return subjects.agent_cmd(a.command.node), encode(a.command)
    return subjects.group_state(group), encode(a.change)


def grant_notice(job: str, epoch: int, rid: str, *, restored: bool = False) -> Granted:
    """A grant for the checkers to judge, one no core decided: no wait, no lease (what the checkers do not read)."""
    return Granted(
        group=G, job=job, request_id=rid, epoch=epoch, waited_ms=0, context_restored=restored, lease_deadline_ms=0
    )


class Sim:
    """Drives ``apply()`` by hand for one group: a clock, a sequence, every record checked."""

    def __init__(self, group: str = G) -> None:
        self.group = group
        self.rec = new_record(group)
        self.now = T0
        self.seq = 0
        self.rids = itertools.count(1)
        self.stream: list[tuple[int, int, str, bytes]] = []

    def __call__(self, ev: InputEvent, *, dt: int = 0) -> list[Action]:
        self.now += dt
        self.seq += 1
        self.rec, actions = apply(self.rec, ev, self.now, self.seq)
        check_record(self.rec)
        self.publish(input_subject(ev), encode(ev))
        for a in actions:
            self.publish(*action_message(self.group, a))
        return actions

    def publish(self, subject: str, data: bytes) -> None:
        """Append a message to the stream, now (the core's events and actions, or what a test adds beside them)."""
        self.stream.append((len(self.stream) + 1, self.now, subject, data))

    def rid(self, job: str) -> str:
        return f"{job}-{next(self.rids)}"

    def acquire(self, job: str, rid: str | None = None, *, dt: int = 0, **kw: Any) -> list[Action]:
        return self(Acquire(group=self.group, job=job, request_id=rid or self.rid(job), **kw), dt=dt)

    def release(self, job: str, epoch: int | None = None, *, dt: int = 0) -> list[Action]:
        h = self.rec.holder
        rid = h.request_id if h is not None and h.job == job else self.rid(job)
        if epoch is None:
            assert h is not None
            epoch = h.epoch
        return self(Release(group=self.group, job=job, request_id=rid, epoch=epoch), dt=dt)

    def renew(self, job: str, epoch: int | None = None, *, dt: int = 0) -> list[Action]:
        h = self.rec.holder
        assert h is not None
        return self(
            Renew(group=self.group, job=job, request_id=h.request_id, epoch=h.epoch if epoch is None else epoch), dt=dt
        )

    def register(self, job: str, node: str, *, op_timeout_ms: int = 10_000) -> list[Action]:
        return self(JobRegistered(group=self.group, job=job, node=node, op_timeout_ms=op_timeout_ms))

    def result(self, cmd: Snapshot | Restore, ok: bool = True, *, dt: int = 0, **kw: Any) -> list[Action]:
        """The agent's answer to ``cmd`` (``kw``: more of OpResult's fields, e.g. ``overlapped=True``)."""
        return self(AgentOp.of(cmd).result(ok, error=None if ok else "backend said no", **kw), dt=dt)

    def tick(self, *, dt: int = 0) -> list[Action]:
        return self(Tick(group=self.group), dt=dt)

    def settle(self, actions: list[Action]) -> Granted:
        """Answer every snapshot/restore (successfully) until a grant comes; return it."""
        while not notices(actions, Granted):
            cmds = commands(actions)
            assert cmds, f"neither granted nor switching: {actions}"
            for c in cmds:
                actions = self.result(c)
        (g,) = notices(actions, Granted)
        return g  # type: ignore[no-any-return]

    def hold(self, job: str) -> Granted:
        """``job`` acquires and gets the group (answering any operations), then confirms its grant."""
        g = self.settle(self.acquire(job))
        assert g.job == job
        self.renew(job)
        return g

    @classmethod
    def a_releasing_to_b(cls) -> tuple[Sim, Snapshot, Restore]:
        """A group on node n1 where ``a`` held, ``b`` waited and ``a`` released: the switch's snapshot of a and
        restore of b, sent and unanswered."""
        sim = cls()
        sim.register("a", "n1")
        sim.register("b", "n1")
        sim.hold("a")
        sim.acquire("b")
        snap, restore = commands(sim.release("a"))
        assert isinstance(snap, Snapshot) and isinstance(restore, Restore), (snap, restore)
        return sim, snap, restore
