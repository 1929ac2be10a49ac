"""What each identity on the bus may publish and subscribe to: the permission sets written into user JWTs.

Derived from the subjects and JetStream API calls the code makes (``libs/timeslice_client/_names.py`` and every
``js.*``/``kv.*`` call in the client, the agent and the orchestrator):

- **job J** publishes its own requests (``ts.v1.job.<G>.J.<verb>``, every group or only its ``--group``\\ s), asks
  the agents to register/unregister *itself* (``ts.rpc.agent.*.register.J``), hears only its own notices and its
  own workload commands, and reads the lock records, agents, job states and the event stream.
- **agent N** consumes its command subject through its own durable consumer (``agent-N``), publishes its events
  and operation starts, writes its own keys in ``agents`` (``N``) and ``jobs`` (``N.*``), asks workloads on its
  node only (``ts.rpc.workload.N.*``), answers its RPCs, and forwards a fault clear to the orchestrator.
- **orchestrator**: the whole ``ts.`` tree, the JetStream API, the buckets. It alone may publish notices (grants,
  revocations), agent commands and group states. It also runs the in-process agent of ``timeslice up`` and the
  gRPC shim, which acts for the jobs that authenticated on gRPC.
- **admin**: the reader's rights plus clearing faults (``ts.v1.ctl.*.clear_fault``, ``ts.rpc.agent.*.clear_fault``) and
  setting a group's policy (``ts.v1.ctl.*.set_policy``).
- **reader**: reads only (records, stream, ``ts.rpc.agent.*.status``).
- **local**: the single user of a ``timeslice up`` machine: every job and the admin, never the orchestrator's or an
  agent's rights.

Consumers: a push consumer delivers the stream's messages to any subject its creator names, whatever that
creator may publish (nats-server 2.15 checks only that the subject is outside the stream). A job, which can store
any payload under its own subjects, so gets no consumer at all (it needs none: it reads records with direct gets);
an agent only its own durable; readers only *ephemeral* consumers (the bare ``CONSUMER.CREATE.<stream>`` subject,
as nats-py's ordered consumers and KV watchers use it), never a named or durable one, and no deletes: a named create
or a delete could take over or remove the orchestrator's and the agents' durables. Whoever receives a request
checks that its subject is the one it subscribed to (a pushed stream message keeps its own subject), and nothing on
a ``ts.v1.`` subject can be pushed at all (it would form a cycle with the stream).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from timeslice_client.protocol import AGENTS_BUCKET, GROUPS_BUCKET, JOBS_BUCKET, STREAM, validate_id

from ._leadership import LEADER_BUCKET

__all__ = ["ROLES", "inbox_prefix", "permissions"]

ROLES: Final = ("job", "agent", "orchestrator", "admin", "reader", "local")
_BUCKETS: Final = (GROUPS_BUCKET, AGENTS_BUCKET, JOBS_BUCKET, LEADER_BUCKET)


def inbox_prefix(role: str, ident: str | None = None) -> str:
    """The inbox prefix a user of ``role`` (and id) must use: ``_INBOX_job_J``, ``_INBOX_reader``…; the client
    derives the same from its credential's name (``timeslice_client._bus_auth``)."""
    return f"_INBOX_{role}_{ident}" if ident else f"_INBOX_{role}"


