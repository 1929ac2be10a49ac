"""Subject rules shared by the orchestrator's shell and the invariant checker: which events an input subject may
carry, naming what it names (:func:`check_names`). One copy, so the checker admits exactly what the orchestrator does.
The parsing itself, NATS subject matching and the (group, job) an input subject names, lives beside the builders
of those subjects, in ``timeslice_client._names`` (re-exported here); this check stays here, since it needs the
message types, and ``protocol``, which defines them, imports the builders."""

from __future__ import annotations

from typing import Final

from timeslice_client._names import route, subject_matches
from timeslice_client.protocol import (
    Acquire,
    AgentLost,
    Cancel,
    ClearFault,
    InputEvent,
    JobRegistered,
    JobUnregistered,
    OpResult,
    Phase,
    Release,
    Renew,
    SetPolicy,
    Tick,
)

__all__ = ["check_names", "route", "subject_matches"]

# Which events each kind of input subject carries: a job's requests under its own subject, timers and operator
# inputs under ctl (the verb is the event's tag), an agent's facts under its node's subject. The subject is the
# identity the bus's permissions checked; the payload must say the same (docs/security.md).
_JOB_EVENTS: Final = (Acquire, Release, Renew, Cancel, Phase)
_CTL_EVENTS: Final = (Tick, ClearFault, AgentLost, SetPolicy)
_AGENT_EVENTS: Final = (JobRegistered, JobUnregistered, OpResult)


def _tag(ev: InputEvent) -> str:
    return str(type(ev).__struct_config__.tag)


def check_names(subject: str, ev: InputEvent) -> None:
    """Raise ValueError unless ``ev`` is an event its (routed) input subject may carry, naming the same group, job,
    node and verb as the subject: a job publishes only its own requests, an agent only its own node's facts (the
    permissions let each publish only under its own subject; the payload cannot speak for another)."""
    t = subject.split(".")
    kind, group = t[2], (t[5] if t[2] == "agent" else t[3])
    if ev.group != group:
        raise ValueError(f"payload names group {ev.group!r}, its subject {subject!r} group {group!r}")
    allowed = {"job": _JOB_EVENTS, "ctl": _CTL_EVENTS, "agent": _AGENT_EVENTS}[kind]
    if not isinstance(ev, allowed):
        raise ValueError(  # noqa: TRY004 - a bad event on the wire, not a caller's type error
            f"a {_tag(ev)} event cannot come on {subject!r} (a {kind} subject carries "
            f"{', '.join(str(e.__struct_config__.tag) for e in allowed)})"
        )
    if kind == "agent":
        assert isinstance(ev, _AGENT_EVENTS)
        if ev.node != t[3]:
            raise ValueError(f"payload names node {ev.node!r}, its subject {subject!r} node {t[3]!r}")
        return
    if _tag(ev) != t[-1]:
        raise ValueError(f"a {_tag(ev)} event cannot come on {subject!r} (its verb is {t[-1]!r})")
    if kind == "job" and getattr(ev, "job", None) != t[4]:
        raise ValueError(f"payload names job {getattr(ev, 'job', None)!r}, its subject {subject!r} job {t[4]!r}")
