"""Transparent huge pages for CPU memory the torch handler allocates (Linux ``madvise``; a no-op elsewhere)."""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Final

__all__ = ["advise_huge_pages"]

_MADV_HUGEPAGE: Final = 14


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _huge_page_size() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 2 << 20


_MADVISE: Final = _load_libc()
_HUGE: Final = _huge_page_size()


def advise_huge_pages(ptr: int, nbytes: int) -> None:
    """Ask for transparent huge pages on the whole huge pages inside ``[ptr, ptr + nbytes)``.

    CPU only, before the memory is first touched. Fresh memory from ``resize_`` costs one page fault
    per 4 KiB page on first touch (several times slower than the copy itself, worse in a VM); with huge
    pages that is one fault per 2 MiB and freeing is cheap too. Only whole huge pages inside the
    allocation are advised, so no neighbouring allocation is affected. Advisory: errors are ignored.
    """
    if _MADVISE is None or nbytes < 2 * _HUGE:
        return
    start = (ptr + _HUGE - 1) // _HUGE * _HUGE
    end = (ptr + nbytes) // _HUGE * _HUGE
    if end > start:
        _MADVISE(start, end - start, _MADV_HUGEPAGE)