def _read_api(*, consumers: bool) -> list[str]:
    """Reading the stream and the buckets: info and gets; with ``consumers`` ephemeral (ordered) consumers too, and
    their flow control (``timeslice status --watch``, ``events``, ``replay``, ``check``, KV watchers)."""
    out = ["$JS.API.INFO"]
    for stream in (STREAM, *(f"KV_{b}" for b in _BUCKETS)):
        out += [
            f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>",
        ]
        if consumers:
            # and looking up its own consumer (KV watchers, `timeslice events`; see _DENY_READERS)
            out += [f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.INFO.{stream}.*", f"$JS.FC.{stream}.>"]
    return out


def _job(job: str, groups: Sequence[str]) -> tuple[list[str], list[str]]:
    gs = list(groups) or ["*"]
    pub = [f"ts.v1.job.{g}.{job}.>" for g in gs]
    pub += [f"ts.rpc.agent.*.register.{job}", f"ts.rpc.agent.*.unregister.{job}"]
    sub = [f"ts.v1.notice.{g}.{job}" for g in gs]
    sub += [f"ts.rpc.workload.*.{job}"]
    return pub, sub


def _agent(node: str) -> tuple[list[str], list[str]]:
    durable = f"agent-{node}"
    pub = [
        f"ts.v1.agent.{node}.evt.*",
        f"ts.v1.agent.{node}.op",
        "ts.v1.ctl.*.clear_fault",
        f"ts.rpc.workload.{node}.*",
        f"$KV.{AGENTS_BUCKET}.{node}",
        f"$KV.{JOBS_BUCKET}.{node}.*",
        # its durable command consumer: (re)created, looked up, deleted, acknowledged, by name only
        f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.{durable}",
        f"$JS.API.CONSUMER.CREATE.{STREAM}.{durable}.>",
        f"$JS.API.CONSUMER.INFO.{STREAM}.{durable}",
        f"$JS.API.CONSUMER.DELETE.{STREAM}.{durable}",
        f"$JS.ACK.{STREAM}.{durable}.>",
    ]
    sub = [f"ts.rpc.agent.{node}.>"]
    return pub, sub


# The orchestrator's durable (OrchestratorConfig.durable's default): its info names the subject it is delivered on,
# where an ephemeral consumer could push stored messages at the orchestrator.
_DENY_READERS: Final = (f"$JS.API.CONSUMER.INFO.{STREAM}.orchestrator",)
_ADMIN_PUB: Final = ("ts.v1.ctl.*.clear_fault", "ts.v1.ctl.*.set_policy", "ts.rpc.agent.*.clear_fault")
_READER_PUB: Final = ("ts.rpc.agent.*.status",)


def permissions(role: str, ident: str | None = None, groups: Iterable[str] = ()) -> dict[str, Any]:
    """The ``pub``/``sub``/``resp`` part of a user JWT's ``nats`` claims for ``role`` (``ident``: the job id for
    ``job``, the node id for ``agent``; ``groups``: a job's groups, none meaning every group)."""
    gs = [validate_id("group", g) for g in groups]
    if role in ("job", "agent"):
        if ident is None:
            raise ValueError(f"a {role} credential needs its {'job' if role == 'job' else 'node'} id")
        ident = validate_id("job" if role == "job" else "node", ident)
    elif ident is not None:
        raise ValueError(f"a {role} credential names no id (got {ident!r})")
    if gs and role != "job":
        raise ValueError("only a job credential is limited to groups")
    inbox = inbox_prefix(role, ident)
    resp = True  # answers requests it received (workload commands, agent RPCs), nothing more
    if role == "job":
        assert ident is not None
        pub, sub = _job(ident, gs)
        pub += _read_api(consumers=False)
    elif role == "agent":
        assert ident is not None
        pub, sub = _agent(ident)
        pub += _read_api(consumers=False)
    elif role == "orchestrator":
        pub, sub = ["ts.>", "$JS.>", "$KV.>"], ["ts.>"]
    elif role == "admin":
        pub, sub, resp = [*_ADMIN_PUB, *_READER_PUB, *_read_api(consumers=True)], [], False
    elif role == "reader":
        pub, sub, resp = [*_READER_PUB, *_read_api(consumers=True)], [], False
    elif role == "local":
        pub = [
            "ts.v1.job.>",
            "ts.rpc.agent.*.register",
            "ts.rpc.agent.*.unregister",
            "ts.rpc.agent.*.register.*",
            "ts.rpc.agent.*.unregister.*",
            *_ADMIN_PUB,
            *_READER_PUB,
            *_read_api(consumers=True),
        ]
        sub = ["ts.v1.notice.>", "ts.rpc.workload.>"]
    else:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    sub.append(f"{inbox}.>")
    out: dict[str, Any] = {"pub": {"allow": pub}, "sub": {"allow": sub}}
    if role in ("admin", "reader", "local"):
        out["pub"]["deny"] = list(_DENY_READERS)
    if resp:
        out["resp"] = {"max": 1, "ttl": 0}
    return out
