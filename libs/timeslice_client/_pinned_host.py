"""Host buffers for ``TorchOffloadHandler``: exactly sized and pinned by registration, or torch's cached ones.

torch's pinned host allocator (``torch.empty(..., pin_memory=True)``, ``.pin_memory()``) rounds every buffer up
to a power of two and caches it after release (``torch.cuda.empty_cache()`` does not give it back): a 70 GB
state holds 128 GiB of pinned host memory for good. ``registered`` buffers are plain host memory of the exact
size, page-aligned, pinned with one ``cudaHostRegister`` per buffer and unpinned with ``cudaHostUnregister``
when the state is resumed or dropped, after which the memory goes back to the OS (buffers are torch CPU
tensors, so nothing can point into memory that was freed: it is freed when the last view goes).

The registrar (``register``/``unregister``) is the seam: ``CudaRegistrar`` calls the CUDA runtime through
torch's binding (imported when first used); tests pass one that records calls.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import torch

from ._huge_pages import advise_huge_pages

__all__ = ["HOST_MEMORY", "CudaRegistrar", "HostBuffer", "HostMemory", "HostMemoryKind", "HostRegistrar"]

log = logging.getLogger("timeslice.client")

HostMemoryKind = Literal["registered", "cached"]
HOST_MEMORY: Final[tuple[HostMemoryKind, ...]] = ("registered", "cached")
PAGE: Final = mmap.PAGESIZE
_PORTABLE: Final = 1  # cudaHostRegisterPortable: pinned for every device and context of the process


class HostRegistrar(Protocol):
    """Pins and unpins host memory for the device's copies."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Pin ``[ptr, ptr + nbytes)``; raise (any ``Exception``, saying why) when it cannot."""
        ...

    def unregister(self, ptr: int) -> None:
        """Unpin the range registered at ``ptr``; raise when that fails."""
        ...


class CudaRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through ``torch.cuda.cudart()``."""

    def register(self, ptr: int, nbytes: int) -> None:
        runtime = _runtime()
        code = int(runtime.cudaHostRegister(ptr, nbytes, _PORTABLE))
        if code:
            raise OSError(f"cudaHostRegister of {nbytes} bytes failed: {_error_string(runtime, code)}")

    def unregister(self, ptr: int) -> None:
        runtime = _runtime()
        code = int(runtime.cudaHostUnregister(ptr))
        if code:
            raise OSError(f"cudaHostUnregister failed: {_error_string(runtime, code)}")


def _runtime() -> Any:
    cudart: Any = torch.cuda.cudart  # untyped in torch's annotations
    return cudart()


def _error_string(runtime: Any, code: int) -> str:
    """The runtime's words for ``code``; also clears the thread's last error (cudaGetLastError), which a failed
    call leaves set, so that torch's next kernel launch check does not report it as its own failure."""
    try:
        text = f"{runtime.cudaGetErrorString(runtime.cudaError(code))} ({code})"
    except Exception:  # words for an error, never a second one
        text = f"cudaError {code}"
    _clear_last_error()
    return text


def _clear_last_error() -> None:
    """Call ``cudaGetLastError`` of the CUDA runtime torch loaded (found by name among the process's libraries;
    torch's own binding does not offer it). Without it, launch one tiny kernel: torch's launch check reads (and so
    clears) the error, raising it here instead of at the job's next kernel. Best effort."""
    import ctypes

    cleared = False
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
        for path in sorted(paths):
            ctypes.CDLL(path).cudaGetLastError()
            cleared = True
    except (OSError, AttributeError, IndexError):
        pass
    if not cleared:
        with contextlib.suppress(Exception):
            torch.empty(1, device="cuda").zero_()


@dataclass(slots=True)
class HostBuffer:
    """A flat uint8 host tensor of ``nbytes``; ``cached``: from torch's allocator (reused across cycles),
    else an exact buffer that ``HostMemory.release`` unpins (when ``registered``) and lets go."""

    tensor: Any
    nbytes: int
    cached: bool
    registered: bool = False

    def fits(self, nbytes: int) -> bool:
        """Whether this buffer serves a need of ``nbytes``: the same size, or (cached) at least as big."""
        return self.nbytes == nbytes or (self.cached and self.nbytes >= nbytes)


