"""The wire types of a group's scheduling policy: an operator sets it (``SetPolicy``), and the orchestrator asks a
holder to yield once it has held past the policy's quantum while others wait (``YieldRequested``).

Apart from ``protocol`` so that it stays within its size; ``protocol`` puts them in its unions and exports them.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from ._bounds import Count, Id, Ms

__all__ = ["MAX_QUANTUM_MS", "SetPolicy", "YieldRequested"]

MAX_QUANTUM_MS: Final = 7 * 24 * 3600 * 1000  # a week: longer is no quantum


class _Msg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class SetPolicy(_Msg, frozen=True, tag="set_policy"):
    """An operator sets a group's scheduling policy (``ts.v1.ctl.<group>.set_policy``: the admin identity only).
    ``quantum_ms``: how long a holder holds while others wait before the orchestrator asks it to yield
    (``YieldRequested``); 0: never asked. The priority classes of the waiters need no setting (``Acquire.priority``)."""

    group: Id
    quantum_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_QUANTUM_MS)] = 0


class YieldRequested(_Msg, frozen=True, tag="yield_requested"):
    """``job`` has held the group at ``epoch`` for ``held_ms``, past the group's quantum, while ``waiters`` wait: it
    is asked to release at its next phase boundary. A request, never a revocation: the hold stays valid until it
    releases (or its lease lapses). Sent once per hold."""

    group: Id
    job: Id
    epoch: Count
    held_ms: Ms
    quantum_ms: Ms
    waiters: Count
