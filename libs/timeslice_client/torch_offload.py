"""A ready-made handler that moves PyTorch state off the accelerator and back.

::

    from timeslice_client.torch_offload import TorchOffloadHandler

    handler = TorchOffloadHandler(
        modules={"weights": model},
        optimizers={"optimizer": opt},
        tensors={"kv_cache": [k_cache, v_cache]},
    )
    # or, shorter: TorchOffloadHandler(model, opt)  -> tags "weights" and "optimizer"

Each tag names a group of state: the parameters, buffers and gradients of modules, the state tensors of
optimizers (read at suspend time, so state created lazily by the first ``step()`` is included) and
extra tensors (a tensor, a list/tuple/dict of them, or a callable returning them, read at suspend time).

``suspend(OFFLOAD)`` copies every device *storage* of the selected groups (storages shared by views or
tied weights once) into one host buffer per group, then frees the device memory with ``resize_(0)``: the
tensors, Parameters, views and optimizer state entries stay the same Python objects, they just hold no
memory. ``resume`` re-allocates each storage at its size and copies the bytes back, bit-exact. On CUDA the host
buffer is by default exactly the group's bytes, pinned by registration (``host_memory``, below).
``suspend(DISCARD)`` frees without copying and ``resume`` gives back zero-filled memory (the workload
rebuilds it). Copies go in chunks (``chunk_bytes``); on CUDA they are queued on a dedicated stream, so
successive chunks and storages go back to back while earlier storages are freed.

"The device" is CUDA when ``torch.cuda.is_available()`` (only CUDA tensors are touched); otherwise CPU
tensors play its part, so the whole path runs (and is tested) on machines without an accelerator. On CPU
the memory a resume re-allocates is fresh from the kernel, which faults and zeroes it on first touch;
the handler asks for transparent huge pages there (and on its host buffers): faster warm resumes, slower cold
ones (bench/NOTES.md). :meth:`TorchOffloadHandler.prepare` allocates the host buffers ahead of the first suspend.

:func:`timeslice_client.torch_swap.swap` switches two handlers of one process (e.g. a colocated trainer and
rollout engine): on CUDA, when the incoming state fits beside the outgoing one, the outgoing device-to-host and
the incoming host-to-device copies run at the same time (PCIe is full duplex), each on its handler's own stream.

Limits: sparse tensors and tensor subclasses without a plain storage (e.g. ``DTensor`` wrappers) are
skipped; a storage that cannot be resized (memory borrowed from numpy, shared memory) could never be freed:
the handler refuses it when it is made (``UnresizableStorage``, naming the tensor). On CPU, calling
``tensor.numpy()`` (or ``np.asarray(tensor)``) once marks that tensor's storage non-resizable for good (a torch
rule): register tensors before any ``.numpy()`` and log ``tensor.detach().clone().numpy()`` instead, or the next
suspend is refused with the same error (before anything moves; the job faulted). A storage shared between groups
belongs to the group that suspended it.

Between holds, once the job was switched out, the registered tensors hold no memory (their storages are resized
to 0 until the resume at the job's next grant), and torch does not check: reading them then raises, returns
garbage or crashes the process. Read or save them inside a hold; ``client.close()`` does not resume them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

import torch

from ._pinned_host import HostBuffer, HostMemory, HostMemoryKind, HostRegistrar
from ._tag_queries import TagQueries
from ._torch_copies import FOREACH_ZERO, ByteCopies, bytes_of
from ._torch_state import (
    Group,
    Precopy,
    Slot,
    check_resizable,
    plain_storage,
    several,
    source,
    storage_key,
    unresizable,
)
from .errors import HandlerError
from .handlers import HandlerResult
from .protocol import SuspendMode

__all__ = ["CPU_CHUNK_BYTES", "CUDA_CHUNK_BYTES", "HostRegistrar", "TorchOffloadHandler"]

CUDA_CHUNK_BYTES: Final = 64 << 20
# On CPU every copy_ is a parallel region whose threads meet at a barrier; on a busy machine each barrier
# waits for a descheduled thread, so small chunks cost (64 MiB: ~20% slower than 512 MiB, measured).
CPU_CHUNK_BYTES: Final = 512 << 20
WEIGHTS: Final = "weights"  # tag of modules passed positionally
OPTIMIZER: Final = "optimizer"  # tag of optimizers passed positionally
TENSORS: Final = "tensors"  # tag of tensors passed positionally

_SMALL: Final = 1 << 20  # storages below this are packed at 64-byte alignment, larger ones at 4 KiB


def _align(offset: int, nbytes: int) -> int:
    a = 64 if nbytes < _SMALL else 4096
    return (offset + a - 1) // a * a


# --------------------------------------------------------------------------- the handler


class TorchOffloadHandler(TagQueries, ByteCopies):
    """Suspends PyTorch state to host memory (or drops it) and brings it back; see the module doc.

    ``TorchOffloadHandler(*objects, modules=..., optimizers=..., tensors=...)``: positional modules go
    under the tag ``"weights"``, optimizers under ``"optimizer"``, tensors (or lists of them) under
    ``"tensors"``; the keyword mappings give tags of your own (a value may be one object or several).
    A tag may gather modules, optimizers and tensors together.

    ``chunk_bytes``: the largest single copy (default 64 MiB on CUDA, 512 MiB on CPU). ``empty_cache``:
    on CUDA, hand the freed blocks back to the driver after a suspend (so another process can use them).
    ``device``: whose tensors are suspended, ``"cuda"`` or ``"cpu"``; by default CUDA when available,
    else CPU tensors stand in for the device.

    ``host_memory``: ``"registered"`` (default on CUDA): one buffer per group of exactly its bytes, pinned by one
    ``cudaHostRegister``, kept for the next suspend (``keep_host_buffers=False``: freed at each resume) until
    ``release_host_buffers``, ``drop_saved``, a discard or a failed suspend; ``"cached"`` (default on CPU): torch's
    pinned allocator (power-of-two sizes). A failed registration is logged once, then torch's allocator is used.
    ``registrar``: what pins (``register(ptr, nbytes)``, ``unregister(ptr)``): CUDA's by default, none on CPU.
    """

    def __init__(
        self,
        *objects: Any,
        modules: Mapping[str, Any] | None = None,
        optimizers: Mapping[str, Any] | None = None,
        tensors: Mapping[str, Any] | None = None,
        chunk_bytes: int | None = None,
        empty_cache: bool = True,
        device: str | None = None,
        host_memory: HostMemoryKind | None = None,
        registrar: HostRegistrar | None = None,
        keep_host_buffers: bool = True,
    ) -> None:
        if chunk_bytes is not None and chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in {"cuda", "cpu"} or (device == "cuda" and not torch.cuda.is_available()):
            raise ValueError(f"device must be 'cuda' (when available) or 'cpu', not {device!r}")
        self.chunk_bytes = chunk_bytes or (CUDA_CHUNK_BYTES if device == "cuda" else CPU_CHUNK_BYTES)
        self.empty_cache = empty_cache  # CUDA: return freed blocks to the driver after a suspend
        self._cuda = device == "cuda"
        self.keep_host_buffers = keep_host_buffers  # registered: kept for the next suspend, else freed at resume
        self._host = HostMemory(
            host_memory or ("registered" if self._cuda else "cached"), pinned=self._cuda, registrar=registrar
        )
        # CPU: all copies in one call, then all frees (``_copy_all``); CUDA: per storage on a side stream, each
        # freed once its copy is done. Tests run the per-storage path on CPU tensors too.
        self._batched = not self._cuda
        self._device_type = device
        self._groups: dict[str, Group] = {}
        self._streams: dict[int, Any] = {}
        self._lock = threading.RLock()
        self.precopied_suspends = 0  # suspends that only freed memory, as a precopy had copied it already

        for obj in objects:
            if isinstance(obj, torch.nn.Module):
                self._group(WEIGHTS).modules.append(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                self._group(OPTIMIZER).optimizers.append(obj)
            elif isinstance(obj, (torch.Tensor, list, tuple, Mapping)):
                self._group(TENSORS).sources.append(obj)
            else:
                raise TypeError(
                    f"cannot offload {type(obj).__name__!r}: pass torch modules, optimizers or tensors "
                    "(or give tags with modules=, optimizers=, tensors=)"
                )
        for tag, value in (modules or {}).items():
            self._group(tag).modules.extend(several(value, torch.nn.Module, "modules", tag))
        for tag, value in (optimizers or {}).items():
            self._group(tag).optimizers.extend(several(value, torch.optim.Optimizer, "optimizers", tag))
        for tag, value in (tensors or {}).items():
            self._group(tag).sources.append(source(value, tag))
        if not self._groups:
            raise ValueError("nothing to offload: pass modules, optimizers or tensors")
        for group in self._groups.values():  # memory a switch could never free (e.g. after .numpy()): say so now
            check_resizable(group.tag, group.named(call=False), device)

    # ------------------------------------------------------------------ queries

    def device_bytes(self, tags: Iterable[str] = ()) -> int:
        """Bytes the selected groups (all when ``tags`` is empty) hold on the device now."""
        with self._lock:
            seen: set[int] = set()
            total = 0
            for group in self._select(frozenset(tags)):
                for storage, nbytes in self._live(group, seen):
                    del storage
                    total += nbytes
            return total

    def saved_bytes_by_device(self, tags: Iterable[str] = ()) -> dict[int, int]:
        """Device bytes a resume of the selected suspended groups will allocate, by CUDA device index
        (index 0 for the CPU stand-in)."""
        with self._lock:
            need: dict[int, int] = {}
            for group in self._select(frozenset(tags)):
                for slot in group.saved or ():
                    index = slot.storage.device.index or 0
                    need[index] = need.get(index, 0) + slot.nbytes
            return need

    @property
    def is_cuda(self) -> bool:
        return self._cuda

    def host_bytes(self, tags: Iterable[str] = ()) -> int:
        """Bytes of host buffer the selected groups hold (cached ones are kept across cycles, see
        ``release_host_buffers``; registered ones only while suspended, or prepared)."""
        with self._lock:
            return sum(g.host.nbytes for g in self._select(frozenset(tags)) if g.host is not None)

    @property
    def host_memory_in_use(self) -> HostMemoryKind:
        """What the next host buffer will be (``"cached"`` after a fallback, ``host_memory_fallback`` says why)."""
        return self._host.in_use

    @property
    def host_memory_fallback(self) -> str | None:
        return self._host.fallback_reason

    # ------------------------------------------------------------------ host buffers

    def prepare(self, tags: Iterable[str] = ()) -> int:
        """Allocate (and touch) the host buffers the selected running groups need now; returns their bytes.

        Optional: a suspend allocates what is missing itself, but doing it ahead keeps the first
        suspend as fast as the later ones.
        """
        with self._lock:
            seen: set[int] = set()
            total = 0
            for group in self._select(frozenset(tags)):
                if group.saved is not None:
                    continue
                found = self._live(group, seen)
                size = 0
                for _, nbytes in found:
                    size = _align(size, nbytes) + nbytes
                if size:
                    fresh = group.host is None or not group.host.fits(size)
                    host = self._host_buffer(group, size)
                    if fresh and not self._cuda:  # (on CUDA allocating or registering pinned memory faults it in)
                        host.tensor.zero_()  # fault the pages in now rather than during the first suspend
                    total += host.nbytes
            return total

    def release_host_buffers(self) -> int:
        """Free the host buffers of groups that are not suspended; returns the bytes released."""
        with self._lock:
            released = cached = 0
            for group in self._groups.values():
                if group.saved is None and group.host is not None:
                    group.precopied = None  # it lay in this buffer
                    released += group.host.nbytes
                    cached += group.host.cached
                    self._release(group)
            if cached and self._cuda:
                getattr(torch._C, "_host_emptyCache", lambda: None)()  # torch's cached pinned blocks go too
            return released

    def drop_saved(self, tags: Iterable[str] = ()) -> int:
        """Forget the host copy of the selected suspended groups without resuming them; returns the host bytes
        released. Their tensors stay without memory (as after a suspend): rebuild them before use."""
        with self._lock:
            released = 0
            for group in self._select(frozenset(tags)):
                if group.saved is not None:
                    group.saved = None
                    released += group.host.nbytes if group.host is not None else 0
                    self._release(group)
            return released

    def precopy(self, tags: frozenset[str], cancelled: threading.Event | None = None) -> HandlerResult:
        """Copy the selected running groups to their host buffers and keep them on the device: made while the job
        is idle (it released the group, and another job is expected to take it), so that the next
        ``suspend(OFFLOAD)`` only frees the device memory. ``cancelled``: set it when the job may run again (its
        next acquire); the copy then stops at its next chunk and is never used. Returns the bytes copied.

        Holds the handler for its length: a suspend that comes meanwhile waits for it, then uses it. The job must
        leave the tensors alone between its release and its next acquire (the rule of every hold): a copy made
        while they changed is used only if ``cancelled`` was set before they did."""
        stop = cancelled if cancelled is not None else threading.Event()
        with self._lock:
            seen: set[int] = set()
            plans: list[tuple[Group, list[tuple[Any, int]], list[Slot]]] = []
            for group in self._select(frozenset(tags)):
                group.precopied = None
                if group.saved is not None:
                    continue
                found = self._live(group, seen)
                if found:
                    plans.append((group, found, self._slots(group, found, offload=True)))
            self._sync_devices([slot for _, _, plan in plans for slot in plan])  # the job's last kernels
            copied = 0
            for group, found, plan in plans:
                for slot in plan:
                    with self._on_stream(slot.storage):
                        done = self._copy_bytes(slot.host, bytes_of(slot.storage), stop)
                    copied += done
                    self._sync_streams()  # (CUDA) one storage queued at a time: a cancel waits for that one only
                    if done < slot.nbytes:  # cancelled
                        return HandlerResult(bytes_moved=copied)
                group.precopied = Precopy(plan, storage_key(found), stop)
            return HandlerResult(bytes_moved=copied)

    # ------------------------------------------------------------------ the handler interface

    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return self._suspend(mode, tags, sync_device=True)

    def _suspend(self, mode: SuspendMode, tags: frozenset[str], *, sync_device: bool) -> HandlerResult:
        """``sync_device=False``: the caller synchronized the devices already (``swap``: a device-wide
        synchronize here would wait for the incoming job's copies)."""
        offload = SuspendMode(mode) == SuspendMode.OFFLOAD  # (a plain "offload"/"discard" string works too)
        with self._lock:
            groups = [g for g in self._select(frozenset(tags)) if g.saved is None]
            if not groups:
                return HandlerResult()
            # Plan everything (and allocate host buffers) before anything moves.
            seen: set[int] = set()
            plans: list[tuple[Group, list[Slot]]] = []
            copied: list[Slot] = []  # copied while the job was idle (precopy): only freed now
            try:
                for group in groups:
                    found = self._live(group, seen)
                    for storage, _ in found:
                        if not storage.resizable():  # e.g. .numpy() was called on it since the handler was made
                            raise unresizable(group.tag, storage, group.named(call=True))
                    pre, group.precopied = group.precopied, None
                    if offload and pre is not None and pre.valid(found):
                        plans.append((group, pre.slots))
                        copied += pre.slots
                    else:
                        plans.append((group, self._slots(group, found, offload)))
                slots = [slot for _, plan in plans for slot in plan]
                if sync_device:
                    self._sync_devices(slots)
                self._free_all(slots, offload, copied={id(slot) for slot in copied})  # (or rolled back)
                if copied:
                    self.precopied_suspends += 1
            except BaseException:
                plans, slots = [], []  # the buffers' views, before the buffers go
                for group in groups:
                    self._release(group, keep_cached=True)
                raise
            for group, plan in plans:
                group.saved = plan
                if not offload:
                    self._release(group, keep_cached=True)  # a prepared exact buffer: the state is dropped
            if self._cuda and self.empty_cache:
                torch.cuda.empty_cache()
            total = sum(slot.nbytes for slot in slots)
            return HandlerResult(bytes_moved=total if offload else 0, device_bytes_freed=total)

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        """Bring the selected suspended groups back; what comes back follows the mode they were suspended in."""
        SuspendMode(mode)  # validated only: bytes kept on the host come back, dropped ones come back zeroed
        with self._lock:
            groups = [g for g in self._select(frozenset(tags)) if g.saved is not None]
            if not groups:
                return HandlerResult()
            slots = [slot for g in groups for slot in g.saved or ()]
            self._restore_all(slots)  # on failure the groups stay suspended, their host buffers kept
            moved, freed = sum(s.nbytes for s in slots if s.host is not None), sum(s.nbytes for s in slots)
            del slots
            for group in groups:
                group.saved = None
                if not self.keep_host_buffers:  # copies done: exact buffers go back to the OS now
                    self._release(group, keep_cached=True)
            return HandlerResult(bytes_moved=moved, device_bytes_freed=freed)

    # ------------------------------------------------------------------ internals

    def _group(self, tag: str) -> Group:
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"a tag must be a non-empty string, not {tag!r}")
        group = self._groups.get(tag)
        if group is None:
            group = self._groups[tag] = Group(tag)
        return group

    def _suspended(self) -> dict[str, bool]:
        return {tag: g.saved is not None for tag, g in self._groups.items()}

    def _select(self, tags: frozenset[str]) -> list[Group]:
        if not tags:
            return list(self._groups.values())
        return [g for tag, g in self._groups.items() if tag in tags]

    def _live(self, group: Group, seen: set[int]) -> list[tuple[Any, int]]:
        """The group's device storages that hold memory, each once (also across calls sharing ``seen``)."""
        found: list[tuple[Any, int]] = []
        for tensor in group.tensors():
            storage = plain_storage(tensor)
            if storage is None or storage.device.type != self._device_type:
                continue
            nbytes = int(storage.nbytes())
            if nbytes == 0:
                continue
            ptr = int(storage.data_ptr())
            if ptr in seen:
                continue
            seen.add(ptr)
            found.append((storage, nbytes))
        return found

    def _slots(self, group: Group, found: list[tuple[Any, int]], offload: bool) -> list[Slot]:
        if not offload:
            return [Slot(storage, nbytes, None) for storage, nbytes in found]
        offsets: list[int] = []
        size = 0
        for _, nbytes in found:
            size = _align(size, nbytes)
            offsets.append(size)
            size += nbytes
        if not found:
            return []
        host = self._host_buffer(group, size).tensor
        return [
            Slot(storage, nbytes, host[off : off + nbytes])
            for (storage, nbytes), off in zip(found, offsets, strict=True)
        ]

    def _host_buffer(self, group: Group, nbytes: int) -> HostBuffer:
        if group.host is not None and group.host.fits(nbytes):
            return group.host
        self._release(group)  # drop the old buffer before allocating its successor
        group.host = self._host.allocate(nbytes)
        return group.host

    def _release(self, group: Group, *, keep_cached: bool = False) -> None:
        """Let go of the group's host buffer (``keep_cached``: unless it is a cached one, kept for reuse)."""
        if group.host is not None and not (keep_cached and group.host.cached):
            buf, group.host = group.host, None
            self._host.release(buf)

    def _stream(self, device: Any) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            factory: Any = torch.cuda.Stream  # untyped in torch's annotations
            stream = self._streams[index] = factory(device=index)
        return stream

    def _sync_devices(self, slots: list[Slot]) -> None:
        """CUDA: let every kernel the job queued finish before its tensors are read or freed."""
        if self._cuda:
            for index in sorted({s.storage.device.index or 0 for s in slots}):
                torch.cuda.synchronize(index)

    def _sync_streams(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    @contextlib.contextmanager
    def _on_stream(self, storage: Any) -> Iterator[None]:
        if not self._cuda:
            yield
            return
        with torch.cuda.device(storage.device), torch.cuda.stream(self._stream(storage.device)):
            yield

    def _free_all(self, slots: list[Slot], offload: bool, copied: set[int] | frozenset[int] = frozenset()) -> None:
        """Copy out (if ``offload``; not the slots whose ids are in ``copied``, on the host already) and free every
        slot; on any failure put back what was freed and raise."""
        if self._batched:
            self._free_all_batched(slots, offload, copied)
            return
        pending: list[tuple[Slot, Any]] = []  # CUDA: copied out once its event has fired
        with self._freeing() as free:
            for slot in slots:
                if not offload or id(slot) in copied:
                    free(slot)
                    continue
                with self._on_stream(slot.storage):
                    self._copy_bytes(slot.host, bytes_of(slot.storage))
                    event = None
                    if self._cuda:
                        new_event: Any = torch.cuda.Event  # untyped in torch's annotations
                        event = new_event()
                        event.record()
                pending.append((slot, event))
                # Free the previous storage while this one's copies run (CUDA); at once on CPU.
                while pending and (len(pending) > 1 or pending[0][1] is None):
                    done, event = pending.pop(0)
                    if event is not None:
                        event.synchronize()
                    free(done)
            self._sync_streams()
            for done, _ in pending:
                free(done)

    def _free_all_batched(self, slots: list[Slot], offload: bool, copied: set[int] | frozenset[int]) -> None:
        """``_free_all`` batched (CPU): every copy first, in one call (``_copy_all``), then every free."""
        with self._freeing() as free:
            if offload:
                self._copy_all([(slot.host, bytes_of(slot.storage)) for slot in slots if id(slot) not in copied])
            for slot in slots:
                free(slot)

    @contextlib.contextmanager
    def _freeing(self) -> Iterator[Callable[[Slot], None]]:
        """A block that frees slots with the function it gets; a failure in it puts back what it freed and raises."""
        freed: list[Slot] = []

        def free(slot: Slot) -> None:
            slot.storage.resize_(0)
            freed.append(slot)

        try:
            yield free
        except BaseException as exc:
            self._put_back(freed, exc)
            raise

    def _put_back(self, freed: list[Slot], exc: BaseException) -> None:
        """Roll back a failed suspend: re-allocate the freed storages and copy their bytes back."""
        with contextlib.suppress(Exception):
            self._sync_streams()  # copies still queued when the failure came
        try:
            self._refill(freed, [])
        except BaseException as rollback:
            raise HandlerError(
                f"suspend failed ({exc!r}) and rolling back failed too ({rollback!r}); the job's tensors are "
                "in an unknown state, restart it"
            ) from rollback
        dropped = sum(slot.host is None for slot in freed)
        if dropped:
            raise HandlerError(
                f"discarding failed ({exc!r}); {dropped} storages were already dropped and are back "
                "zero-filled: rebuild them"
            ) from exc

    def _restore_all(self, slots: list[Slot]) -> None:
        """Re-allocate and refill every slot; on failure free them again (still suspended) and raise."""
        allocated: list[Slot] = []
        try:
            self._refill(slots, allocated)
        except BaseException:
            with contextlib.suppress(Exception):
                self._sync_streams()
            for slot in allocated:
                with contextlib.suppress(Exception):
                    slot.storage.resize_(0)
            raise

    def _refill(self, slots: list[Slot], allocated: list[Slot]) -> None:
        """Re-allocate every slot's storage (appending it to ``allocated``), then copy its bytes back or zero it."""
        for slot in slots:
            self._allocate(slot.storage, slot.nbytes)
            allocated.append(slot)
        if self._cuda:  # the memory came from the current stream's pool: copy only once that stream is past it
            for index in sorted({slot.storage.device.index or 0 for slot in slots}):
                self._stream(torch.device("cuda", index)).wait_stream(torch.cuda.current_stream(index))
        if self._batched:
            self._copy_all([(bytes_of(slot.storage), slot.host) for slot in slots if slot.host is not None])
            dropped = [bytes_of(slot.storage) for slot in slots if slot.host is None]
            if dropped and FOREACH_ZERO is not None:
                FOREACH_ZERO(dropped)
            else:
                for t in dropped:
                    t.zero_()
            return
        for slot in slots:
            with self._on_stream(slot.storage):
                if slot.host is not None:
                    self._copy_bytes(bytes_of(slot.storage), slot.host)
                else:
                    bytes_of(slot.storage).zero_()
        self._sync_streams()