_logged: set[str] = set()
_logged_lock = threading.Lock()


def _log_once(message: str) -> None:
    with _logged_lock:
        if message in _logged:
            return
        _logged.add(message)
    log.warning("%s", message)


class HostMemory:
    """Allocates a handler's host buffers of one kind (``registered`` or ``cached``).

    ``pinned``: the device is CUDA (cached buffers come pinned from torch's allocator; registered ones are
    registered with ``registrar``, by default the CUDA runtime's). On CPU a registered buffer is the exact
    plain buffer, registered only with a ``registrar`` given (tests). When a registration (or the exact
    allocation) fails, the reason is logged once and this and every later buffer comes from torch's allocator
    (``fallback_reason`` says why).
    """

    def __init__(self, kind: HostMemoryKind, *, pinned: bool, registrar: HostRegistrar | None = None) -> None:
        if kind not in HOST_MEMORY:
            raise ValueError(f"host_memory must be one of {', '.join(map(repr, HOST_MEMORY))}, not {kind!r}")
        self.kind: HostMemoryKind = kind
        self.pinned = pinned
        self.registrar = registrar if registrar is not None or not pinned else CudaRegistrar()
        self.fallback_reason: str | None = None
        self.registered_bytes = 0  # bytes registered now (by this object)
        self.peak_registered_bytes = 0

    @property
    def in_use(self) -> HostMemoryKind:
        """The kind new buffers get: ``kind``, or ``"cached"`` after a fallback."""
        return "cached" if self.fallback_reason is not None else self.kind

    def allocate(self, nbytes: int) -> HostBuffer:
        if nbytes <= 0:
            raise ValueError(f"a host buffer needs a positive size, not {nbytes}")
        if self.in_use == "registered":
            try:
                return self._exact(nbytes)
            except Exception as exc:  # any failure to pin falls back to torch's allocator, logged
                self.fallback_reason = f"{type(exc).__name__}: {exc}"
                _log_once(
                    f"torch offload: exact registered host buffers unavailable ({self.fallback_reason}); using "
                    "torch's pinned allocator instead (buffers rounded up to a power of two and kept cached)"
                )
        if self.pinned:
            return HostBuffer(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), nbytes, cached=True)
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        advise_huge_pages(int(tensor.data_ptr()), nbytes)
        return HostBuffer(tensor, nbytes, cached=True)

    def _exact(self, nbytes: int) -> HostBuffer:
        # Whole pages and one more, so that the buffer starts on a page and ends in its own: the registration
        # (the OS pins whole pages) then never shares a page with a neighbouring allocation.
        backing = torch.empty(-(-nbytes // PAGE) * PAGE + PAGE, dtype=torch.uint8)
        start = -int(backing.data_ptr()) % PAGE
        tensor = backing[start : start + nbytes]
        ptr = int(tensor.data_ptr())
        advise_huge_pages(ptr, nbytes)  # before the registration (or the first copy) faults the pages in
        if self.registrar is None:
            return HostBuffer(tensor, nbytes, cached=False)
        self.registrar.register(ptr, nbytes)
        self.registered_bytes += nbytes
        self.peak_registered_bytes = max(self.peak_registered_bytes, self.registered_bytes)
        return HostBuffer(tensor, nbytes, cached=False, registered=True)

    def release(self, buf: HostBuffer) -> None:
        """Unpin ``buf`` (when registered) and drop it: its memory goes back once no view of it is left (at once
        for the handler's own: its slots are gone by then). Only after every copy from or to it has ended."""
        if buf.registered:
            buf.registered = False
            self.registered_bytes -= buf.nbytes
            assert self.registrar is not None
            try:
                self.registrar.unregister(int(buf.tensor.data_ptr()))
            except Exception as exc:  # the state is safe; the pages stay pinned until exit
                log.warning("torch offload: unpinning a host buffer of %d bytes failed (%s)", buf.nbytes, exc)
        buf.tensor = None
