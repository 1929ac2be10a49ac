"""Connecting to NATS and laying out the JetStream resources timeslice uses.

``ensure_bus`` is idempotent: it creates the ``TIMESLICE`` stream and the ``groups``, ``agents`` and
``jobs`` key-value buckets when they are missing, and leaves existing ones as they are.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, Field

from .errors import Unavailable
from .protocol import AGENTS_BUCKET, GROUPS_BUCKET, JOBS_BUCKET, STREAM, STREAM_SUBJECTS

__all__ = ["Buckets", "BusConfig", "connect", "default_nats_url", "ensure_bus", "kv_keys", "url_file"]

log = logging.getLogger("timeslice.bus")

_URL_FILE_ENV = "TIMESLICE_URL_FILE"
_DEFAULT_URL = "nats://127.0.0.1:4222"


def url_file() -> Path:
    """Where ``timeslice up`` advertises its NATS URL for clients on this host."""
    env = os.environ.get(_URL_FILE_ENV)
    return Path(env) if env else Path.home() / ".timeslice" / "nats.url"


def default_nats_url() -> str:
    """``$TIMESLICE_NATS_URL``, else the URL ``timeslice up`` advertised, else ``nats://127.0.0.1:4222``."""
    env = os.environ.get("TIMESLICE_NATS_URL")
    if env:
        return env
    try:
        text = url_file().read_text().strip()
    except OSError:
        return _DEFAULT_URL
    return text or _DEFAULT_URL


class BusConfig(BaseModel):
    """Retention and replication of the JetStream resources."""

    stream_max_age_s: float = Field(default=7 * 24 * 3600, gt=0)
    stream_max_bytes: int = Field(default=8 * 1024**3, gt=0)
    replicas: int = Field(default=1, ge=1, le=5)
    file_storage: bool = True
    duplicate_window_s: float = Field(default=120, gt=0)
    agent_ttl_s: float = Field(default=6, ge=1)


async def _quiet_error_cb(exc: Exception) -> None:
    log.debug("nats connection error: %r", exc)


async def connect(
    url: str | Sequence[str] | None = None, *, name: str = "timeslice", connect_timeout: float = 5.0, **kwargs: Any
) -> NATS:
    """Connect to NATS with reconnects on, a quiet error callback and a clear error when nobody answers.
    ``url``: one server, or several (tried in turn, and again on reconnect); default ``default_nats_url()``."""
    servers: str | list[str] = (url if isinstance(url, str) else list(url)) if url else default_nats_url()
    url = servers if isinstance(servers, str) else ",".join(servers)
    opts: dict[str, Any] = {
        "name": name,
        "connect_timeout": connect_timeout,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "error_cb": _quiet_error_cb,
    }
    opts.update(kwargs)
    try:
        # With unlimited reconnects nats-py retries a first connection forever: bound it here.
        async with asyncio.timeout(connect_timeout * 2):
            return await nats.connect(servers, **opts)
    except TimeoutError as exc:
        raise Unavailable("cannot connect to NATS", nats_url=url, after_s=connect_timeout * 2) from exc
    except Exception as exc:
        raise Unavailable(f"cannot connect to NATS ({exc.__class__.__name__}: {exc})", nats_url=url) from exc


class Buckets:
    """The three key-value buckets."""

    def __init__(self, groups: KeyValue, agents: KeyValue, jobs: KeyValue) -> None:
        self.groups = groups
        self.agents = agents
        self.jobs = jobs


async def ensure_bus(js: JetStreamContext, config: BusConfig | None = None) -> Buckets:
    cfg = config or BusConfig()
    storage = StorageType.FILE if cfg.file_storage else StorageType.MEMORY
    try:
        await js.stream_info(STREAM)
    except NotFoundError:
        await js.add_stream(
            StreamConfig(
                name=STREAM,
                description="timeslice events: every request, decision and agent operation",
                subjects=list(STREAM_SUBJECTS),
                storage=storage,
                num_replicas=cfg.replicas,
                max_age=cfg.stream_max_age_s,
                max_bytes=cfg.stream_max_bytes,
                duplicate_window=cfg.duplicate_window_s,
            )
        )
    groups = await _bucket(js, GROUPS_BUCKET, "timeslice group lock records", storage, cfg.replicas, None)
    # The limit marker makes an expired agent visible to watchers (as a PURGE), see NATS_NOTES trap 5.
    agents = await _bucket(js, AGENTS_BUCKET, "timeslice agents (liveness)", storage, cfg.replicas, cfg.agent_ttl_s,
                           marker_ttl=max(1.0, cfg.agent_ttl_s))
    jobs = await _bucket(js, JOBS_BUCKET, "timeslice job contexts per node", storage, cfg.replicas, None)
    return Buckets(groups, agents, jobs)


async def _bucket(
    js: JetStreamContext, name: str, description: str, storage: StorageType, replicas: int, ttl: float | None,
    marker_ttl: float | None = None,
) -> KeyValue:
    try:
        return await js.key_value(name)
    except Exception:  # nats-py raises BucketNotFoundError (a NotFoundError) here
        pass
    return await js.create_key_value(
        KeyValueConfig(
            bucket=name,
            description=description,
            history=1,
            ttl=ttl,
            storage=storage,
            replicas=replicas,
            direct=True,
            limit_marker_ttl=marker_ttl,
        )
    )


async def kv_keys(nc: NATS, bucket: str, *, under: str | None = None, timeout: float = 5.0) -> list[str]:
    """The keys of KV ``bucket`` (only those below the dotted prefix ``under``), sorted: read from the bucket
    stream's subject index, one request per 100,000 keys.

    Use this, not nats-py's ``KeyValue.keys()``: that one can miss keys, since its watcher may announce the end
    of the listing before it has processed entries the server already sent (1 wrong list in 300 calls on the
    development machine). A deleted key keeps its delete marker and so is listed: read values with ``get()``
    and skip ``KeyNotFoundError`` (of which ``KeyDeletedError`` is a kind).

    Raises ``Unavailable`` when the server does not answer, or answers with an error (no such bucket)."""
    head = f"$KV.{bucket}."
    flt = f"{head}{under}.>" if under else f"{head}>"
    keys: list[str] = []
    while True:
        req = json.dumps({"subjects_filter": flt, "offset": len(keys)}).encode()
        try:
            msg = await nc.request(f"$JS.API.STREAM.INFO.KV_{bucket}", req, timeout=timeout)
            info: dict[str, Any] = json.loads(msg.data)
        except Exception as exc:
            raise Unavailable(f"listing the keys of bucket {bucket!r} failed ({exc.__class__.__name__})",
                              after_s=timeout) from exc
        if "error" in info:
            err = info["error"]
            raise Unavailable(f"listing the keys of bucket {bucket!r} failed: {err.get('description', err)}")
        page = list((info.get("state") or {}).get("subjects") or {})
        keys.extend(s[len(head):] for s in page)
        if not page or len(keys) >= int(info.get("total") or 0):
            return sorted(keys)
