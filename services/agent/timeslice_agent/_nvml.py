"""What the GPUs of this node hold, from NVML (``nvidia-ml-py``, imported as ``pynvml``, lazily).

* :class:`GpuSource` is the seam: ``devices()`` (index, UUID, memory used/total) and ``processes()``
  (every compute process on every device with the device memory it holds). :class:`PynvmlSource` is
  the real one; tests pass their own.
* :func:`gpu_source` loads NVML once per process; without the library, a driver or a GPU it returns
  None and :func:`gpu_source_error` says why (the agent then announces no devices; nothing crashes).
* :class:`GpuAccounting` finds a job's processes on the GPUs (the registered PIDs, their descendants
  and the registered process group, skipping processes that hold no device memory) and measures the
  device memory they hold, so each operation reports the bytes it freed as NVML saw them.

NVML reports PIDs as the host's PID namespace sees them: run the agent in the host PID namespace
(``hostPID: true`` on Kubernetes) so they match the job's.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from timeslice_client.protocol import DeviceInfo

from ._load_once import LoadOnce

log = logging.getLogger("timeslice.agent")

__all__ = [
    "GpuAccounting",
    "GpuProcess",
    "GpuSource",
    "NvmlUnavailable",
    "PynvmlSource",
    "gpu_source",
    "gpu_source_error",
    "node_devices",
    "process_tree",
]


class NvmlUnavailable(Exception):
    """NVML cannot be used here; the message says why and what to install."""


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    device: int  # NVML device index
    used_bytes: int


class GpuSource(Protocol):
    def devices(self) -> tuple[DeviceInfo, ...]: ...

    def processes(self) -> tuple[GpuProcess, ...]: ...


class PynvmlSource:
    """NVML through ``pynvml``. Thread-safe (calls are serialised; each is a few microseconds)."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable(
                f"pynvml is not installed ({exc}); install nvidia-ml-py to report GPUs and their memory"
            ) from exc
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # pynvml.NVMLError: no driver, no device, no permission
            raise NvmlUnavailable(
                f"NVML did not initialise: {exc} (is the NVIDIA driver loaded and a GPU visible to this process?)"
            ) from exc
        self._nvml: Any = pynvml
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # already shut down
                return

    def _handles(self) -> list[tuple[int, Any]]:
        n = self._nvml.nvmlDeviceGetCount()
        return [(i, self._nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]

    def devices(self) -> tuple[DeviceInfo, ...]:
        nv = self._nvml
        out: list[DeviceInfo] = []
        with self._lock:
            for index, h in self._handles():
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                out.append(
                    DeviceInfo(
                        index=index,
                        uuid=_text(nv.nvmlDeviceGetUUID(h)),
                        name=_text(nv.nvmlDeviceGetName(h)),
                        memory_used_bytes=int(mem.used),
                        memory_total_bytes=int(mem.total),
                    )
                )
        return tuple(out)

    def processes(self) -> tuple[GpuProcess, ...]:
        nv = self._nvml
        out: list[GpuProcess] = []
        with self._lock:
            for index, h in self._handles():
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    used = getattr(p, "usedGpuMemory", None)  # None where the driver cannot tell (e.g. MIG)
                    out.append(GpuProcess(pid=int(p.pid), device=index, used_bytes=int(used or 0)))
        return tuple(out)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


_source = LoadOnce(PynvmlSource, NvmlUnavailable, "no GPU devices reported: %s")


def gpu_source() -> PynvmlSource | None:
    """The node's NVML, loaded on first use (once per process); None when it cannot be used."""
    return _source.get()


def gpu_source_error() -> str | None:
    """Why :func:`gpu_source` is None (None while it works)."""
    return _source.error()


def node_devices() -> tuple[DeviceInfo, ...]:
    """This node's GPUs for the agent's announcement; none without NVML, or while NVML fails."""
    source = gpu_source()
    if source is None:
        return ()
    try:
        return source.devices()
    except Exception as exc:  # pynvml.NVMLError (e.g. a GPU fell off the bus): report none, say why
        log.warning("NVML device query failed: %r", exc)
        return ()


def process_tree(roots: Iterable[int], pgid: int | None = None, *, proc: str = "/proc") -> frozenset[int]:
    """``roots``, every live descendant of them, and every member of process group ``pgid``
    (from ``/proc/<pid>/stat``; serving engines keep their GPU memory in child processes)."""
    children: dict[int, list[int]] = {}
    group: set[int] = set()
    try:
        entries = os.listdir(proc)
    except OSError:
        entries = []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid, ppid, pgrp = int(name), int(fields[1]), int(fields[2])
        children.setdefault(ppid, []).append(pid)
        if pgid is not None and pgrp == pgid:
            group.add(pid)
    seen: set[int] = set()
    todo = [*roots, *group]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, ()))
    return frozenset(seen)


class GpuAccounting:
    """A job's processes on the GPUs and the device memory they hold (nothing without a source)."""

    def __init__(self, source: GpuSource | None, *, proc: str = "/proc") -> None:
        self.source = source
        self._proc = proc

    def job_processes(self, pids: Iterable[int], pgid: int | None = None) -> tuple[GpuProcess, ...]:
        """The GPU processes of the job (its PIDs, their descendants, its process group) holding memory."""
        if self.source is None:
            return ()
        family = process_tree(pids, pgid, proc=self._proc)
        return tuple(p for p in self.source.processes() if p.pid in family and p.used_bytes > 0)

    def used_by(self, pids: Iterable[int]) -> int:
        """Device bytes these exact PIDs hold now, over all devices (0 for a PID NVML does not list,
        e.g. a checkpointed process)."""
        if self.source is None:
            return 0
        wanted = set(pids)
        return sum(p.used_bytes for p in self.source.processes() if p.pid in wanted)

    def devices(self) -> tuple[DeviceInfo, ...]:
        return self.source.devices() if self.source is not None else ()
