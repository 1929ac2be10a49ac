"""The pieces every section of docs/benchmarks.md is written with (``_report``, ``_report_robust``): numbers, goals
met or not, the command of a run, tables."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

__all__ = ["NA", "ROOT", "X", "_cmd", "_met", "_n", "_table"]

ROOT = Path(__file__).resolve().parents[1]
X, NA = "\u00d7", "\u2013"  # the times sign and the dash for "no value", in the document
# A result file's path as the run named it: absolute, under whichever checkout of the repository ran it (another
# worktree's root, not this one's), as typed from the root.
_RESULT_PATH = re.compile(r"(?<!\S)/\S*/(?=bench/results/)")


def _n(x: Any, digits: int = 2, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return f"{NA}"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int | float):
        return f"{x:,.{digits}f}{unit}"
    return str(x)


def _met(ok: bool | None) -> str:
    return f"{NA}" if ok is None else ("met" if ok else "**not met**")


def _cmd(r: dict[str, Any]) -> list[str]:
    m = r.get("machine", {})
    when = m.get("utc") or r.get("date", "?")
    load = m.get("loadavg_1m")
    command = _RESULT_PATH.sub("", str(r.get("command", "?")).replace(f"{ROOT}/", ""))  # as typed from the root
    return [
        "```",
        command,
        "```",
        "",
        f"Run {when}" + (f", 1-min load average {load} at start." if load is not None else "."),
        "",
    ]


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return [*out, ""]
