"""Subject rules shared by the orchestrator's shell and the invariant checker: NATS subject matching, and
the (group, job) an input subject names. One copy, so the checker admits exactly what the orchestrator does."""

from __future__ import annotations

import functools

from timeslice_client.protocol import validate_id

__all__ = ["route", "subject_matches"]


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` matches one token, a final ``>`` one or more."""
    p = pattern.split(".")
    s = subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(s) == len(p)


@functools.lru_cache(maxsize=16_384)  # on the hot path; a subject's answer never changes (errors are not cached)
def route(subject: str) -> tuple[str, str | None]:
    """(group, job) named by an input subject; raises ValueError for a subject we do not serve."""
    t = subject.split(".")
    if len(t) == 6 and t[2] == "job":
        return validate_id("group", t[3]), validate_id("job", t[4])
    if len(t) == 5 and t[2] == "ctl":
        return validate_id("group", t[3]), None
    if len(t) == 6 and t[2] == "agent" and t[4] == "evt":
        return validate_id("group", t[5]), None
    raise ValueError(f"not an input subject: {subject!r}")
