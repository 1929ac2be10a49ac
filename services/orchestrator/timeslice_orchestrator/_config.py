"""The orchestrator's configuration (``$TIMESLICE_*``; re-exported by ``service``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from timeslice_client._internal.bus_layout import BusConfig
from timeslice_client.bus import TlsFiles

__all__ = ["OrchestratorConfig"]


class OrchestratorConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIMESLICE_", extra="ignore")

    nats_url: str | None = None
    # The orchestrator's identity on the bus ($TIMESLICE_CREDS, $TIMESLICE_TLS_CA/_CERT/_KEY; docs/security.md). None:
    # as bus.connect finds them (the CLI's --creds, then the environment).
    creds: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    durable: str = "orchestrator"
    writers: int = Field(default=16, ge=1, le=1024)
    write_queue: int = Field(default=65_536, ge=16)
    max_ack_pending: int = Field(default=50_000, ge=100)
    ack_wait_s: float = Field(default=30.0, gt=0)
    tick_retry_ms: int = Field(default=500, ge=10)
    write_attempts: int = Field(default=8, ge=1)
    # One attempt's wait for the stream's answer (the store retries until write_attempts and 30 s are spent). Short:
    # a write sent into a NATS election is never answered, and the next attempt reaches the new stream leader
    # (docs/nats.md).
    write_timeout_s: float = Field(default=1.0, gt=0)
    max_record_bytes: int = Field(default=768 * 1024, ge=64 * 1024)  # and at most 3/4 of the server's max_payload
    catch_up_idle_s: float = Field(default=10.0, gt=0)  # the catch-up fails when the bus is silent this long
    local_agent_ready_s: float = Field(default=60.0, gt=0)  # the agent run beside this one must be ready by then
    # An agent whose key in KV ``agents`` went away is asked (its status RPC) for this long before it is declared
    # lost, and asked again this often while it answers without a key (heartbeats failing through a NATS election).
    agent_probe_s: float = Field(default=2.0, gt=0, le=60)
    # Leader election (hot standby): every orchestrator campaigns; one leads, the others stand by.
    instance_id: str | None = Field(default=None, max_length=128)  # default: host/pid/random
    leader_ttl_s: int = Field(default=1, ge=1, le=60)  # the lease key's TTL: a dead leader is replaced after it
    leader_renew_s: float = Field(default=0.25, gt=0)  # must be < leader_ttl_s minus the 0.2 s safety margin
    leader_confirm_wait_s: float = Field(default=15.0, gt=0)  # a lapsed lease is confirmed again for this long
    bus: BusConfig = BusConfig()

    def identity(self) -> dict[str, Any]:
        """``bus.connect``'s ``creds``/``tls`` arguments for these settings (empty: found by ``connect``)."""
        out: dict[str, Any] = {}
        if self.creds is not None:
            out["creds"] = self.creds
        if self.tls_ca is not None or self.tls_cert is not None:
            out["tls"] = TlsFiles(self.tls_ca, self.tls_cert, self.tls_key)
        return out
