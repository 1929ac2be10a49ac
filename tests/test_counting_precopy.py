"""The integrations' ``CountingHandler`` passes the inner handler's pre-copy on (veRL, slime and Ray register one, so
before this their jobs never pre-copied while idle), and only where the inner handler has one."""

from __future__ import annotations

import threading

import torch
from timeslice_client import SuspendMode
from timeslice_client.handlers import HandlerResult
from timeslice_client.integrations._counting import CountingHandler
from timeslice_client.torch_offload import TorchOffloadHandler

ALL: frozenset[str] = frozenset()


class _NoCopy:
    def suspend(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return HandlerResult()

    def resume(self, mode: SuspendMode, tags: frozenset[str]) -> HandlerResult:
        return HandlerResult()


def test_the_inner_precopy_is_passed_on_and_the_next_suspend_only_frees() -> None:
    t = torch.randn(10_000)
    before = t.clone()
    inner = TorchOffloadHandler(tensors={"t": t})
    counting = CountingHandler(inner)
    copy = getattr(counting, "precopy", None)
    assert copy is not None
    assert copy(ALL, threading.Event()).bytes_moved == t.untyped_storage().nbytes()
    counting.suspend(SuspendMode.OFFLOAD, ALL)
    assert inner.precopied_suspends == 1 and counting.counts.suspends == 1
    counting.resume(SuspendMode.OFFLOAD, ALL)
    assert torch.equal(t, before)


def test_no_precopy_where_the_inner_handler_has_none() -> None:
    assert getattr(CountingHandler(_NoCopy()), "precopy", None) is None
    assert getattr(CountingHandler(), "precopy", None) is None  # nothing registered yet


def test_a_copy_taken_before_a_replace_copies_nothing() -> None:
    counting = CountingHandler(TorchOffloadHandler(tensors={"t": torch.randn(100)}))
    copy = counting.precopy
    counting.replace(TorchOffloadHandler(tensors={"u": torch.randn(100)}))
    assert copy(ALL, None).bytes_moved == 0
