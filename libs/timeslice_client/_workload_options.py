"""The options of ``register_workload``, in one place. The standalone function (``workload.register_workload``) and
both clients' methods take them as keywords (``**options: Unpack[...]``), so an option is added here once, typed for
mypy and documented for users. Each default is ``WorkloadChannel``'s, which carries them out (named beside each)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final, Literal, TypedDict, cast

from ._codes import SuspendMode
from ._renamed import rename_keywords

__all__ = [
    "CLIENT_WORKLOAD_KEYS",
    "PRECOPY_CHOICES",
    "RENAMED_KEYS",
    "WORKLOAD_KEYS",
    "ClientWorkloadOptions",
    "Precopy",
    "WorkloadOptions",
    "check_options",
]


class WorkloadOptions(TypedDict, total=False):
    """What every ``register_workload`` takes beside the handler: keywords, each optional."""

    mode: SuspendMode | str
    """What a suspend does with the state: ``offload`` (kept in host memory; the default) or ``discard`` (dropped; the
    workload rebuilds it)."""

    tags: Iterable[str]
    """The parts of the state a command names (e.g. ``weights``, ``kv_cache``; at most 32); default: none, which
    means everything."""

    node_id: str | None
    """The node whose agent it registers with; default ``$TIMESLICE_NODE_ID``, else this host's name."""

    backends: Iterable[str]
    """The agent's backends that switch it, in order; default ``("app_channel",)``: the handler."""

    pids: Iterable[int] | None
    """The processes a process-level backend (``freeze``) stops; default: this process (none when ``pgid`` is given),
    which suits ``app_channel`` (liveness) but not ``freeze`` of the process that calls ``acquire``. They must be this
    process, its descendants or its own process group, running as its uid: the agent checks that against what its
    socket (``agent_socket``, see ``WorkloadChannel``) says this process is, and refuses the rest
    (:class:`~timeslice_client.AgentRefused`)."""

    pgid: int | None
    """The process group such a backend stops as well (this process's own); default: none."""

    op_timeout_s: float
    """Seconds the agent gives one suspend or resume of this job; default 120."""

    endpoints: Iterable[str]
    """The serving engines of backend ``app_endpoint`` (``"vllm+http://host:port"``, ``"sglang+http://host:port"``);
    default: none."""

    switch_interval_s: float | None
    """The process's GIL switch interval (seconds, at most; default 1e-4) while it answers a suspend or resume (and,
    through a client, from this job's release until then), so a main thread busy in Python does not hold up the
    handler; ``None`` leaves it alone (docs/backends.md)."""


Precopy = Literal["auto", "always", "never"]
PRECOPY_CHOICES: Final[tuple[Precopy, ...]] = ("auto", "always", "never")


class ClientWorkloadOptions(WorkloadOptions, total=False):
    """What a client's ``register_workload`` takes beside the handler and ``group_id``: every
    :class:`WorkloadOptions`, and"""

    early_suspend: bool
    """Begin the suspend at a release that another job waits for, rather than at the agent's command (default True;
    see ``release()``; docs/backends.md, "Early suspend"). A channel registered without a client never does."""

    precopy: Precopy
    """After a release nobody waited for, whose state stays on the device, copy it to host memory while the job is
    idle, so that the next switch only frees the device memory (``WorkloadChannel.precopy_idle``; the handler needs
    a ``precopy`` method, as ``TorchOffloadHandler`` has): ``"auto"`` (default) once this channel has been switched
    out before (another job shares the group), ``"always"`` or ``"never"`` (docs/backends.md, "Pre-copy")."""


WORKLOAD_KEYS = WorkloadOptions.__optional_keys__
CLIENT_WORKLOAD_KEYS = ClientWorkloadOptions.__optional_keys__


#: Options renamed for the unit convention (docs/architecture.md, "Names and units"): old name -> new name. The old
#: names work, with a DeprecationWarning, for one release.
RENAMED_KEYS: Final[Mapping[str, str]] = {"op_timeout": "op_timeout_s", "switch_interval": "switch_interval_s"}


def check_options(options: Mapping[str, object], keys: frozenset[str], call: str) -> None:
    """Refuse a keyword outside ``keys`` as Python refuses one a function does not name (``TypeError``): the options
    go on to ``WorkloadChannel``, which takes more than a caller may give. An old name of ``RENAMED_KEYS`` is moved to
    its new one in ``options`` (the caller's ``**options``, a dict of its own), with a DeprecationWarning for the
    caller's caller."""
    rename_keywords(cast("dict[str, object]", options), RENAMED_KEYS, call, stacklevel=4)
    for name in options:
        if name not in keys:
            raise TypeError(f"{call}() got an unexpected keyword argument {name!r}")
