"""What a ``TorchOffloadHandler`` is given and keeps: its groups (a tag's modules, optimizers and sources, and what a
suspend of them saved), their tensors (plain, for a suspend, or named, for an error), and the refusal of a storage
it could never free (``UnresizableStorage``)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .errors import UnresizableStorage

if TYPE_CHECKING:
    from ._pinned_host import HostBuffer

__all__ = [
    "Group",
    "Precopy",
    "Slot",
    "check_resizable",
    "named_tensors",
    "plain_storage",
    "several",
    "source",
    "storage_key",
    "unresizable",
    "walk",
]


def walk(obj: Any) -> Iterator[Any]:
    """The tensors in ``obj``: a tensor, or a mapping, list or tuple of them (nested)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from walk(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from walk(value)


def _walk_named(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, torch.Tensor):
        yield f"tensor {path}" if path else "the tensor", obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _walk_named(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk_named(value, f"{path}[{i}]")


def named_tensors(
    modules: Iterable[Any], optimizers: Iterable[Any], sources: Iterable[Any], *, call: bool
) -> Iterator[tuple[str, Any]]:
    """Each tensor with words that name it to the user; ``call``: also the tensors callable sources return now."""
    for module in modules:
        kind = type(module).__name__
        for name, param in module.named_parameters():
            yield f"parameter {name!r} of a {kind}", param
            if param.grad is not None:
                yield f"the gradient of parameter {name!r} of a {kind}", param.grad
        for name, buf in module.named_buffers():
            yield f"buffer {name!r} of a {kind}", buf
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items() if isinstance(state, Mapping) else ():
                for _, tensor in _walk_named(value, ""):
                    yield f"optimizer state {key!r} of a {type(optimizer).__name__}", tensor
    for src in sources:
        if not callable(src) or isinstance(src, torch.Tensor):
            yield from _walk_named(src, "")
        elif call:
            yield from _walk_named(src(), "")


def plain_storage(tensor: Any) -> Any:
    """The untyped storage of a strided tensor; None for other layouts and for subclasses without one."""
    if tensor.layout != torch.strided:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # a subclass without a plain storage


def check_resizable(tag: str, named: Iterable[tuple[str, Any]], device_type: str) -> None:
    """Raise ``UnresizableStorage`` for the first tensor on ``device_type`` whose storage holds memory that torch
    will not resize (freeing it at a switch would fail)."""
    for what, tensor in named:
        storage = plain_storage(tensor)
        if storage is None or storage.device.type != device_type or storage.resizable():
            continue
        if int(storage.nbytes()):
            raise UnresizableStorage(tag, what, int(storage.nbytes()))


def unresizable(tag: str, storage: Any, named: Iterable[tuple[str, Any]]) -> UnresizableStorage:
    """The error for ``storage`` (found not resizable at a suspend), naming a tensor of the group on it."""
    ptr = int(storage.data_ptr())
    for what, tensor in named:
        plain = plain_storage(tensor)
        if plain is not None and int(plain.data_ptr()) == ptr:
            return UnresizableStorage(tag, what, int(storage.nbytes()))
    return UnresizableStorage(tag, "a tensor", int(storage.nbytes()))


def several(value: Any, kind: type, what: str, tag: str) -> list[Any]:
    items = [value] if isinstance(value, kind) else list(value)
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(f"{what}[{tag!r}] holds a {type(item).__name__!r}, not a {kind.__module__}.{kind.__name__}")
    return items


def source(value: Any, tag: str) -> Any:
    """Tensors under a tag: a tensor, a list/tuple/dict (kept by reference: read at suspend), or a callable."""
    if isinstance(value, (torch.Tensor, list, tuple, Mapping)) or callable(value):
        return value
    if isinstance(value, Iterable):
        return tuple(value)  # a one-shot iterator: keep what it gives now
    raise TypeError(f"tensors[{tag!r}] must be a tensor, a collection of tensors or a callable returning them")


@dataclass(slots=True)
class Slot:
    """One storage a suspend freed, and where its bytes went."""

    storage: Any  # the torch.UntypedStorage the tensors share (the same object before and after)
    nbytes: int
    host: Any  # uint8 view of the group's host buffer, or None (DISCARD)


@dataclass(slots=True)
class Precopy:
    """A copy of a running group's storages in its host buffer, made while the job was idle (``precopy``): a suspend
    that finds it still ``valid`` only frees the device memory. ``key``: each storage's address and size when copied;
    ``cancelled``: set when the job may have run again since (its next acquire), which makes the copy worthless."""

    slots: list[Slot]
    key: tuple[tuple[int, int], ...]
    cancelled: threading.Event

    def valid(self, found: list[tuple[Any, int]]) -> bool:
        """Whether the copy still stands for the storages a suspend ``found`` (the same ones, not cancelled)."""
        return not self.cancelled.is_set() and self.key == storage_key(found)


def storage_key(found: list[tuple[Any, int]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(storage.data_ptr()), nbytes) for storage, nbytes in found)


@dataclass(slots=True)
class Group:
    """One tag's objects: what the handler was given under it, and what a suspend of it saved."""

    tag: str
    modules: list[Any] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    sources: list[Any] = field(default_factory=list)  # tensors, containers of tensors, callables
    saved: list[Slot] | None = None  # set while suspended
    host: HostBuffer | None = None  # cached: reused across cycles; registered: released at the resume
    precopied: Precopy | None = None  # a copy made while running but idle, for the next suspend (see Precopy)

    def tensors(self) -> Iterator[Any]:
        for module in self.modules:
            for param in module.parameters():
                yield param
                if param.grad is not None:
                    yield param.grad
            yield from module.buffers()
        for optimizer in self.optimizers:
            yield from walk(list(optimizer.state.values()))
        for src in self.sources:
            yield from walk(src() if callable(src) and not isinstance(src, torch.Tensor) else src)

    def named(self, *, call: bool) -> Iterator[tuple[str, Any]]:
        """The tensors with words naming them (for errors); ``call``: also those callable sources return now."""
        return named_tensors(self.modules, self.optimizers, self.sources, call=call)
