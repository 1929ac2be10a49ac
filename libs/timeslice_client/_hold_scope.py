"""``client.on_accelerators()``: acquire on entry, release on exit, as a block or a decorator.

Scopes of one client nest: only the outermost one acquires and releases. A decorated ``train_step`` called inside
``with client.on_accelerators():`` runs within the outer hold and leaves it held (it neither acquires again nor
releases when it returns), and the group goes back when the outermost block exits. A scope entered while the client
already holds the group from a plain ``acquire()`` borrows that hold and leaves it held too (the caller releases
what it acquired). Scopes open at once in several tasks (or, for ``TimeSliceClient``, threads) of one client share
its one hold: the first to enter acquires, the last to leave releases; one entering while another is being granted
waits for that grant (at most its own ``timeout``) instead of asking twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar

from ._grants import Grant, ReleaseResult
from ._scope_decorators import run_within, run_within_async
from .errors import AcquireTimeout, TimeSliceError

if TYPE_CHECKING:
    from ._async_client import AsyncTimeSliceClient

__all__ = ["AsyncHold", "AsyncScopes", "SyncHold", "SyncScopes"]

log = logging.getLogger("timeslice.client")

P = ParamSpec("P")
R = TypeVar("R")


class _Scopes:
    """The open ``on_accelerators()`` scopes of one client: how many, and whether the outermost one acquired."""

    def __init__(self) -> None:
        self.depth = 0
        self.owns = False  # the outermost scope acquired (False: it borrowed a hold the caller took with acquire())
        self.grant: Grant | None = None  # the grant every open scope returns

    def opened(self, grant: Grant | None = None, *, owns: bool = False) -> Grant:
        """Count one more open scope and return the grant they all share: the outermost one brings the grant it
        took (``owns``: by acquiring the group, not by borrowing a hold the caller took with ``acquire()``)."""
        if grant is not None:
            self.grant, self.owns = grant, owns
        self.depth += 1
        assert self.grant is not None
        return self.grant


class AsyncScopes(_Scopes):
    def __init__(self) -> None:
        super().__init__()
        self.entering = asyncio.Lock()  # held while the outermost scope is being granted

    @contextlib.asynccontextmanager
    async def entry(self, timeout: float | None, client: AsyncTimeSliceClient) -> AsyncIterator[None]:
        """Hold ``entering`` while a scope enters, waiting for it at most ``timeout`` s (None: the client's
        ``acquire_timeout_s``; past it, ``AcquireTimeout``)."""
        bound = client.acquire_timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(bound):
                await self.entering.acquire()
        except TimeoutError:
            raise AcquireTimeout(client.group_id, client.job_id, bound) from None
        try:
            yield
        finally:
            self.entering.release()


class SyncScopes(_Scopes):
    def __init__(self, acquire_timeout_s: float) -> None:
        super().__init__()
        self.acquire_timeout_s = acquire_timeout_s  # the bound of a wait for another thread's grant (timeout=None)
        self.entering = threading.Lock()

    @contextlib.contextmanager
    def entry(self, timeout: float | None, client: _SyncClient) -> Iterator[None]:
        """``AsyncScopes.entry`` for threads: the wait's default bound is ``acquire_timeout_s``."""
        bound = self.acquire_timeout_s if timeout is None else timeout
        if not self.entering.acquire(timeout=max(0.0, bound)):
            raise AcquireTimeout(client.group_id, client.job_id, bound)
        try:
            yield
        finally:
            self.entering.release()


class AsyncHold:
    """Acquire on entry, release on exit (also on exceptions, never masking the body's exception); nested scopes of
    the same client keep the outer hold (see the module doc)."""

    def __init__(self, client: AsyncTimeSliceClient, timeout: float | None) -> None:
        self._client = client
        self._timeout = timeout
        self.grant: Grant | None = None

    async def __aenter__(self) -> Grant:
        client, scopes = self._client, self._client._scopes
        async with scopes.entry(self._timeout, client):
            if scopes.depth > 0:
                self.grant = scopes.opened()
            else:
                owns = not client.holding
                self.grant = scopes.opened(await client.acquire(self._timeout), owns=owns)  # already held: that grant
        return self.grant

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        scopes = self._client._scopes
        if scopes.depth > 1:
            scopes.depth -= 1
            return
        # The last scope: a scope entering meanwhile waits for the release (and then acquires anew). Never a long
        # wait: ``entering`` is held for a grant only while no scope is open.
        async with scopes.entering:
            scopes.depth -= 1
            scopes.grant = None
            if scopes.owns:
                await _release(self._client.release(), exc)

    def __call__(self, fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        return run_within_async(lambda: AsyncHold(self._client, self._timeout), fn)


async def _release(release: Awaitable[ReleaseResult], exc: BaseException | None) -> None:
    """Await the release; a failure raises, unless the block already failed (then it is logged: never masked)."""
    try:
        await release
    except TimeSliceError:
        if exc is None:
            raise
        log.warning("release after a failed block did not succeed", exc_info=True)


class _SyncClient(Protocol):
    @property
    def job_id(self) -> str: ...
    @property
    def group_id(self) -> str: ...
    @property
    def holding(self) -> bool: ...
    def acquire(self, timeout: float | None = None) -> Grant: ...
    def release(self) -> ReleaseResult: ...


class SyncHold:
    """``AsyncHold`` for ``TimeSliceClient``: ``with client.on_accelerators():`` or ``@client.on_accelerators()``."""

    def __init__(self, client: _SyncClient, timeout: float | None, scopes: SyncScopes) -> None:
        self._client = client
        self._timeout = timeout
        self._scopes = scopes
        self.grant: Grant | None = None

    def __enter__(self) -> Grant:
        client, scopes = self._client, self._scopes
        with scopes.entry(self._timeout, client):
            if scopes.depth > 0:
                self.grant = scopes.opened()
            else:
                owns = not client.holding
                self.grant = scopes.opened(client.acquire(self._timeout), owns=owns)  # already held: that grant
        return self.grant

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        scopes = self._scopes
        # As in ``AsyncHold.__aexit__``: a scope entering meanwhile waits for the release; never a long wait.
        with scopes.entering:
            scopes.depth -= 1
            if scopes.depth > 0:
                return
            scopes.grant = None
            if not scopes.owns:
                return
            try:
                self._client.release()
            except TimeSliceError:
                if exc is None:
                    raise
                log.warning("release after a failed block did not succeed", exc_info=True)

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        return run_within(lambda: SyncHold(self._client, self._timeout, self._scopes), fn)
