"""Binding a job's process to its node's agent without a handler: what makes a job that only acquires and yields
get its GPU state moved (``AsyncTimeSliceClient(bind_process=True)``, the default).

At its first acquire the client proves its process through the agent's node-local socket (``_agent_socket``) and
asks the agent of its node (``$TIMESLICE_NODE_ID`` or the host name) to bind it (``RegisterJob(bind=True)``): the
agent gives the job its default backend (the driver checkpoint where the node can run it), or leaves it to the
lock alone, and keeps a handler the job registered. No agent socket on this host means no agent: the lock alone,
said once at debug level. Nothing here ever fails an acquire: a refusal is logged and the job keeps the lock.

A binding lasts as long as the process: closing the client does not undo it (the agent's pid check does once the
process exits). While the process lives its context stays the agent's to move at every switch of the group: a
process that closed its client may still hold device memory, which the next job must not share."""

from __future__ import annotations

import logging
import os

import msgspec
from nats.aio.client import Client as NATS

from ._agent_socket import ProofUnavailable, prove
from .protocol import AgentReply, RegisterJob, encode, subjects

__all__ = ["Binding", "bind_process"]

log = logging.getLogger("timeslice.client")
_reply = msgspec.json.Decoder(AgentReply)


class Binding(msgspec.Struct, frozen=True):
    """What the agent of ``node`` gave the job's process: ``backends`` (empty: the lock alone); ``kept``: the job's
    own registration (a handler) was there already and stays as it is."""

    node: str
    backends: tuple[str, ...]
    kept: bool = False


def this_process() -> tuple[tuple[int, ...], int | None]:
    """This process's pid, and its process group when it leads one (its children then go with it)."""
    pid = os.getpid()
    return (pid,), (pid if os.getpgrp() == pid else None)


async def bind_process(nc: NATS, group: str, job: str, node: str, *, timeout: float) -> Binding | None:
    """Bind this process to ``job`` on ``node``'s agent; None when there is no agent here or it refused."""
    ids = {"group": group, "job": job, "node": node}
    try:
        proof = await prove(job, node, timeout=min(timeout, 5.0))
    except ProofUnavailable as exc:
        log.debug("no agent to bind this process to: %s; the lock alone", exc, extra=ids)
        return None
    pids, pgid = this_process()
    req = RegisterJob(group=group, job=job, backends=(), pids=pids, pgid=pgid, proof=proof, bind=True)
    try:
        msg = await nc.request(subjects.agent_rpc(node, "register", job), encode(req), timeout=timeout)
        reply = _reply.decode(msg.data)
    except Exception as exc:  # no answer, or not an answer: the lock goes on without the agent
        log.warning(
            "the agent of node %s did not bind this process (%s); the lock alone",
            node,
            exc.__class__.__name__,
            extra=ids,
        )
        return None
    if not reply.ok:
        log.warning(
            "the agent of node %s refused to bind this process (%s): %s; the lock alone",
            node,
            reply.code,
            reply.error,
            extra=ids,
        )
        return None
    backends = reply.backends or ()
    log.info("bound to the agent of node %s: %s", node, "+".join(backends) or "the lock alone", extra=ids)
    return Binding(node, backends, kept=reply.kept)
