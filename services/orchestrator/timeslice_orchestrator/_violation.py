"""The exception every invariant check raises (``invariants``, ``_op_facts``)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["InvariantViolation"]


class InvariantViolation(Exception):
    """An invariant does not hold. ``rule`` names it; ``values`` holds what shows it."""

    def __init__(
        self,
        rule: str,
        detail: str,
        *,
        group: str | None = None,
        seq: int | None = None,
        values: Mapping[str, object] | None = None,
    ) -> None:
        self.rule = rule
        self.detail = detail
        self.group = group
        self.seq = seq
        self.values: dict[str, object] = dict(values or {})
        where = ""
        if group is not None:
            where += f" in group {group!r}"
        if seq is not None:
            where += f" at stream seq {seq}"
        shown = "".join(f"\n  {k} = {v!r}" for k, v in self.values.items())
        super().__init__(f"invariant {rule!r} violated{where}: {detail}{shown}")

    def at(self, seq: int) -> InvariantViolation:
        """The same violation, located at stream sequence ``seq``."""
        return InvariantViolation(self.rule, self.detail, group=self.group, seq=seq, values=self.values)
