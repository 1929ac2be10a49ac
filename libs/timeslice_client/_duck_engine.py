"""Duck typing of the engine objects the in-process engine handlers (``vllm_engine``, ``sglang_engine``) are given:
those modules never import the engines, so they check the methods they call and read the settings they depend on
by name, tolerating the attributes that other engine versions lack."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from .errors import MissingEngineMethod

__all__ = ["attribute", "require_methods"]

_MISSING: Final = object()


def require_methods(obj: object, engine: str, methods: Iterable[str], hint: str) -> None:
    """Refuse ``obj`` unless each of ``methods`` is a callable attribute of it."""
    for name in methods:
        if not callable(getattr(obj, name, None)):
            raise MissingEngineMethod(engine, type(obj).__name__, name, hint)


def attribute(obj: object, path: str) -> object:
    """``obj.a.b.c`` for ``path`` ``"a.b.c"``, or ``None`` when any link is missing (an engine of another version)."""
    for name in path.split("."):
        obj = getattr(obj, name, _MISSING)
        if obj is _MISSING:
            return None
    return obj
