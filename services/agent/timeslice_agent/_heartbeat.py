"""The agent's announcement in KV ``agents`` (key: its node): who it is, the backends that work here, the
node's devices (NVML) and host memory. Written at start and every ``heartbeat_s``; the bucket's TTL makes the key of
an agent that stopped writing disappear, and the orchestrator then asks the agent itself whether it is gone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Final

import msgspec
from nats.js.kv import KeyValue
from timeslice_client.protocol import AgentInfo, DeviceInfo, encode

from ._host import host_memory

__all__ = ["RETRY_S", "Heartbeat"]

RETRY_S: Final = 0.5  # the wait before another write after one failed

log = logging.getLogger("timeslice.agent")


class Heartbeat:
    """Writes ``node``'s ``AgentInfo`` to ``kv``."""

    def __init__(self, node: str, kv: KeyValue, started_ms: int) -> None:
        self.node, self.kv, self.started_ms = node, kv, started_ms

    async def once(self) -> None:
        total, avail = host_memory()
        from ._nvml import node_devices
        from .backends import available_backends

        # In threads: the first call loads cuda-python / NVML where they are installed.
        backends = await asyncio.to_thread(available_backends)
        devices = await asyncio.to_thread(node_devices)
        info = AgentInfo(
            node=self.node,
            pid=os.getpid(),
            started_at_ms=self.started_ms,
            backends=backends,
            devices=devices,
            host_memory_total_bytes=total,
            host_memory_available_bytes=avail,
        )
        await self.kv.put(self.node, encode(info))

    async def loop(self, every_s: float, stop: asyncio.Event) -> None:
        """Every ``every_s`` until ``stop`` is set. A write that fails (or takes longer than ``every_s``: one sent
        into a NATS election is never answered) is logged and tried again sooner, every ``RETRY_S``: the key must be
        back before the orchestrator's probe finds the agent gone (it asks the agent itself when the key expires)."""
        wait = every_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await stop.wait()
            if stop.is_set():
                return
            try:
                async with asyncio.timeout(every_s):
                    await self.once()
            except Exception as exc:
                log.warning("heartbeat failed: %r", exc, extra={"node": self.node})
                wait = min(every_s, RETRY_S)
            else:
                wait = every_s

    async def devices(self) -> tuple[DeviceInfo, ...]:
        """The devices the last write reported (none when it cannot be read)."""
        try:
            entry = await self.kv.get(self.node)
        except Exception:
            return ()
        return msgspec.json.decode(entry.value, type=AgentInfo).devices if entry.value else ()
