"""Typed attribute descriptors: ``Forwarded``, a read-only attribute of a facade that reads the attribute of the same
name of the object it wraps (``TimeSliceClient`` over its ``AsyncTimeSliceClient``, a blocking sibling over its async
member), declared in one line each instead of a property apiece that only forwards; and ``Descriptor``, the base it
shares with ``_renamed.RenamedAttribute``: the class gets the descriptor, an instance what ``read`` says."""

from __future__ import annotations

import abc
from typing import Any, Generic, Never, TypeVar, overload

__all__ = ["Descriptor", "Forwarded"]

T = TypeVar("T")


class Descriptor(Generic[T], abc.ABC):
    """An attribute computed by ``read`` each time it is read from an instance; ``name`` is the attribute's own."""

    name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Descriptor[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object, owner: type | None = None) -> Any:
        return self if obj is None else self.read(obj)

    @abc.abstractmethod
    def read(self, obj: object) -> T:
        """The attribute's value on ``obj``."""


class Forwarded(Descriptor[T]):
    """``job_id = Forwarded[str]("_client", "This job's id.")`` in a class body: ``obj.job_id`` reads
    ``obj._client.job_id`` each time (never a copy: the wrapped object's state changes); setting it raises
    ``AttributeError``, as a property without a setter does. ``doc`` is the attribute's docstring."""

    def __init__(self, via: str, doc: str | None = None) -> None:
        self.via = via
        self.__doc__ = doc

    def read(self, obj: object) -> T:
        value: T = getattr(getattr(obj, self.via), self.name)
        return value

    def __set__(self, obj: object, value: Never) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self.name} is read-only")
