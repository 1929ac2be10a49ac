"""A ready-made handler that moves numpy arrays off "the device" and back, for jobs without torch.

::

    from timeslice_client.numpy_offload import NumpyOffloadHandler

    handler = NumpyOffloadHandler(weights=[w1, b1, w2], optimizer=[m1, v1, ...])
    client.register_workload(handler)

Each keyword names a tag (a group of state) and gives its arrays. ``suspend(OFFLOAD)`` copies the
selected arrays into one host buffer per tag (allocated once, reused across cycles) and then frees
each array's memory in place with ``ndarray.resize(0)``: the arrays stay the same Python objects,
so the training loop's references stay valid, they just hold no data. ``resume`` re-allocates each
array at its shape (``resize`` again) and copies its bytes back, bit-exact. ``suspend(DISCARD)``
frees without copying; ``resume`` then gives back zero-filled arrays (the workload rebuilds them).

Arrays must own their memory and be C-contiguous (checked at construction): ``resize`` cannot act
on a view, and a view of a registered array taken by the job would be left pointing at freed memory
after a suspend, so do not keep views of registered arrays across a release.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._tag_queries import TagQueries
from .errors import HandlerError
from .handlers import HandlerResult
from .protocol import SuspendMode

__all__ = ["NumpyOffloadHandler"]

_ALIGN = 64  # each array's bytes start at this alignment inside a tag's host buffer


@dataclass(slots=True)
class _Entry:
    array: np.ndarray[Any, Any]
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # in the tag's host buffer


@dataclass(slots=True)
class _Tag:
    name: str
    entries: list[_Entry] = field(default_factory=list)
    host_size: int = 0
    host: np.ndarray[Any, Any] | None = None  # uint8, reused across cycles
    suspended: SuspendMode | None = None


class NumpyOffloadHandler(TagQueries):
    """Suspends numpy arrays to a host buffer (or drops them) and brings them back; see the module doc.

    ``NumpyOffloadHandler(weights=[...], optimizer=[...])``: one tag per keyword. Thread-safe; a
    repeated suspend (or resume) of a tag that is already suspended (resumed) does nothing.
    """

    def __init__(self, **tags: Sequence[np.ndarray[Any, Any]]) -> None:
        if not tags:
            raise ValueError("nothing to offload: pass arrays by tag, e.g. NumpyOffloadHandler(weights=[w, b])")
        self._tags: dict[str, _Tag] = {}
        self._lock = threading.Lock()
        seen: dict[int, str] = {}
        for name, arrays in tags.items():
            tag = self._tags[name] = _Tag(name)
            for i, a in enumerate(arrays):
                if not isinstance(a, np.ndarray):
                    raise TypeError(f"tag {name!r} item {i}: expected a numpy array, not {type(a).__name__!r}")
                if not a.flags.owndata or not a.flags.c_contiguous or a.base is not None:
                    raise HandlerError(
                        f"tag {name!r} item {i}: the array must own its memory and be C-contiguous "
                        "(not a view); register np.ascontiguousarray(a).copy() instead",
                        tag=name,
                    )
                if id(a) in seen:
                    raise ValueError(
                        f"tag {name!r} item {i}: the same array is already registered under tag {seen[id(a)]!r}"
                    )
                seen[id(a)] = name
                offset = (tag.host_size + _ALIGN - 1) // _ALIGN * _ALIGN
                tag.entries.append(_Entry(a, tuple(a.shape), int(a.nbytes), offset))
                tag.host_size = offset + int(a.nbytes)

    def device_bytes(self, tags: Iterable[str] = ()) -> int:
        """Bytes the selected tags (all when ``tags`` is empty) hold in their arrays now."""
        with self._lock:
            return sum(int(e.array.nbytes) for t in self._select(frozenset(tags)) for e in t.entries)

    def host_bytes(self, tags: Iterable[str] = ()) -> int:
        """Bytes of host buffer the selected tags hold (kept across cycles)."""
        with self._lock:
            return sum(int(t.host.nbytes) for t in self._select(frozenset(tags)) if t.host is not None)

    # ------------------------------------------------------------------ the handler interface

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        mode = SuspendMode(mode)
        with self._lock:
            todo = [t for t in self._select(tags) if t.suspended is None]
            if mode is SuspendMode.OFFLOAD:
                for t in todo:  # copy everything first: nothing is freed until every copy succeeded
                    if t.host is None or t.host.nbytes < t.host_size:
                        t.host = np.empty(t.host_size, dtype=np.uint8)
                    for e in t.entries:
                        t.host[e.offset : e.offset + e.nbytes] = e.array.reshape(-1).view(np.uint8)
            freed = 0
            for t in todo:
                for e in t.entries:
                    e.array.resize(0, refcheck=False)
                    freed += e.nbytes
                t.suspended = mode
            return HandlerResult(bytes_moved=freed if mode is SuspendMode.OFFLOAD else 0, device_bytes_freed=freed)

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        """Bring the selected tags back; what comes back follows the mode they were suspended in."""
        SuspendMode(mode)
        with self._lock:
            moved = taken = 0
            for t in self._select(tags):
                if t.suspended is None:
                    continue
                for e in t.entries:
                    e.array.resize(e.shape, refcheck=False)
                    flat = e.array.reshape(-1).view(np.uint8)
                    if t.suspended is SuspendMode.OFFLOAD and t.host is not None:
                        flat[:] = t.host[e.offset : e.offset + e.nbytes]
                        moved += e.nbytes
                    else:
                        flat[:] = 0
                    taken += e.nbytes
                t.suspended = None
            return HandlerResult(bytes_moved=moved, device_bytes_freed=taken)

    def _suspended(self) -> dict[str, bool]:
        return {n: t.suspended is not None for n, t in self._tags.items()}

    def _select(self, tags: frozenset[str]) -> list[_Tag]:
        if not tags:
            return list(self._tags.values())
        unknown = sorted(tags - self._tags.keys())
        if unknown:
            raise HandlerError(f"unknown tags {unknown}: this handler has {sorted(self._tags)}", tag=unknown[0])
        return [self._tags[n] for n in sorted(tags)]
