"""``bench/offload.py``'s plain-copy baselines: the driver's copy(1), fresh(2) and clone(2') of the same bytes in
job A's tensor shapes, before and after each size's workers, and (1p) job A's own copy of its tensors at the start of
each hold (paired with the offload that follows it)."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["N_TENSORS", "PairedCopy", "baselines"]

N_TENSORS = 4  # A's state: this many equal float32 tensors


def _host(n: int, cuda: bool) -> Any:
    """``n`` float32 of host memory as the handler's host buffer is: pinned on CUDA; on CPU advised to transparent
    huge pages (a copy between huge pages is faster than between 4 KiB pages: the baseline must not be the weaker)."""
    import torch
    from timeslice_client._huge_pages import advise_huge_pages

    if cuda:
        return torch.empty(n, pin_memory=True)
    t = torch.empty(n)
    advise_huge_pages(int(t.data_ptr()), n * 4)
    return t


class PairedCopy:
    """Job A's plain copy of its own tensors into a buffer of its own (touched, advised to huge pages; pinned on
    CUDA), timed once per cycle at the start of each hold, so each offload has a baseline taken seconds before it
    on the same memory: a ratio to it does not move with the host's memory bandwidth between the baselines
    taken before and after the size (which moved by up to a quarter within one run, bench/NOTES.md)."""

    def __init__(self, tensors: list[Any], device: str) -> None:
        self.tensors, self.cuda = tensors, device == "cuda"  # A's float32 tensors
        self.dst = [_host(t.numel(), self.cuda).zero_() for t in tensors]  # touched before the timed copies
        self.spans: list[list[int]] = []

    def run(self) -> None:
        import torch

        t0 = time.monotonic_ns()
        for d, t in zip(self.dst, self.tensors, strict=True):
            d.copy_(t.detach().reshape(-1))
        if self.cuda:
            torch.cuda.synchronize()
        self.spans.append([t0, time.monotonic_ns()])


def baselines(nbytes: int, reps: int, device: str) -> dict[str, list[float]]:
    """Seconds per copy of ``nbytes`` in A's tensor shapes, ``reps`` times each kind, one kind after another.

    ``copy``: device tensors into a preallocated, touched host buffer, as the handler's (``_host``).
    ``fresh``: host buffer into newly allocated device memory, freed again each rep (as offload/restore cycles
    free and re-allocate; on CUDA with ``empty_cache()``, as the handler does); ``free``: the time to free it
    (an offload pays that, the copies do not). ``clone``: CPU ``src.clone()`` (fresh memory without huge-page
    advice); CUDA ``src.to("cpu")`` (fresh pageable host memory).
    """
    import torch

    cuda = device == "cuda"

    def dev(n: int) -> Any:
        return torch.empty(n, device="cuda") if cuda else _host(n, cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    per = nbytes // N_TENSORS // 4
    src = [dev(per).fill_(float(i + 1)) for i in range(N_TENSORS)]
    out: dict[str, list[float]] = {"copy": [], "fresh": [], "clone": [], "free": []}
    dst = [_host(per, cuda).zero_() for _ in src]  # touched: every page is there before the timed copies
    sync()
    for _ in range(reps):
        t0 = time.perf_counter()
        for s, d in zip(src, dst, strict=True):
            d.copy_(s)
        sync()
        out["copy"].append(time.perf_counter() - t0)
    hsrc = dst if cuda else src  # the restore's source: the host buffer
    del dst
    for _ in range(reps):
        t0 = time.perf_counter()
        fresh = []
        for s in hsrc:
            d = dev(per)
            fresh.append(d.copy_(s))
        sync()
        out["fresh"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        del fresh, d
        if cuda:
            torch.cuda.empty_cache()
        out["free"].append(time.perf_counter() - t0)
    for _ in range(reps):
        t0 = time.perf_counter()
        clones = [s.to("cpu") if cuda else s.clone() for s in src]
        sync()
        out["clone"].append(time.perf_counter() - t0)
        del clones
    return out
