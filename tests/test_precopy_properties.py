"""Pre-copy, as a property (issue 27: "a cancelled pre-copy leaves no trace"): whatever order a job's holds,
releases, idle copies (whole, or cut at any chunk), grants, changes, switches and buffer releases come in, a resume
gives back exactly the state the job had when it was switched out, and a pre-copy never changes the state on the
device. ``TorchOffloadHandler`` on CPU tensors, in small chunks (so cuts fall inside storages), on both copy paths."""

from __future__ import annotations

import threading

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from timeslice_client import SuspendMode
from timeslice_client.torch_offload import TorchOffloadHandler

from .test_precopy import StopsAfter

ALL: frozenset[str] = frozenset()


def _bits(ts: list[torch.Tensor]) -> list[bytes]:
    return [bytes(t.detach().clone().view(torch.uint8).numpy().tobytes()) for t in ts]


class PrecopyRules(RuleBasedStateMachine):
    """One job between its holds: its state ``loaded`` (on the device) or switched out (``saved``: what a resume must
    give back). A rule ``hold`` is a whole hold (the grant, which cancels every copy made while idle, some changes,
    the release), so that a copy, a hold that changes the state and a switch come close together."""

    @initialize(batched=st.booleans(), sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4))
    def start(self, batched: bool, sizes: list[int]) -> None:
        self.ts = [torch.arange(n, dtype=torch.float32) for n in sizes]
        self.handler = TorchOffloadHandler(tensors={"s": self.ts}, chunk_bytes=1024)
        self.handler._batched = batched
        self.loaded = True
        self.saved: list[bytes] | None = None
        self.stops: list[threading.Event] = []
        self.used = 0

    def _hold(self, changes: list[tuple[int, int]]) -> None:
        for stop in self.stops:  # the grant: the client cancels every copy made while the job was idle
            stop.set()
        self.stops.clear()
        for i, delta in changes:  # whole numbers: every element really changes
            self.ts[i % len(self.ts)].add_(float(delta))

    @precondition(lambda self: self.loaded)
    @rule(changes=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), max_size=2))
    def hold(self, changes: list[tuple[int, int]]) -> None:
        """Granted with the state still loaded (nobody came between): a hold, then a release nobody waits for."""
        self._hold(changes)

    @precondition(lambda self: self.loaded)
    @rule(cut=st.one_of(st.none(), st.integers(1, 40)))
    def precopy(self, cut: int | None) -> None:
        stop = threading.Event() if cut is None else StopsAfter(cut)
        self.stops.append(stop)
        before = _bits(self.ts)
        self.handler.precopy(ALL, stop)
        assert _bits(self.ts) == before, "a precopy leaves the device state as it was"

    @precondition(lambda self: self.loaded)
    @rule(mode=st.sampled_from([SuspendMode.OFFLOAD, SuspendMode.OFFLOAD, SuspendMode.DISCARD]))
    def switched_out(self, mode: SuspendMode) -> None:
        before = self.handler.precopied_suspends
        self.saved = _bits(self.ts) if mode == SuspendMode.OFFLOAD else [bytes(len(b)) for b in _bits(self.ts)]
        self.handler.suspend(mode, ALL)
        self.used += self.handler.precopied_suspends - before
        assert all(t.untyped_storage().nbytes() == 0 for t in self.ts)
        self.loaded = False

    @precondition(lambda self: not self.loaded)
    @rule(changes=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), max_size=2))
    def switched_in(self, changes: list[tuple[int, int]]) -> None:
        """The agent resumes the job, its grant follows, and a hold."""
        self.handler.resume(SuspendMode.OFFLOAD, ALL)
        assert _bits(self.ts) == self.saved, "a resume gives back the state the job had when it was switched out"
        self.loaded = True
        self._hold(changes)

    @precondition(lambda self: self.loaded)
    @rule()
    def release_host_buffers(self) -> None:
        self.handler.release_host_buffers()

    @invariant()
    def precopies_are_used_only_by_suspends(self) -> None:
        if hasattr(self, "handler"):
            assert self.handler.precopied_suspends == self.used


PrecopyRules.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestPrecopyRules = PrecopyRules.TestCase
