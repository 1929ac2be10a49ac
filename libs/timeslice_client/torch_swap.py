"""Switching two :class:`~timeslice_client.torch_offload.TorchOffloadHandler` s of one process that share a
GPU (e.g. a colocated trainer and rollout engine): the outgoing state's device-to-host copies overlapped
with the incoming state's host-to-device copies when memory allows (PCIe is full duplex)."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import torch

from .errors import HandlerError
from .handlers import HandlerResult
from .protocol import SuspendMode
from .torch_offload import TorchOffloadHandler

__all__ = ["SWAP_HEADROOM", "SwapResult", "can_overlap", "swap"]

SWAP_HEADROOM: Final = 512 << 20  # free device memory kept aside when deciding to overlap (allocator slack)


@dataclass(frozen=True, slots=True)
class SwapResult:
    suspended: HandlerResult  # the outgoing handler's suspend
    resumed: HandlerResult  # the incoming handler's resume
    overlapped: bool  # whether the two ran at the same time


def can_overlap(outgoing: TorchOffloadHandler, incoming: TorchOffloadHandler, in_tags: Iterable[str] = ()) -> bool:
    """True when both handlers are on CUDA and every device the incoming state needs has room for it now,
    before the outgoing state is freed (so the resume's allocations cannot fail for want of that memory)."""
    if not (outgoing.is_cuda and incoming.is_cuda):
        return False  # CPU: both copies share the same memory bus; nothing to gain
    for index, nbytes in incoming.saved_bytes_by_device(in_tags).items():
        free, _ = torch.cuda.mem_get_info(index)
        cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        if nbytes + SWAP_HEADROOM > free + cached:
            return False
    return True


def swap(
    outgoing: TorchOffloadHandler,
    incoming: TorchOffloadHandler,
    *,
    mode: SuspendMode = SuspendMode.OFFLOAD,
    out_tags: Iterable[str] = (),
    in_tags: Iterable[str] = (),
    overlap: bool | None = None,
) -> SwapResult:
    """Suspend ``outgoing`` and resume ``incoming``: the handler-level switch of two jobs that share a GPU
    from one process (e.g. a colocated trainer and rollout engine).

    PCIe is full duplex: when ``overlap`` (by default: :func:`can_overlap`, i.e. both on CUDA and the
    incoming state fits beside the outgoing one) the outgoing device-to-host copies and the incoming
    host-to-device copies run at the same time, each handler on its own copy stream, so the swap costs
    about one copy instead of two. Otherwise the suspend finishes (freeing its memory) before the resume
    starts. Each side keeps its own guarantees: a failed suspend is rolled back, a failed resume leaves
    its groups suspended; if either fails, :class:`HandlerError` says which, after both have finished.
    """
    out_set, in_set = frozenset(out_tags), frozenset(in_tags)
    if outgoing is incoming:
        raise ValueError("swap needs two different handlers (one handler suspends and resumes its own tags)")
    if overlap is None:
        overlap = can_overlap(outgoing, incoming, in_set)
    if not overlap:
        suspended = outgoing.suspend(mode, out_set)
        return SwapResult(suspended, incoming.resume(mode, in_set), overlapped=False)
    for index in range(torch.cuda.device_count()):  # the outgoing job's queued kernels finish first
        torch.cuda.synchronize(index)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="timeslice-swap") as pool:
        out_f = pool.submit(outgoing._suspend, mode, out_set, sync_device=False)
        in_f = pool.submit(incoming.resume, mode, in_set)
        out_exc, in_exc = out_f.exception(), in_f.exception()
    if out_exc is not None or in_exc is not None:
        parts = [
            f"suspend of the outgoing state failed ({out_exc!r}; rolled back: it is on the device)"
            if out_exc is not None
            else "the outgoing state was suspended",
            f"resume of the incoming state failed ({in_exc!r}; it stays suspended)"
            if in_exc is not None
            else "the incoming state was resumed",
        ]
        raise HandlerError(f"swap failed: {'; '.join(parts)}") from (out_exc or in_exc)
    return SwapResult(out_f.result(), in_f.result(), overlapped=True)
