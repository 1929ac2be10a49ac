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
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar

from ._grants import Grant, ReleaseResult
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


class AsyncScopes(_Scopes):
    def __init__(self) -> None:
        super().__init__()
        self.entering = asyncio.Lock()  # held while the outermost scope is being granted


class SyncScopes(_Scopes):
    def __init__(self, acquire_timeout_s: float) -> None:
        super().__init__()
        self.acquire_timeout_s = acquire_timeout_s  # the bound of a wait for another thread's grant (timeout=None)
        self.entering = threading.Lock()


class AsyncHold:
    """Acquire on entry, release on exit (also on exceptions, never masking the body's exception); nested scopes of
    the same client keep the outer hold (see the module doc)."""

    def __init__(self, client: AsyncTimeSliceClient, timeout: float | None) -> None:
        self._client = client
        self._timeout = timeout
        self.grant: Grant | None = None

    async def __aenter__(self) -> Grant:
        client, scopes = self._client, self._client._scopes
        bound = client.acquire_timeout_s if self._timeout is None else self._timeout
        try:
            async with asyncio.timeout(bound):
                await scopes.entering.acquire()
        except TimeoutError:
            raise AcquireTimeout(client.group_id, client.job_id, bound) from None
        try:
            if scopes.depth == 0:
                owns = not client.holding
                scopes.grant = await client.acquire(self._timeout)  # held already: the same grant back
                scopes.owns = owns
            scopes.depth += 1
        finally:
            scopes.entering.release()
        assert scopes.grant is not None
        self.grant = scopes.grant
        return scopes.grant

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
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            async with AsyncHold(self._client, self._timeout):
                return await fn(*args, **kwargs)

        return wrapper


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
        bound = scopes.acquire_timeout_s if self._timeout is None else self._timeout
        if not scopes.entering.acquire(timeout=max(0.0, bound)):
            raise AcquireTimeout(client.group_id, client.job_id, bound)
        try:
            if scopes.depth == 0:
                owns = not client.holding
                scopes.grant = client.acquire(self._timeout)  # held already: the same grant back
                scopes.owns = owns
            scopes.depth += 1
        finally:
            scopes.entering.release()
        assert scopes.grant is not None
        self.grant = scopes.grant
        return scopes.grant

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
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with SyncHold(self._client, self._timeout, self._scopes):
                return fn(*args, **kwargs)

        return wrapper
