"""Old keyword names kept working for one release after a rename (docs/architecture.md, "Names and units").

A call that uses an old name gets a ``DeprecationWarning`` that names the new one, and the value goes to the new
name; giving both is a ``TypeError``, as Python says of a keyword given twice. An attribute renamed with them reads
(and sets) on under its old name through ``RenamedAttribute``, with the same warning."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import ParamSpec, TypeVar

from ._descriptors import Descriptor

__all__ = ["RenamedAttribute", "rename_keywords", "renamed_keywords"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def rename_keywords(
    kwargs: MutableMapping[str, object], renamed: Mapping[str, str], call: str, *, stacklevel: int = 3
) -> None:
    """Move each old name of ``renamed`` (old -> new) in ``kwargs`` to its new name, warning of each (``stacklevel``:
    as ``warnings.warn``'s, counted from here: 3, the default, is the caller of a ``renamed_keywords`` wrapper)."""
    for old, new in renamed.items():
        if old not in kwargs:
            continue
        if new in kwargs:
            raise TypeError(f"{call}() got both {old!r} (deprecated) and {new!r}")
        warnings.warn(f"{call}(): {old}= is deprecated, use {new}=", DeprecationWarning, stacklevel=stacklevel)
        kwargs[new] = kwargs.pop(old)


def renamed_keywords(**renamed: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function whose keywords were renamed (``old="new"``, ...): the old names still work, with a
    ``DeprecationWarning``. Type checkers see only the new names."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            # a constructor is named by the class called (a subclass's, where a base class's __init__ is wrapped)
            call = type(args[0]).__name__ if fn.__name__ == "__init__" and args else fn.__qualname__
            rename_keywords(kwargs, renamed, call)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


class RenamedAttribute(Descriptor[T]):
    """An attribute's old name, kept for one release: ``old = RenamedAttribute[float]("old_s")`` in the class body
    reads and sets ``old_s``, each time with a ``DeprecationWarning`` that names it."""

    def __init__(self, new: str) -> None:
        self.new = new

    def _warn(self, obj: object, stacklevel: int) -> None:
        warnings.warn(
            f"{type(obj).__name__}.{self.name} is deprecated, use {self.new}", DeprecationWarning, stacklevel=stacklevel
        )

    def read(self, obj: object) -> T:
        self._warn(obj, stacklevel=4)  # _warn, read, Descriptor.__get__, then the code that read it
        value: T = getattr(obj, self.new)
        return value

    def __set__(self, obj: object, value: T) -> None:
        self._warn(obj, stacklevel=3)
        setattr(obj, self.new, value)
