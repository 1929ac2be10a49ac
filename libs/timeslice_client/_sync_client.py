"""``TimeSliceClient``: a blocking facade over ``AsyncTimeSliceClient`` with its own loop thread (``_responder``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar

from ._async_client import AsyncTimeSliceClient, Grant, ReleaseResult
from ._hold_scope import SyncHold, SyncScopes
from ._responder import Responder
from .errors import TimeSliceError, Unavailable
from .handlers import WorkloadHandler
from .protocol import GroupRecord
from .workload import WorkloadChannel

__all__ = ["TimeSliceClient"]

T = TypeVar("T")


class TimeSliceClient:
    """The same API as :class:`AsyncTimeSliceClient`, for ordinary (non-async) training loops::

        client = TimeSliceClient(job_id="job-a", group_id="gpus-0")

        @client.on_accelerators()
        def train_step(batch): ...
    """

    def __init__(
        self,
        job_id: str,
        group_id: str,
        nats_url: str | None = None,
        lease_seconds: float = 30.0,
        **kwargs: Any,
    ) -> None:
        self._client = AsyncTimeSliceClient(job_id, group_id, nats_url, lease_seconds, **kwargs)
        self._loop_thread = Responder(f"timeslice-{job_id}", fast=False)
        self._loop_thread.start()
        self._closed = False
        self._scopes = SyncScopes(self._client.acquire_timeout)  # the open on_accelerators() scopes

    @property
    def job_id(self) -> str:
        return self._client.job_id

    @property
    def group_id(self) -> str:
        return self._client.group_id

    @property
    def holding(self) -> bool:
        return self._client.holding

    @property
    def contended(self) -> bool:
        """See :attr:`AsyncTimeSliceClient.contended`."""
        return self._client.contended

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        if self._closed:
            coro.close()
            raise TimeSliceError("this client is closed; make a new one")
        fut = self._loop_thread.submit(coro)
        # Wait without fut.result(timeout): its TimeoutError would be indistinguishable from the
        # coroutine's own (AcquireTimeout is a TimeoutError too).
        try:
            done, _ = concurrent.futures.wait([fut], timeout)
        except BaseException:
            fut.cancel()
            raise
        if not done:
            fut.cancel()
            raise Unavailable("the client's event loop did not answer", after_s=timeout)
        return fut.result()

    def _margin(self, t: float) -> float:
        return t + 3 * self._client.request_timeout + 5

    def connect(self) -> TimeSliceClient:
        self._run(self._client.connect(), self._margin(self._client.connect_timeout))
        return self

    def acquire(self, timeout: float | None = None) -> Grant:
        t = self._client.acquire_timeout if timeout is None else timeout
        # A workload suspended at the last release may have to be resumed before the grant is returned.
        return self._run(self._client.acquire(timeout), self._margin(t) + self._client._settle_budget())

    def release(self) -> ReleaseResult:
        return self._run(self._client.release(), self._margin(self._client.request_timeout))

    def status(self, group_id: str | None = None) -> GroupRecord:
        return self._run(self._client.status(group_id), self._margin(self._client.request_timeout))

    def list_groups(self) -> list[str]:
        return self._run(self._client.list_groups(), self._margin(self._client.request_timeout))

    def register_workload(self, handler: WorkloadHandler, **kwargs: Any) -> WorkloadChannel:
        """See :meth:`AsyncTimeSliceClient.register_workload`; the handler runs on the channel's own thread."""
        return self._run(self._client.register_workload(handler, **kwargs),
                         self._margin(self._client.request_timeout))

    def on_accelerators(self, timeout: float | None = None) -> SyncHold:
        """``with client.on_accelerators():`` or ``@client.on_accelerators()``. Scopes nest: only the outermost
        acquires and releases (an inner one keeps the outer hold; see ``_hold_scope``)."""
        return SyncHold(self, timeout, self._scopes)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        cm = self._client.phase(name)
        self._run(cm.__aenter__(), self._margin(self._client.request_timeout))
        try:
            yield
        except BaseException as exc:
            self._run(cm.__aexit__(type(exc), exc, exc.__traceback__), self._margin(self._client.request_timeout))
            raise
        else:
            self._run(cm.__aexit__(None, None, None), self._margin(self._client.request_timeout))

    def close(self) -> None:
        """Release a held group, withdraw waits, stop the loop thread. Idempotent."""
        if self._closed:
            return
        try:
            self._run(self._client.close(), self._margin(self._client.request_timeout))
        finally:
            self._closed = True
            self._loop_thread.stop_blocking(10)

    def __enter__(self) -> TimeSliceClient:
        return self.connect()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
