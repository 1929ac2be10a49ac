"""The agent's configuration (``TIMESLICE_AGENT_*`` environment variables, or the CLI's flags)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from timeslice_client._internal.bus_layout import BusConfig
from timeslice_client.bus import parse_servers
from timeslice_client.protocol import validate_id
from timeslice_client.workload import default_node_id

__all__ = ["DEFAULT_GRPC_PORT", "AgentConfig"]

DEFAULT_GRPC_PORT = 9001  # the standalone SnapshotAgentService's port: the reference agent's


class AgentConfig(BaseSettings):
    """The agent's settings; each can also be set as ``TIMESLICE_AGENT_<NAME>`` (e.g. ``TIMESLICE_AGENT_NODE_ID``)."""

    model_config = SettingsConfigDict(env_prefix="TIMESLICE_AGENT_", extra="ignore")

    node_id: str = Field(default_factory=default_node_id)
    nats_url: str | None = None  # one server or several, comma-separated (checked by ``parse_servers``)
    heartbeat_s: float = Field(default=2.0, gt=0)
    pid_check_s: float = Field(default=1.0, gt=0)
    max_results: int = Field(default=4096, ge=16)
    # A restore starts beside the snapshots it follows when the node has room for both contexts (_restore_overlap.py).
    overlap_restores: bool = True
    overlap_margin_bytes: int = Field(default=1 << 30, ge=0)
    overlap_margin_fraction: float = Field(default=0.1, ge=0)
    bus: BusConfig = BusConfig()
    # The node-local Unix socket where jobs prove their processes (``_peer``; "{node}" is replaced by the node
    # id). None: the default (timeslice_client._agent_socket.default_socket_path); "off": none, so only backends
    # that touch no process can be registered.
    socket: str | None = None
    # Uids a job's processes may run as besides the uid of the process that registered them (never others).
    allowed_uids: Annotated[tuple[int, ...], NoDecode] = ()
    allow_other_uids: bool = False  # any uid (a node whose jobs run as several users under one owner)
    proc_root: str = "/proc"  # where /proc is (tests point it at a fake one)
    # What a job that binds its process without a handler (the client's bind_process, at its first acquire) gets:
    # "auto": the driver checkpoint (cuda) where this node can run it, else the lock alone; "none": the lock alone;
    # or a backend's name (e.g. "freeze").
    default_backend: str = Field(default="auto", min_length=1, max_length=64)
    # How long a job's unregistration waits for an operation running on it (a snapshot moving its state off the
    # device: an operation's deadline plus a driver call's drain); past it the job stays registered, answered "busy".
    unregister_wait_s: float = Field(default=600.0, gt=0)
    # Kubernetes (``_pod_discovery``): bind the processes of this node's pods labelled ``timeslice.io/job-id`` to
    # their jobs, with the default backend, as a bind registration would. Off unless set.
    pods: bool = False
    pod_api: str | None = None  # the API server's URL; None: in-cluster (service account, $KUBERNETES_SERVICE_HOST)
    pod_token_file: str | None = None  # a bearer token for pod_api (in-cluster: the service account's)
    pod_ca_file: str | None = None  # the CA that signed pod_api's certificate (in-cluster: the service account's)
    pod_node_name: str | None = None  # this node's Kubernetes name (None: node_id, the DaemonSet's spec.nodeName)
    pod_scan_s: float = Field(default=5.0, gt=0, le=3600)  # how often the pods and /proc are read
    pod_api_timeout_s: float = Field(default=10.0, gt=0, le=300)  # one socket operation of the API call
    # The group of a labelled pod without a ``timeslice.io/group`` label (None: such a pod is skipped).
    pod_default_group: str | None = None

    @field_validator("allowed_uids", mode="before")
    @classmethod
    def _uids(cls, v: object) -> object:
        if isinstance(v, str):  # TIMESLICE_AGENT_ALLOWED_UIDS=1000,1001
            return tuple(int(u) for u in v.replace(" ", "").split(",") if u)
        return v

    @field_validator("pod_default_group")
    @classmethod
    def _group(cls, v: str | None) -> str | None:
        return validate_id("group", v) if v is not None else None

    @field_validator("nats_url")
    @classmethod
    def _servers(cls, v: str | None) -> str | None:
        return ",".join(parse_servers(v)) if v else None
