"""``TimeSliceClient``: a blocking facade over ``AsyncTimeSliceClient``, on a loop that each call runs on the
caller's own thread and a thread of the client's runs between calls (``_shared_loop``)."""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar, Unpack, overload

from ._async_client import RENAMED_OPTIONS, AsyncTimeSliceClient, Grant, ReleaseResult
from ._descriptors import Forwarded
from ._group_status import GroupStatus
from ._hold_scope import SyncHold, SyncScopes
from ._multi_group import SyncGroups, SyncMultiHold
from ._renamed import renamed_keywords
from ._shared_loop import CallTimeout, LoopClosed, SharedLoop
from ._workload_options import CLIENT_WORKLOAD_KEYS, ClientWorkloadOptions, check_options
from .bus import CredsPath, TlsOption
from .errors import TimeSliceError, Unavailable
from .handlers import WorkloadHandler
from .workload import WorkloadChannel

__all__ = ["TimeSliceClient"]

T = TypeVar("T")


class TimeSliceClient:
    """The same API as :class:`AsyncTimeSliceClient`, for ordinary (non-async) training loops::

        client = TimeSliceClient(job_id="job-a", group_id="gpus-0")

        @client.on_accelerators()
        def train_step(batch): ...

    Each call runs the client's event loop on the calling thread until it returns (a grant is read by the thread
    that waits for it); between calls a thread of the client's serves the loop: the lease keeper's renewals, the
    orchestrator's notices, the connection. Calls from several threads at once are fine (one runs the loop, the
    others' calls run there). Ctrl-C during a call withdraws what it waited for before ``KeyboardInterrupt``
    reaches you (at most ~2 s; a second Ctrl-C does not wait).

    The options are :class:`AsyncTimeSliceClient`'s: ``lease_s`` (the hold's lease, renewed in the background),
    ``acquire_timeout_s`` (``acquire()``'s default wait), ``request_timeout_s`` (each request to the bus),
    ``waiter_ttl_s`` (a wait is dropped when not renewed for this long), ``confirm_s`` (a grant must be confirmed
    within this long), ``connect_timeout_s`` (the first connection), all in seconds; ``fast_reacquire`` (claims: a
    re-acquire right after a release nobody waited for returns at the stream's PubAck), ``creds`` and ``tls`` (found
    by ``bus.connect`` when None), ``bind_process`` and ``node_id`` (the first acquire binds this process to its
    node's agent), ``priority`` (this job's class among the group's waiters, 0 to 9: docs/scheduling.md). Not
    ``nc``: a connection belongs to the loop it was made on, and this client's loop is its own. The duration
    options' old names (``lease_seconds``, ``acquire_timeout``, ``request_timeout``, ``waiter_ttl_seconds``,
    ``confirm_seconds``, ``connect_timeout``) still work for one release, with a ``DeprecationWarning``.
    """

    @renamed_keywords(**RENAMED_OPTIONS)
    def __init__(
        self,
        job_id: str,
        group_id: str,
        nats_url: str | None = None,
        lease_s: float = 30.0,
        *,
        acquire_timeout_s: float = 600.0,
        request_timeout_s: float = 5.0,
        waiter_ttl_s: float = 5.0,
        confirm_s: float = 3.0,
        connect_timeout_s: float = 5.0,
        fast_reacquire: bool = True,
        creds: CredsPath | None = None,
        tls: TlsOption | None = None,
        bind_process: bool = True,
        node_id: str | None = None,
        priority: int = 0,
    ) -> None:
        self._client = AsyncTimeSliceClient(
            job_id,
            group_id,
            nats_url,
            lease_s,
            acquire_timeout_s=acquire_timeout_s,
            request_timeout_s=request_timeout_s,
            waiter_ttl_s=waiter_ttl_s,
            confirm_s=confirm_s,
            connect_timeout_s=connect_timeout_s,
            fast_reacquire=fast_reacquire,
            creds=creds,
            tls=tls,
            bind_process=bind_process,
            node_id=node_id,
            priority=priority,
        )
        self._loop = SharedLoop(f"timeslice-{job_id}")
        self._loop.start()
        self._closed = False
        self._scopes = SyncScopes(self._client.acquire_timeout_s)  # the open on_accelerators() scopes
        self._groups = SyncGroups(self, self, self._scopes, self._client._groups, self._client.acquire_timeout_s)

    # What the async client knows, read from it each time (``Forwarded``: a read-only attribute apiece).
    job_id = Forwarded[str]("_client", "This job's id.")
    group_id = Forwarded[str]("_client", "The group this client acquires.")
    nats_url = Forwarded[str]("_client", "The NATS server(s) this client connects to.")
    holding = Forwarded[bool]("_client", "This job holds the group (granted, and its lease is not known to be lost).")
    contended = Forwarded[bool](
        "_client",
        "Another job waits for the group this job holds (as the orchestrator has said): a good moment to\n"
        "release. False when this job does not hold the group.",
    )
    yield_requested = Forwarded[bool](
        "_client",
        "This hold ran past the group's quantum while another job waits (``timeslice set-policy``): release at the\n"
        "next phase boundary. A request only: the hold stays valid. False when this job does not hold the group.",
    )
    epoch = Forwarded[int | None]("_client", "The epoch of this job's current hold (None when it holds nothing).")
    held_groups = Forwarded[tuple[str, ...]](
        "_client", "The groups this job holds through this client (its own and those of ``acquire_all``), sorted."
    )

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        if self._closed:
            coro.close()
            raise TimeSliceError("this client is closed; make a new one")
        try:
            return self._loop.run(coro, timeout)
        except LoopClosed:
            raise TimeSliceError("this client is closed; make a new one") from None
        except CallTimeout:
            raise Unavailable("the client's event loop did not answer", after_s=timeout) from None

    def _margin(self, t: float) -> float:
        return t + 3 * self._client.request_timeout_s + 5

    def connect(self) -> TimeSliceClient:
        """Connect to NATS and start the lease keeper (``acquire()`` connects too). Returns this client."""
        self._run(self._client.connect(), self._margin(self._client.connect_timeout_s))
        return self

    def acquire(self, timeout: float | None = None) -> Grant:
        """Wait (at most ``timeout`` s, default ``acquire_timeout_s``) for the group; see
        :meth:`AsyncTimeSliceClient.acquire`. Raises AcquireTimeout (the wait is withdrawn), JobFaulted,
        Unavailable, HandlerError."""
        t = self._client.acquire_timeout_s if timeout is None else timeout
        # A workload suspended at the last release may have to be resumed before the grant is returned.
        return self._run(self._client.acquire(timeout), self._margin(t) + self._client._settle_budget())

    def release(self) -> ReleaseResult:
        """Give the group back; see :meth:`AsyncTimeSliceClient.release`. Raises NotHolder, StaleEpoch or
        LeaseExpired when this job no longer holds it."""
        return self._run(self._client.release(), self._margin(self._client.request_timeout_s))

    def acquire_all(self, groups: Iterable[str], timeout: float | None = None) -> dict[str, Grant]:
        """Take every group of ``groups`` in sorted order, within ``timeout`` for the whole call; the grants by group.
        On a failure what it took is released before AcquireAllFailed (AcquireAllTimeout) is raised; see
        :meth:`AsyncTimeSliceClient.acquire_all` and docs/multi-pool.md."""
        groups = tuple(groups)
        t = self._client.acquire_timeout_s if timeout is None else timeout
        extra = len(groups) * self._client.request_timeout_s + self._client._groups.settle_budget()  # joins, resumes
        return self._run(self._client.acquire_all(groups, timeout), self._margin(t) + extra)

    def release_all(self) -> dict[str, ReleaseResult]:
        """Release every group this client holds, in reverse order; see :meth:`AsyncTimeSliceClient.release_all`."""
        n = len(self._client.held_groups) + 1
        return self._run(self._client.release_all(), self._margin(n * self._client.request_timeout_s))

    def status(self, group_id: str | None = None, *, wait_s: float | None = None) -> GroupStatus:
        """What the lock record of ``group_id`` says (default: this client's group; a fresh group reads as IDLE at
        epoch 0), reflecting this client's own calls: it waits for the stored record to catch up with them, at most
        ``wait_s`` (default ``request_timeout_s``), else returns the freshest with ``stale`` set; see
        :meth:`AsyncTimeSliceClient.status`."""
        rt = self._client.request_timeout_s
        return self._run(self._client.status(group_id, wait_s=wait_s), self._margin(rt + (wait_s or 0)))

    def list_groups(self) -> list[str]:
        """The ids of the groups the orchestrator has records of."""
        return self._run(self._client.list_groups(), self._margin(self._client.request_timeout_s))

    def register_workload(
        self, handler: WorkloadHandler, *, group_id: str | None = None, **options: Unpack[ClientWorkloadOptions]
    ) -> WorkloadChannel:
        """Register this process with its node's agent so a switch moves its state; see
        :meth:`AsyncTimeSliceClient.register_workload` (``options``:
        :class:`~timeslice_client.workload.ClientWorkloadOptions`). The handler runs on the channel's own thread;
        the channel is closed with the client. ``group_id``: in another group of this job's."""
        check_options(options, CLIENT_WORKLOAD_KEYS, "register_workload")
        coro = self._client.register_workload(handler, group_id=group_id, **options)
        return self._run(coro, self._margin(2 * self._client.request_timeout_s))

    @overload
    def on_accelerators(self, timeout: float | None = None) -> SyncHold: ...
    @overload
    def on_accelerators(self, timeout: float | None = None, *, groups: Iterable[str]) -> SyncMultiHold: ...
    def on_accelerators(self, timeout: float | None = None, *, groups: Iterable[str] | None = None) -> Any:
        """``with client.on_accelerators():`` or ``@client.on_accelerators()``. Scopes nest: only the outermost
        acquires and releases (an inner one keeps the outer hold; see ``_hold_scope``). ``groups``: several at once,
        as ``acquire_all``, yielding the grants by group (docs/multi-pool.md)."""
        return SyncHold(self, timeout, self._scopes) if groups is None else SyncMultiHold(self._groups, groups, timeout)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Publish phase start/end events around a block (for ``timeslice replay``; with the group's predictive
        restore on, a start made while the job is away is the core's cue for its next ask: docs/scheduling.md)."""
        cm = self._client.phase(name)
        self._run(cm.__aenter__(), self._margin(self._client.request_timeout_s))
        try:
            yield
        except BaseException as exc:
            self._run(cm.__aexit__(type(exc), exc, exc.__traceback__), self._margin(self._client.request_timeout_s))
            raise
        else:
            self._run(cm.__aexit__(None, None, None), self._margin(self._client.request_timeout_s))

    def close(self) -> None:
        """Release a held group, withdraw waits, close workload channels, disconnect, stop the client's thread
        (joined). Idempotent."""
        if self._closed:
            return
        try:
            self._run(self._client.close(), self._margin(self._client.request_timeout_s))
        finally:
            self._closed = True
            self._loop.stop(10)

    def __enter__(self) -> TimeSliceClient:
        return self.connect()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
