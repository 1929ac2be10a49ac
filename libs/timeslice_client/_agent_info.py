"""The agents' liveness records (KV ``agents``), exported by ``protocol`` with the other wire and KV types."""

from __future__ import annotations

import msgspec

__all__ = ["AgentInfo", "DeviceInfo"]


class _Rec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class DeviceInfo(_Rec, frozen=True):
    index: int
    uuid: str
    name: str = ""
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0


class AgentInfo(_Rec, frozen=True):
    """An agent's liveness record (KV ``agents``, key = node id, with a TTL)."""

    node: str
    pid: int
    started_at_ms: int
    backends: tuple[str, ...] = ()
    devices: tuple[DeviceInfo, ...] = ()
    host_memory_total_bytes: int = 0
    host_memory_available_bytes: int = 0
