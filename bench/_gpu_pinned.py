"""``bench/gpu_check.py``'s ``pinned`` section: ``TorchOffloadHandler``'s host buffers, exact registered ones
(``host_memory="registered"``: pinned by one ``cudaHostRegister`` and kept for the next suspend, the default;
``registered_per_switch``: ``keep_host_buffers=False``, pinned at every suspend and unpinned and freed at the resume)
against torch's cached pinned allocator (``"cached"``: power-of-two blocks, kept), on one state of ``bytes``.

Per kind: suspend and resume GB/s (the handler's own time; ``first_*``: the first cycle, which allocates in both
kinds, ``*_gbps``: the median of the others), the time to allocate and to release one buffer of the state's size
alone, the peak pinned bytes (registered: what the handler registered; cached: torch's
``host_memory_stats``), the host bytes the handler still holds after the last resume, the process's RSS growth
over the cycles, and whether registration fell back. The state is checked bit-exact after every kind.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from _gpu_offload import N_TENSORS, _checksums, _med, _random_state, _sync
from _gpu_report import GB

if TYPE_CHECKING:
    from timeslice_client._pinned_host import HostMemoryKind

__all__ = ["VARIANTS", "pinned"]

# (name in the report, host_memory, keep_host_buffers)
VARIANTS: tuple[tuple[str, HostMemoryKind, bool], ...] = (
    ("registered", "registered", True),
    ("registered_per_switch", "registered", False),
    ("cached", "cached", True),
)


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _torch_pinned_peak() -> int | None:
    """Peak bytes torch's pinned host allocator held (its rounded blocks), since the last reset."""
    import torch

    stats = torch.cuda.host_memory_stats()
    peaks = [v for k, v in stats.items() if k.startswith("allocated_bytes") and k.endswith("peak")]
    return int(max(peaks)) if peaks else None


def _empty_host_cache(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        getattr(torch._C, "_host_emptyCache", lambda: None)()
        reset = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
        if reset is not None:
            reset()


def _alloc_release(kind: HostMemoryKind, nbytes: int, device: str) -> tuple[float, float]:
    """Seconds to get one host buffer of ``nbytes`` of ``kind`` (pinned on CUDA) and to let it go."""
    from timeslice_client._pinned_host import HostMemory

    memory = HostMemory(kind, pinned=device == "cuda")
    t0 = time.perf_counter()
    buf = memory.allocate(nbytes)
    t1 = time.perf_counter()
    memory.release(buf)
    del buf
    _empty_host_cache(device)  # cached: what torch's allocator keeps, so that the next kind starts from nothing
    return t1 - t0, time.perf_counter() - t1


def pinned(nbytes: int, cycles: int, device: str = "cuda") -> dict[str, Any]:
    from timeslice_client.protocol import SuspendMode
    from timeslice_client.torch_offload import TorchOffloadHandler

    state = _random_state(nbytes, N_TENSORS, device)
    sums = _checksums(state)
    nbytes = sum(int(t.untyped_storage().nbytes()) for t in state)
    out: dict[str, Any] = {"bytes": nbytes, "cycles": cycles, "bit_exact": True}
    for name, kind, keep in VARIANTS:
        _empty_host_cache(device)
        alloc_s, release_s = _alloc_release(kind, nbytes, device)
        rss0 = _rss()
        h = TorchOffloadHandler(tensors={"state": state}, device=device, host_memory=kind, keep_host_buffers=keep)
        sus: list[float] = []
        res: list[float] = []
        for _ in range(cycles):
            _sync(device)
            t0 = time.perf_counter()
            h.suspend(SuspendMode.OFFLOAD, frozenset())
            t1 = time.perf_counter()
            h.resume(SuspendMode.OFFLOAD, frozenset())
            _sync(device)
            sus.append(t1 - t0)
            res.append(time.perf_counter() - t1)
        later_s, later_r = sus[1:] or sus, res[1:] or res
        peak = h._host.peak_registered_bytes if kind == "registered" else None
        if device == "cuda" and (kind == "cached" or h.host_memory_fallback):
            peak = _torch_pinned_peak()
        out[name] = {
            "in_use": h.host_memory_in_use,
            "fallback": h.host_memory_fallback,
            "alloc_s": alloc_s,
            "release_s": release_s,
            "first_offload_s": sus[0],
            "first_restore_s": res[0],
            "offload_s": sus,
            "restore_s": res,
            "offload_gbps": nbytes / GB / _med(later_s),
            "restore_gbps": nbytes / GB / _med(later_r),
            "peak_pinned_bytes": peak,
            "host_bytes_after": h.host_bytes(),
            "rss_growth_after": _rss() - rss0,
        }
        out["bit_exact"] = out["bit_exact"] and _checksums(state) == sums
        h.release_host_buffers()
        del h
    del state
    _empty_host_cache(device)
    return out
