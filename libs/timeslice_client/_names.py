"""Ids and subjects: the rule every group/job/node id follows, the builders that put ids into subjects
(re-exported by :mod:`timeslice_client.protocol`, where the subject layout is described), and beside them the
parsing back: NATS subject matching (:func:`subject_matches`) and the (group, job) an input subject names
(:func:`route`). The orchestrator's ``_subjects`` checks a payload against its subject with them."""

from __future__ import annotations

import functools
import re
from typing import Final

from .errors import InvalidId

__all__ = ["AGENT_JOB_VERBS", "AGENT_NODE_VERBS", "route", "subject_matches", "subjects", "validate_id"]

_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
AGENT_JOB_VERBS: Final = ("register", "unregister")  # ts.rpc.agent.<node>.<verb>.<job>
AGENT_NODE_VERBS: Final = ("clear_fault", "status")  # ts.rpc.agent.<node>.<verb>
_ID_RULE: Final = "1 to 64 characters of A-Z a-z 0-9 _ -, starting with a letter or digit"


def validate_id(kind: str, value: object) -> str:
    """Return ``value`` if it is a safe group/job/node id, else raise :class:`InvalidId`."""
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        raise InvalidId(kind, value, _ID_RULE)
    return value


class _Subjects:
    """Subject builders. Every id is validated before it reaches a subject."""

    def job(self, group: str, job: str, verb: str) -> str:
        return f"ts.v1.job.{validate_id('group', group)}.{validate_id('job', job)}.{verb}"

    def job_inputs(self, group: str) -> str:
        """Every job's requests to one group (the filter a claim's sequence check names)."""
        return f"ts.v1.job.{validate_id('group', group)}.>"

    def ctl(self, group: str, verb: str) -> str:
        return f"ts.v1.ctl.{validate_id('group', group)}.{verb}"

    def agent_event(self, node: str, group: str) -> str:
        return f"ts.v1.agent.{validate_id('node', node)}.evt.{validate_id('group', group)}"

    def notice(self, group: str, job: str) -> str:
        return f"ts.v1.notice.{validate_id('group', group)}.{validate_id('job', job)}"

    def agent_cmd(self, node: str) -> str:
        return f"ts.v1.agent.{validate_id('node', node)}.cmd"

    def group_state(self, group: str) -> str:
        return f"ts.v1.group.{validate_id('group', group)}.state"

    def group_quarantine(self, group: str) -> str:
        """The orchestrator stopped (or resumed) serving a group whose record is unusable (``Quarantined``)."""
        return f"ts.v1.group.{validate_id('group', group)}.quarantine"

    quarantines: Final = "ts.v1.group.*.quarantine"

    def agent_op(self, node: str) -> str:
        """Agent operation starts (facts for people and replay; not an orchestrator input)."""
        return f"ts.v1.agent.{validate_id('node', node)}.op"

    def agent_rpc(self, node: str, verb: str, job: str | None = None) -> str:
        """Request/reply to an agent, outside the stream: ``register`` and ``unregister`` name the job
        (``ts.rpc.agent.<node>.register.<job>``: the subject's job is the one the agent acts for, and permissions
        let only that job publish there), ``clear_fault`` (admin) and ``status`` (reader) do not."""
        n = validate_id("node", node)
        if verb in AGENT_JOB_VERBS:
            if job is None:
                raise ValueError(f"agent request {verb!r} names its job: agent_rpc(node, {verb!r}, job)")
            return f"ts.rpc.agent.{n}.{verb}.{validate_id('job', job)}"
        if verb not in AGENT_NODE_VERBS or job is not None:
            raise ValueError(
                f"agent request {verb!r}{' for a job' if job is not None else ''} does not exist; "
                f"the verbs are {', '.join(AGENT_JOB_VERBS)} (with a job) and "
                f"{', '.join(AGENT_NODE_VERBS)} (without)"
            )
        return f"ts.rpc.agent.{n}.{verb}"

    def agent_rpc_jobs(self, node: str, verb: str) -> str:
        """What an agent subscribes to for a per-job verb: ``ts.rpc.agent.<node>.<verb>.*``."""
        if verb not in AGENT_JOB_VERBS:
            raise ValueError(f"{verb!r} is not a per-job agent request ({', '.join(AGENT_JOB_VERBS)})")
        return f"ts.rpc.agent.{validate_id('node', node)}.{verb}.*"

    def workload_rpc(self, node: str, job: str) -> str:
        """Agent → registered workload: suspend/resume requests."""
        return f"ts.rpc.workload.{validate_id('node', node)}.{validate_id('job', job)}"

    # Filters the orchestrator consumes (its inputs).
    inputs: Final = ("ts.v1.job.>", "ts.v1.ctl.>", "ts.v1.agent.*.evt.>")
    all_events: Final = "ts.v1.>"

    def group_filter(self, group: str) -> tuple[str, ...]:
        g = validate_id("group", group)
        return (
            f"ts.v1.job.{g}.>",
            f"ts.v1.ctl.{g}.>",
            f"ts.v1.agent.*.evt.{g}",
            f"ts.v1.notice.{g}.>",
            f"ts.v1.group.{g}.>",
        )


subjects: Final = _Subjects()


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
