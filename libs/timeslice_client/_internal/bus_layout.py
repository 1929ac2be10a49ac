"""Laying out the JetStream resources timeslice uses: the services' part of the bus, which a job never needs.

``ensure_bus`` is idempotent: it creates the ``TIMESLICE`` stream and the ``groups``, ``agents`` and ``jobs``
key-value buckets when they are missing, and leaves existing ones as they are (it logs a warning when one has another
replica count than ``BusConfig.replicas`` asks for). The orchestrator and the agent call it as they start; the
connection itself is ``timeslice_client.bus.connect``, which jobs use too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TypeVar

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, Field
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_delay, wait_exponential

from .._publish_rules import transient
from ..errors import TimeSliceError
from ..protocol import AGENTS_BUCKET, GROUPS_BUCKET, JOBS_BUCKET, STREAM, STREAM_SUBJECTS

__all__ = ["SETUP_WAIT_S", "Buckets", "BusConfig", "ensure_bus"]

log = logging.getLogger("timeslice.bus")


class BusConfig(BaseModel):
    """Retention and replication of the JetStream resources."""

    stream_max_age_s: float = Field(default=7 * 24 * 3600, gt=0)
    stream_max_bytes: int = Field(default=8 * 1024**3, gt=0)
    # Copies of the stream and of each bucket on a NATS cluster: when creating them (None: 1), and what an existing
    # one is compared with (None: any count is fine). The stream and buckets stay as they are; a mismatch is logged.
    replicas: int | None = Field(default=None, ge=1, le=5)
    file_storage: bool = True
    duplicate_window_s: float = Field(default=120, gt=0)
    agent_ttl_s: float = Field(default=6, ge=1)


class Buckets:
    """The three key-value buckets."""

    def __init__(self, groups: KeyValue, agents: KeyValue, jobs: KeyValue) -> None:
        self.groups = groups
        self.agents = agents
        self.jobs = jobs


SETUP_WAIT_S = 120.0  # how long a service retries making or finding the stream and buckets (a cluster electing)


async def ensure_bus(js: JetStreamContext, config: BusConfig | None = None, *, wait_s: float = SETUP_WAIT_S) -> Buckets:
    """The stream and the buckets, made where missing. A transient failure (a request unanswered while a NATS
    cluster elects a leader or is still forming) is retried for ``wait_s``: a service starting beside a busy cluster
    waits for it instead of exiting."""

    def told(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        log.warning("the stream and buckets are not answering yet (%r); trying again", exc)

    def again(exc: BaseException) -> bool:
        return transient(exc) or isinstance(exc, _PlacementRefused)

    async for attempt in AsyncRetrying(
        stop=stop_after_delay(wait_s),
        wait=wait_exponential(multiplier=0.1, max=2.0),
        retry=retry_if_exception(again),
        before_sleep=told,
        reraise=True,
    ):
        with attempt:
            return await _ensure_bus_once(js, config)
    raise AssertionError("unreachable: the retry loop returns or raises")


async def _ensure_bus_once(js: JetStreamContext, config: BusConfig | None) -> Buckets:
    cfg = config or BusConfig()
    storage = StorageType.FILE if cfg.file_storage else StorageType.MEMORY
    replicas = cfg.replicas or 1
    try:
        info = await js.stream_info(STREAM)
        _check_replicas(f"stream {STREAM}", STREAM, info.config.num_replicas, cfg.replicas)
    except NotFoundError:
        await _creating(
            f"stream {STREAM}",
            replicas,
            js.add_stream(
                StreamConfig(
                    name=STREAM,
                    description="timeslice events: every request, decision and agent operation",
                    subjects=list(STREAM_SUBJECTS),
                    storage=storage,
                    num_replicas=replicas,
                    max_age=cfg.stream_max_age_s,
                    max_bytes=cfg.stream_max_bytes,
                    duplicate_window=cfg.duplicate_window_s,
                )
            ),
        )
    groups = await _bucket(js, GROUPS_BUCKET, "timeslice group lock records", storage, cfg.replicas, None)
    # With a limit marker an agent key that expires reaches watchers as a PURGE (without one the expiry is silent);
    # until the marker expires (TTLs are whole seconds, 1 s at least), get() is empty and create() of the key fails
    # (docs/nats.md).
    agents = await _bucket(
        js,
        AGENTS_BUCKET,
        "timeslice agents (liveness)",
        storage,
        cfg.replicas,
        cfg.agent_ttl_s,
        marker_ttl=max(1.0, cfg.agent_ttl_s),
    )
    jobs = await _bucket(js, JOBS_BUCKET, "timeslice job contexts per node", storage, cfg.replicas, None)
    return Buckets(groups, agents, jobs)


def _check_replicas(what: str, stream: str, has: int | None, wanted: int | None) -> bool:
    """Log a warning when an existing stream has another replica count than configured; True when it matches (or
    nothing was asked for). The stream is left alone: changing it moves data and is the operator's call."""
    has = has or 1
    if wanted is None or has == wanted:
        return True
    log.warning(
        "%s has %d replica(s) but %d were asked for (--replicas / BusConfig.replicas); it stays at %d. To change it: "
        "`nats stream edit %s --replicas %d` (the servers copy the data; needs a cluster of at least %d nodes), or "
        "run with --replicas %d to match it",
        what,
        has,
        wanted,
        has,
        stream,
        wanted,
        wanted,
        has,
        extra={"stream": stream, "replicas": has, "wanted_replicas": wanted},
    )
    return False


async def _bucket(
    js: JetStreamContext,
    name: str,
    description: str,
    storage: StorageType,
    replicas: int | None,
    ttl: float | None,
    marker_ttl: float | None = None,
) -> KeyValue:
    try:
        kv = await js.key_value(name)
    except Exception:  # nats-py raises BucketNotFoundError (a NotFoundError) here
        pass
    else:
        if replicas is not None:
            info = await js.stream_info(f"KV_{name}")
            _check_replicas(f"bucket {name}", f"KV_{name}", info.config.num_replicas, replicas)
        return kv
    return await _creating(
        f"bucket {name}",
        replicas or 1,
        js.create_key_value(
            KeyValueConfig(
                bucket=name,
                description=description,
                history=1,
                ttl=ttl,
                storage=storage,
                replicas=replicas or 1,
                direct=True,
                limit_marker_ttl=marker_ttl,
            )
        ),
    )


_T = TypeVar("_T")
_NOT_CLUSTERED = 10074  # JetStream: "replicas > 1 not supported in non-clustered mode"
_NO_RESOURCES = 10005  # JetStream: "insufficient resources" (fewer servers than replicas)


async def _creating(what: str, replicas: int, make: Awaitable[_T]) -> _T:
    """``make`` (creating ``what``), its refusal of a replica count explained."""
    try:
        return await make
    except Exception as exc:
        code = getattr(exc, "err_code", None)
        if replicas > 1 and code in (_NOT_CLUSTERED, _NO_RESOURCES):
            why = (
                "this NATS server is not part of a cluster"
                if code == _NOT_CLUSTERED
                else "the cluster has fewer JetStream servers than that"
            )
            error = _PlacementRefused if code == _NO_RESOURCES else TimeSliceError
            raise error(
                f"cannot create {what} with {replicas} replicas: {why} ({getattr(exc, 'description', exc)}); run "
                "with --replicas 1, or on a NATS cluster of at least that many servers (docs/cluster.md)"
            ) from exc
        raise


class _PlacementRefused(TimeSliceError):
    """The cluster has too few JetStream servers for the replicas asked for: for good, or only while servers that
    restarted are still joining; ``ensure_bus`` retries it within its wait."""
