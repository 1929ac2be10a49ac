"""What the agents' own facts in the stream say about contexts on a node, for ``invariants.StreamChecker``.

The agents publish ``OpStarted`` when an operation starts and ``OpResult`` when it ends. From those alone (and from
which operations the fold's records show the core waiting for) this checks, per group and node:

* ``node-restore-after-snapshot``: a restore starts only once the snapshots of its switch there ended, or beside
  them saying so (``OpStarted.overlapped``, the agent's room rule);
* ``restore-after-trailing``: a restore never starts while a snapshot of an earlier switch that the core still waits
  for runs there (that would be a third context on the device: a snapshot trailing a grant on restore, the holder's
  context, the incoming one);
* ``grant-beside-restore``: a new grant comes only once the core's snapshots of other jobs ended, but for a grant
  on restore: a snapshot of the same switch may still run on a node where the grantee's restore ran beside it and
  succeeded (``OpResult.overlapped``).

A snapshot counts until its answer, its node's ``AgentLost`` or a ``JobUnregistered`` there, or until the core
stops waiting for it (its deadline passed: its job is faulted, its state unknown; the core's rule). A snapshot that
starts again after it ended ``ok`` (a restarted agent runs again an operation whose settled state it had not stored
yet; the workload answers the repeated op id with its first outcome) does not count: its context left the device at
the first end.
"""

from __future__ import annotations

import collections
from typing import Final

from timeslice_client.protocol import (
    AgentLost,
    Granted,
    GroupRecord,
    InputEvent,
    JobUnregistered,
    OpKind,
    OpRecord,
    OpResult,
    OpStarted,
)

from ._errors import InvariantViolation

__all__ = ["OpFacts", "pending_ops"]

_Key = tuple[str, str, int]  # (node, group, epoch)
MAX_ENDED_OK: Final = 65_536  # snapshot op ids remembered as ended ok (a restarted agent's run again of one)


def pending_ops(rec: GroupRecord | None) -> tuple[OpRecord, ...]:
    """The operations ``rec`` shows the core waiting for: its switch's, or the snapshots trailing its last grant."""
    if rec is None:
        return ()
    return (rec.switch.ops if rec.switch is not None else ()) + (rec.trailing.ops if rec.trailing is not None else ())


class OpFacts:
    """Snapshots running per the stream and restores that ended beside them; feed it in stream order."""

    def __init__(self) -> None:
        self._snapshots: dict[_Key, set[str]] = {}  # started, not ended: op ids
        self._issued: dict[str, str] = {}  # of those, the ones the core issued (and waits for): op id -> job
        # (node, group) -> (epoch, job) of the latest restore there that succeeded beside its switch's snapshots.
        # Kept apart from the running snapshots: the agent may publish a snapshot's OpStarted after the OpResult of
        # the restore beside it (it starts both at once), and a restarted agent begins the same snapshot again.
        self._beside: dict[tuple[str, str], tuple[int, str]] = {}
        self._ended_ok: collections.OrderedDict[str, None] = collections.OrderedDict()  # snapshots, newest last

    def started(self, op: OpStarted, seq: int, rec: GroupRecord | None) -> None:
        """An ``OpStarted``; ``rec`` is the fold's record of its group at that point of the stream."""
        key = (op.node, op.group, op.epoch)
        if op.kind is OpKind.SNAPSHOT:
            if op.op_id in self._ended_ok:
                return  # run again after an agent restart: its context left the device when it first ended ok
            self._snapshots.setdefault(key, set()).add(op.op_id)
            if any(o.op_id == op.op_id for o in pending_ops(rec)):
                self._issued[op.op_id] = op.job
            return
        running = self._snapshots.get(key)
        if not op.overlapped and running:
            # An overlapped restore says the node had room for both contexts.
            raise InvariantViolation(
                "node-restore-after-snapshot",
                "on a node, a restore starts only after its switch's snapshots there ended "
                "(or beside them, saying so: overlapped)",
                group=op.group,
                seq=seq,
                values={"restore": op, "snapshots_running": sorted(running)},
            )
        older = sorted(
            i
            for (node, group, epoch), ids in self._snapshots.items()
            if (node, group) == (op.node, op.group) and epoch < op.epoch
            for i in ids
            if i in self._issued
        )
        if older:
            raise InvariantViolation(
                "restore-after-trailing",
                "a restore never starts on a node while a snapshot of an earlier switch still "
                "runs there (never three contexts on a device)",
                group=op.group,
                seq=seq,
                values={"restore": op, "snapshots_running": older},
            )

    def ended(self, ev: InputEvent) -> None:
        """An input event, before the fold applies it."""
        if isinstance(ev, OpResult):
            key = (ev.node, ev.group, ev.epoch)
            self._end(key, ev.op_id)
            if ev.kind is OpKind.SNAPSHOT and ev.ok:
                self._ended_ok[ev.op_id] = None
                self._ended_ok.move_to_end(ev.op_id)
                while len(self._ended_ok) > MAX_ENDED_OK:
                    self._ended_ok.popitem(last=False)
            if ev.kind is OpKind.RESTORE and ev.ok and ev.overlapped:
                self._beside[(ev.node, ev.group)] = (ev.epoch, ev.job)
        elif isinstance(ev, AgentLost | JobUnregistered):  # its context is gone, or nobody can say any more
            for key in [k for k in self._snapshots if k[0] == ev.node and k[1] == ev.group]:
                for op_id in sorted(self._snapshots[key]):
                    self._end(key, op_id)

    def _end(self, key: _Key, op_id: str) -> None:
        running = self._snapshots.get(key)
        if running is None:
            return
        running.discard(op_id)
        self._issued.pop(op_id, None)
        if not running:
            del self._snapshots[key]

    def core_ended(self, before: GroupRecord, after: GroupRecord) -> None:
        """The fold applied an event: the core's operations that left its records without an answer (a deadline)
        are no longer waited for."""
        gone = {o.op_id for o in pending_ops(before)} - {o.op_id for o in pending_ops(after)}
        for op_id in sorted(gone & self._issued.keys()):
            for key in [k for k, ids in self._snapshots.items() if k[1] == after.group and op_id in ids]:
                self._end(key, op_id)

    def granted(self, n: Granted, seq: int) -> None:
        """A new grant the fold decided: no snapshot of another job that the core issued still runs, but beside
        the grantee's restore of that snapshot's switch (a grant on restore, or the same job's next grant)."""
        for (node, group, epoch), ids in sorted(self._snapshots.items()):
            if group != n.group:
                continue
            for op_id in sorted(ids):
                job = self._issued.get(op_id)
                if job is None or job == n.job or self._beside.get((node, group)) == (epoch, n.job):
                    continue
                raise InvariantViolation(
                    "grant-beside-restore",
                    "a new grant comes only once the snapshots of other jobs ended, but beside one of the same switch "
                    "on a node where the grantee's restore ran beside it (the agent's room rule) and succeeded",
                    group=group,
                    seq=seq,
                    values={
                        "granted": n,
                        "snapshot": op_id,
                        "snapshot_job": job,
                        "node": node,
                        "snapshot_epoch": epoch,
                    },
                )
