"""Which processes a job may have the agent act on, checked with ``/proc`` (a root of its own in tests).

A registration proven through the agent's socket (``_peer``) names its owner: the process that connected, with
the pid, uid and gid the kernel gave (``SO_PEERCRED``). The registration's processes are then accepted only when
each pid is the owner or one of its descendants, and the process group (``pgid``) is the owner's own group or a
group whose every member is the owner or a descendant; every one of those processes must run as the owner's uid
(real, effective and saved), or a uid the agent was configured to allow. Never pid <= 1, the agent itself or its
process group (``_untrusted.check_processes``).

Right before a process-level backend acts (``verify``), the same processes are checked again: each registered pid
is still the process that was registered (its start time, so a reused pid number is refused), the group's leader
too, and every process the operation touches still runs as an allowed uid (an exec of a setuid program changes
that). ``may_act`` is that last check for one pid: the ``cuda`` backend asks it of each process it discovered.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
from timeslice_client.protocol import JobContext, ProcessOwner

from ._untrusted import Refusal, Refused

__all__ = ["Peer", "ProcFS", "ProcessGuard", "Stat"]

_MAX_DEPTH = 4096  # ancestors walked up from a pid (a loop in a fake /proc ends there too)


@dataclass(frozen=True, slots=True)
class Stat:
    ppid: int
    pgrp: int
    start: int  # clock ticks after boot


@dataclass(frozen=True, slots=True)
class Peer:
    """Who connected to the agent's socket: the kernel's credentials, the start time the agent read for that pid
    then, and the pid the caller says it has in its own pid namespace."""

    pid: int
    uid: int
    gid: int
    start: int
    own_pid: int


class ProcFS:
    """Reads ``<root>/<pid>/stat`` and ``status``; None (or nothing) for a process that is gone."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root

    def stat(self, pid: int) -> Stat | None:
        try:
            with open(f"{self.root}/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return Stat(ppid=int(fields[1]), pgrp=int(fields[2]), start=int(fields[19]))
        except (OSError, IndexError, ValueError):
            return None

    def status(self, pid: int, key: str) -> tuple[int, ...] | None:
        """The numbers of one line of ``status`` (``Uid``: real, effective, saved, fs; ``NSpid``; ``NSpgid``)."""
        try:
            with open(f"{self.root}/{pid}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    name, _, rest = line.partition(":")
                    if name == key:
                        return tuple(int(v) for v in rest.split())
        except (OSError, ValueError):
            return None
        return None

    def pid_ns(self, pid: int) -> str | None:
        try:
            return os.readlink(f"{self.root}/{pid}/ns/pid")
        except OSError:
            return None

    def all_stats(self) -> dict[int, Stat]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return {}
        out = {}
        for name in names:
            if name.isdigit() and (st := self.stat(int(name))) is not None:
                out[int(name)] = st
        return out


class ProcessGuard:
    """The agent's rules for the processes of jobs (see the module doc). ``allowed_uids``: uids a job's processes
    may run as besides its owner's; ``any_uid``: every uid (``--allow-other-uids``)."""

    def __init__(
        self,
        *,
        proc: ProcFS | None = None,
        allowed_uids: Iterable[int] = (),
        any_uid: bool = False,
        own_pid: int | None = None,
        own_pgid: int | None = None,
    ) -> None:
        self.proc = proc or ProcFS()
        self.allowed_uids = frozenset(allowed_uids)
        self.any_uid = any_uid
        self.own_pid = os.getpid() if own_pid is None else own_pid
        self.own_pgid = os.getpgid(0) if own_pgid is None else own_pgid

    def peer(self, pid: int, uid: int, gid: int, own_pid: int) -> Peer:
        """The socket's peer, with its start time read now (Refused when it is not a process the agent can see)."""
        st = self.proc.stat(pid) if pid > 1 else None
        if st is None:
            raise Refused(
                Refusal.NOT_OWNED,
                f"the socket's peer has pid {pid}, which is no process in the agent's "
                "pid namespace; run the agent in the host's (Kubernetes: hostPID)",
            )
        return Peer(pid=pid, uid=uid, gid=gid, start=st.start, own_pid=own_pid)

    # ------------------------------------------------------------------ at registration

    def prove(
        self, peer: Peer, pids: tuple[int, ...], pgid: int | None
    ) -> tuple[tuple[int, ...], int | None, ProcessOwner]:
        """The registration's pids and group in the agent's pid namespace, and its owner; Refused (``not_owned``)
        when they are not the peer's to name."""
        st = self.proc.stat(peer.pid)
        if st is None or st.start != peer.start:
            raise Refused(
                Refusal.NOT_OWNED,
                f"process {peer.pid}, which asked the agent's socket for the proof, has "
                "exited; register from the job's running process",
            )
        stats = self.proc.all_stats()
        if peer.own_pid != peer.pid:  # the job sees pids of a namespace of its own: translate them
            pids, pgid = self._translate(peer, pids, pgid, stats)
        family = self._family(peer.pid, stats)
        starts = []
        for pid in pids:
            pst = stats.get(pid)
            if pst is None or pid not in family:
                raise Refused(
                    Refusal.NOT_OWNED,
                    f"pid {pid} is not process {peer.pid} (which registered) nor one of "
                    "its descendants; register the job's own processes, from the "
                    "process that started them",
                )
            self._uids_ok(pid, peer.uid)
            starts.append(pst.start)
        group_start = None
        if pgid is not None:
            members = [p for p, s in stats.items() if s.pgrp == pgid]
            if not members:
                raise Refused(Refusal.NOT_OWNED, f"process group {pgid} has no processes")
            if pgid != st.pgrp and any(p not in family for p in members):
                strangers = sorted(p for p in members if p not in family)[:5]
                raise Refused(
                    Refusal.NOT_OWNED,
                    f"process group {pgid} is not the registering process's own group "
                    f"({st.pgrp}) and holds processes that are not its descendants "
                    f"({strangers}); start the job's processes in a group of their own "
                    "(e.g. start_new_session=True) from the registering process",
                )
            for p in members:
                self._uids_ok(p, peer.uid)
                if p == self.own_pid:
                    raise Refused(Refusal.FORBIDDEN_PROCESS, f"process group {pgid} holds the agent itself")
            leader = stats.get(pgid)
            group_start = leader.start if leader is not None and leader.pgrp == pgid else None
        owner = ProcessOwner(
            pid=peer.pid,
            uid=peer.uid,
            gid=peer.gid,
            start=peer.start,
            pid_starts=tuple(starts),
            group_start=group_start,
        )
        return pids, pgid, owner

    def _family(self, root: int, stats: dict[int, Stat]) -> set[int]:
        """``root`` and its descendants."""
        children: dict[int, list[int]] = {}
        for pid, st in stats.items():
            children.setdefault(st.ppid, []).append(pid)
        seen: set[int] = set()
        todo = [root]
        while todo:
            pid = todo.pop()
            if pid not in seen:
                seen.add(pid)
                todo.extend(children.get(pid, ()))
        return seen

    def _translate(
        self, peer: Peer, pids: tuple[int, ...], pgid: int | None, stats: dict[int, Stat]
    ) -> tuple[tuple[int, ...], int | None]:
        """The job's pids (and group) as the agent sees them: the processes of the peer's pid namespace, found by
        the last number of their ``NSpid`` (``NSpgid``) lines."""
        ns = self.proc.pid_ns(peer.pid)
        inner: dict[int, int] = {}
        groups: dict[int, int] = {}
        for pid, st in stats.items():
            if self.proc.pid_ns(pid) != ns or ns is None:
                continue
            if (nspid := self.proc.status(pid, "NSpid")) is not None:
                inner[nspid[-1]] = pid
            if (nspgid := self.proc.status(pid, "NSpgid")) is not None:
                groups[nspgid[-1]] = st.pgrp
        if inner.get(peer.own_pid) != peer.pid:
            raise Refused(
                Refusal.NOT_OWNED,
                f"the socket's peer says it is pid {peer.own_pid}, but it is pid "
                f"{peer.pid} here and not {peer.own_pid} in its own pid namespace",
            )
        missing = [p for p in pids if p not in inner]
        if missing or (pgid is not None and pgid not in groups):
            raise Refused(Refusal.NOT_OWNED, f"pids {missing or [pgid]} are no processes of the job's pid namespace")
        return tuple(inner[p] for p in pids), (groups[pgid] if pgid is not None else None)

    def _uids_ok(self, pid: int, owner_uid: int) -> None:
        if self.any_uid:
            return
        uids = self.proc.status(pid, "Uid")
        if uids is None:
            raise Refused(Refusal.NOT_OWNED, f"pid {pid} is gone (or its status unreadable)")
        other = sorted({u for u in uids[:3] if u != owner_uid and u not in self.allowed_uids})
        if other:
            raise Refused(
                Refusal.NOT_OWNED,
                f"pid {pid} runs as uid {other[0]}, not the registering process's uid "
                f"{owner_uid}; the agent acts on another uid's processes only when "
                "started with --allow-uid UID (or --allow-other-uids)",
            )

    def standalone(self, current: JobContext | None, ctx: JobContext) -> JobContext:
        """``ctx`` (a standalone operation's configuration, with a process-level backend) with its owner, when the
        job's registration (``current``) proved its processes and ``ctx``'s are still that owner's own."""
        owner = current.owner if current is not None else None
        if owner is None:
            raise Refused(
                Refusal.UNPROVEN,
                f"job {ctx.job!r} did not prove its processes through the agent's socket, "
                f"so {'+'.join(ctx.backends)} does not act on them: register it from its "
                "own process first (register_workload), then name no pids here",
            )
        assert current is not None
        if (ctx.pids, ctx.pgid) == (current.pids, current.pgid):
            return ctx if ctx.owner == owner else _with_owner(ctx, owner)
        peer = Peer(pid=owner.pid, uid=owner.uid, gid=owner.gid, start=owner.start, own_pid=owner.pid)
        pids, pgid, proven = self.prove(peer, ctx.pids, ctx.pgid)
        return _with_owner(ctx, proven, pids=pids, pgid=pgid)

    # ------------------------------------------------------------------ before acting

    def verify(self, ctx: JobContext) -> None:
        """Refused unless a process-level backend may act on ``ctx``'s processes now (see the module doc)."""
        owner = ctx.owner
        if owner is None:
            raise Refused(
                Refusal.UNPROVEN,
                f"job {ctx.job!r} did not prove its processes through the agent's socket, "
                f"so its {'+'.join(ctx.backends)} backend does not act on them; register "
                "it again from its own process (register_workload does so)",
            )
        for pid, start in zip(ctx.pids, owner.pid_starts, strict=False):
            st = self.proc.stat(pid)
            if st is None:
                continue  # gone: the backend says so (or the job's exit is noticed)
            if st.start != start:
                raise Refused(
                    Refusal.NOT_OWNED, f"pid {pid} is no longer the job's process (it exited and the number was reused)"
                )
            self._uids_ok(pid, owner.uid)
        if ctx.pgid is not None:
            if ctx.pgid in (0, 1) or ctx.pgid == self.own_pgid:
                raise Refused(Refusal.FORBIDDEN_PROCESS, f"process group {ctx.pgid} is never a job's")
            leader = self.proc.stat(ctx.pgid)
            if (
                owner.group_start is not None
                and leader is not None
                and leader.pgrp == ctx.pgid
                and leader.start != owner.group_start
            ):
                raise Refused(
                    Refusal.NOT_OWNED,
                    f"process group {ctx.pgid} is no longer the job's (its leader exited and the number was reused)",
                )
            for pid, st in self.proc.all_stats().items():
                if st.pgrp == ctx.pgid:
                    if pid == self.own_pid:
                        raise Refused(Refusal.FORBIDDEN_PROCESS, f"process group {ctx.pgid} holds the agent itself")
                    self._uids_ok(pid, owner.uid)

    def may_act(self, ctx: JobContext, pid: int) -> bool:
        """Whether a backend may act on ``pid`` (a process it found for ``ctx``, e.g. a descendant)."""
        if ctx.owner is None or pid <= 1 or pid == self.own_pid:
            return False
        try:
            self._uids_ok(pid, ctx.owner.uid)
        except Refused:
            return False
        return True


def _with_owner(ctx: JobContext, owner: ProcessOwner, **changes: object) -> JobContext:
    return msgspec.structs.replace(ctx, owner=owner, **changes)
