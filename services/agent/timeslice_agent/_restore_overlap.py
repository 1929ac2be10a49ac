"""When a restore may start beside the snapshots it follows (``Restore.after``) instead of after them.

The orchestrator sends a switch's restores together with its snapshots, each restore naming the snapshots
on its node that it follows, because the incoming context may need the memory the outgoing one frees. When
the node has room for both contexts at once, the agent starts the restore at once: the incoming job's
host-to-device copy then runs beside the outgoing job's device-to-host copy (on a GPU they use the two
directions of the link), and the restore's round trip to its workload leaves the switch's critical path.
Such a restore's result says so (``OpResult.overlapped``), and on it the orchestrator grants the incoming job
while the outgoing snapshot still runs (grant on restore: the incoming job runs, the outgoing one only has its
state copied out; no other switch of the group starts before that snapshot ended). Otherwise the grant waits for
every operation of the switch.

A restore overlaps only when all of this holds (else it waits, as before):

* overlap is on (``AgentConfig.overlap_restores``);
* a snapshot it follows is still running here;
* the restored job's context is SAVED here with a known size (the bytes its last snapshot reported);
* neither it nor any other job of its group on this node uses a process-level backend (``freeze``);
* its size plus a margin fits in the node's free device memory, less what overlapped restores still running
  here have reserved. Free memory is the least free memory of the node's GPUs (NVML), or, on a node
  without GPUs, the host's available memory (the "device" of a CPU job). Unknown memory: no overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Final

from timeslice_client.protocol import JobContext, JobState, Restore

from ._host import host_memory
from ._job_parts import all_backends
from ._nvml import gpu_source
from ._running_ops import RunningOps

__all__ = ["PROCESS_LEVEL", "RestoreOrder", "Turn", "fits", "free_device_bytes", "restore_size"]

_DOUBT_POLL_S: Final = 0.02  # how often a restore looks again for the snapshot a restart left in doubt

PROCESS_LEVEL = frozenset({"freeze"})  # backends that stop or start processes: their order is kept


def free_device_bytes() -> int | None:
    """Free memory for a restored context: the least free memory of this node's GPUs; without NVML, the
    host's available memory. None when it cannot be read."""
    source = gpu_source()
    if source is not None:
        try:
            devices = source.devices()
        except Exception:  # pynvml.NVMLError: unknown, so no overlap
            return None
        return min((d.memory_total_bytes - d.memory_used_bytes for d in devices), default=None)
    total, available = host_memory()
    return available if total else None


def restore_size(ctx: JobContext) -> int:
    """The device bytes a restore of ``ctx`` brings back (as its last snapshot reported them; 0: unknown)."""
    return max(ctx.device_bytes_freed, ctx.bytes_moved)


def fits(need: int, free: int | None, reserved: int, margin_bytes: int, margin_fraction: float) -> bool:
    """Whether ``need`` bytes, plus the margin, fit in ``free`` less ``reserved``."""
    if free is None or need <= 0:
        return False
    return need * (1 + margin_fraction) + margin_bytes + reserved <= free


@dataclass(slots=True)
class Turn:
    """How a restore starts: ``overlapped`` beside its snapshots, or after them; ``error`` when it may not
    start at all (a snapshot it follows outlived the restore's deadline)."""

    overlapped: bool = False
    error: str | None = None


class RestoreOrder:
    """Orders a node's restores after the snapshots they follow, unless the node has room for both."""

    def __init__(
        self,
        running: RunningOps,
        *,
        doubt: Callable[[Restore], list[str]] = lambda cmd: [],
        enabled: bool = True,
        margin_bytes: int = 1 << 30,
        margin_fraction: float = 0.1,
        free_bytes: Callable[[], int | None] = free_device_bytes,
        free_bytes_blocks: Callable[[], bool] = lambda: gpu_source() is not None,
    ) -> None:
        self._running = running
        self._doubt = doubt  # JobBook.in_doubt: the snapshots a restart left in doubt that a restore follows
        self._free_bytes_blocks = free_bytes_blocks
        self.enabled = enabled
        self.margin_bytes = margin_bytes
        self.margin_fraction = margin_fraction
        self._free_bytes = free_bytes
        self.reserved = 0  # bytes of the overlapped restores running here

    async def _read_free(self) -> int | None:
        """``free_bytes()``: in a thread where it blocks (NVML; its first use loads the library), else inline
        (``/proc/meminfo`` is read faster than a thread hop, which would sit on the switch's critical path)."""
        if self._free_bytes_blocks():
            return await asyncio.to_thread(self._free_bytes)
        return self._free_bytes()

    def may_overlap(
        self, cmd: Restore, ctx: JobContext | None, group_jobs: Iterable[JobContext], free: int | None
    ) -> int:
        """The bytes to reserve when ``cmd`` may start beside its snapshots, else 0."""
        if not self.enabled or not self._running.any_running(cmd.after):
            return 0
        if ctx is None or ctx.state is not JobState.SAVED:
            return 0
        if any(PROCESS_LEVEL.intersection(all_backends(j)) for j in (ctx, *group_jobs)):
            return 0
        need = restore_size(ctx)
        return need if fits(need, free, self.reserved, self.margin_bytes, self.margin_fraction) else 0

    @contextlib.asynccontextmanager
    async def turn(self, cmd: Restore, ctx: JobContext | None, group_jobs: Iterable[JobContext]) -> AsyncIterator[Turn]:
        """Wait for this restore's turn; its reservation, if it overlaps, lasts until the block ends."""
        jobs = tuple(group_jobs)
        need = 0
        if self.enabled and self._running.any_running(cmd.after):
            free = await self._read_free()
            need = self.may_overlap(cmd, ctx, jobs, free)
        if need:
            self.reserved += need
            try:
                yield Turn(overlapped=True)
            finally:
                self.reserved -= need
            return
        yield Turn(error=await self._settled(cmd))

    async def _settled(self, cmd: Restore) -> str | None:
        """Wait until every snapshot ``cmd`` follows is answered, also one a restart left in doubt (``doubt``); an error
        at its deadline.
        After a restart the orchestrator sends a switch's operations again job by job, so a restore can come before
        the snapshot it follows, which then runs nowhere yet: ``RunningOps.wait`` had nothing to wait for. Once that
        snapshot begins here, its answer is waited for as any other's."""
        deadline_s = cmd.deadline_ms / 1000
        while ops := [op for op in self._doubt(cmd) if not self._running.seen(op)]:
            if time.time() >= deadline_s:
                return f"deadline passed while {ops[0]}, which this restore follows, was left in doubt by a restart"
            await asyncio.sleep(_DOUBT_POLL_S)  # until it is sent again (only after a restart of this agent)
        return await self._running.wait(cmd.after, deadline_s)
