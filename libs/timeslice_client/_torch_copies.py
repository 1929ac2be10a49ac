"""How a ``TorchOffloadHandler`` moves bytes: flat byte views of storages, copies in chunks (queued on CUDA), many
copies in one torch call, and the re-allocation of a freed storage. Apart from the handler, which decides what
moves when."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Final

import torch

from ._huge_pages import advise_huge_pages

__all__ = ["FOREACH_ZERO", "ByteCopies", "bytes_of"]

# One call for many copies or fills (torch >= 2.1); underscored in torch, as its optimizers use them.
_FOREACH_COPY: Final = getattr(torch, "_foreach_copy_", None)
FOREACH_ZERO: Final = getattr(torch, "_foreach_zero_", None)


def bytes_of(storage: Any) -> Any:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ByteCopies:
    """The copying half of ``TorchOffloadHandler`` (its ``chunk_bytes`` and whether it is on CUDA)."""

    chunk_bytes: int
    _cuda: bool

    def _chunks(self, dst: Any, src: Any) -> Iterator[tuple[Any, Any]]:
        """``(dst, src)`` pieces of two flat uint8 tensors, at most ``chunk_bytes`` each."""
        n = int(src.numel())
        step = self.chunk_bytes
        if n <= step:
            yield dst, src
            return
        for start in range(0, n, step):
            yield dst[start : start + step], src[start : start + step]

    def _copy_bytes(self, dst: Any, src: Any, stop: threading.Event | None = None) -> int:
        """Copy the flat uint8 tensor ``src`` into ``dst`` in chunks (queued, not waited for, on CUDA); returns the
        bytes copied, fewer than ``src``'s when ``stop`` was set before a chunk (the copy ends there)."""
        copied = 0
        for d, s in self._chunks(dst, src):
            if stop is not None and stop.is_set():
                break
            d.copy_(s, non_blocking=self._cuda)
            copied += int(s.numel())
        return copied

    def _allocate(self, storage: Any, nbytes: int) -> None:
        if self._cuda:
            with torch.cuda.device(storage.device):
                storage.resize_(nbytes)
            return
        storage.resize_(nbytes)
        advise_huge_pages(int(storage.data_ptr()), nbytes)

    def _copy_all(self, pairs: list[tuple[Any, Any]]) -> None:
        """Copy each ``(dst, src)`` pair of flat uint8 tensors, all in one call (chunks of at most
        ``chunk_bytes``). Each torch call hands the GIL over and takes it back; one call for all the copies,
        not one per storage, keeps a model of many tensors fast when another thread runs Python."""
        pieces = [piece for d, s in pairs for piece in self._chunks(d, s)]
        if not pieces:
            return
        dst = [d for d, _ in pieces]
        src = [s for _, s in pieces]
        if _FOREACH_COPY is None:  # torch < 2.1
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
            return
        _FOREACH_COPY(dst, src)
