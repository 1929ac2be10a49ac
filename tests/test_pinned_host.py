"""Exact registered host buffers of TorchOffloadHandler (``host_memory="registered"``), on CPU tensors.

The seam is the registrar: ``Registrar`` below records every ``register``/``unregister`` and refuses the
mistakes the CUDA runtime refuses (registering a range twice, unregistering what is not registered).
"""

from __future__ import annotations

import gc
import logging
import sys
import uuid
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from timeslice_client import _pinned_host  # noqa: E402
from timeslice_client._pinned_host import PAGE, CudaRegistrar, HostMemory  # noqa: E402
from timeslice_client.errors import HandlerError  # noqa: E402
from timeslice_client.protocol import SuspendMode  # noqa: E402
from timeslice_client.torch_offload import TorchOffloadHandler  # noqa: E402

from .failing_copy import FailingCopy  # noqa: E402

OFFLOAD = SuspendMode.OFFLOAD
DISCARD = SuspendMode.DISCARD
ALL: frozenset[str] = frozenset()
MiB = 1 << 20


class Registrar:
    """Records calls; ``live`` maps each registered pointer to its bytes. ``fail``: refuse to register."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.live: dict[int, int] = {}
        self.registered: list[int] = []  # the bytes of each register call, in order
        self.unregistered = 0

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered.append(nbytes)
        if self.fail:
            raise OSError(self.fail)
        assert not any(p <= ptr < p + n or ptr <= p < ptr + nbytes for p, n in self.live.items()), "overlap"
        self.live[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        assert ptr in self.live, "unregistering a range that is not registered"
        del self.live[ptr]
        self.unregistered += 1


def one_group(tensors: dict[str, Any]) -> dict[str, Any]:
    return {"state": list(tensors.values())}


def handler(*args: Any, registrar: Registrar | None = None, **kwargs: Any) -> TorchOffloadHandler:
    """A handler with registered buffers that go at each resume (``keep_host_buffers=False``), unless told."""
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("keep_host_buffers", False)
    return TorchOffloadHandler(*args, host_memory="registered", registrar=registrar or Registrar(), **kwargs)


def state(seed: int = 0) -> dict[str, Any]:
    """Odd sizes and dtypes (NaN payloads, a view, bf16), 2^23 + 1237 bytes of storage in all: a power-of-two
    allocator would take 16 MiB for it."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.randint(0, 256, (1 << 23,), dtype=torch.uint8, generator=gen)
    floats = torch.randn(250, generator=gen)  # 1000 bytes
    floats[::7] = float("nan")
    halves = torch.randn(118, generator=gen).to(torch.bfloat16)  # 236 bytes
    odd = torch.randint(0, 256, (1,), dtype=torch.uint8, generator=gen)  # 1 byte
    return {"big": big, "view": big[12345:], "floats": floats, "halves": halves, "odd": odd}


def raw(tensors: dict[str, Any]) -> dict[str, bytes]:
    # through a clone: ``.numpy()`` on the tensor itself would mark its storage not resizable for good
    return {k: t.detach().clone().view(torch.uint8).numpy().tobytes() for k, t in tensors.items()}


STATE_BYTES = (1 << 23) + 1000 + 236 + 1


def test_the_buffer_is_exactly_the_state_plus_alignment_and_registered_once() -> None:
    reg = Registrar()
    tensors = state()
    h = handler(tensors=one_group(tensors), registrar=reg)
    assert h.host_memory_in_use == "registered"
    for _ in range(3):
        h.suspend(OFFLOAD, ALL)
        assert len(reg.live) == 1  # one registration for the group, not one per tensor
        ((ptr, nbytes),) = reg.live.items()
        assert ptr % PAGE == 0
        assert STATE_BYTES <= nbytes <= STATE_BYTES + 4 * 4096  # alignment of four storages, at most
        assert nbytes < 1 << 24  # not a power of two: 16 MiB is what torch's pinned allocator would hold
        assert h.host_bytes() == nbytes
        h.resume(OFFLOAD, ALL)
    assert reg.registered == [reg.registered[0]] * 3 and reg.unregistered == 3 and not reg.live


def test_by_default_the_exact_buffer_is_pinned_once_and_kept_until_released() -> None:
    """The default: pinning is paid at the first suspend, not at every switch; the buffer stays exact."""
    reg = Registrar()
    tensors = state()
    before = raw(tensors)
    h = handler(tensors=one_group(tensors), registrar=reg, keep_host_buffers=True)
    for _ in range(3):
        h.suspend(OFFLOAD, ALL)
        h.resume(OFFLOAD, ALL)
        assert raw(tensors) == before
    assert len(reg.registered) == 1 and reg.unregistered == 0 and len(reg.live) == 1
    ((_, nbytes),) = reg.live.items()
    assert STATE_BYTES <= nbytes < 1 << 24 and h.host_bytes() == nbytes
    tensors["extra"] = torch.zeros(4096, dtype=torch.uint8)  # the state grows: a new exact buffer, the old one goes
    h2 = handler(tensors=one_group(tensors), registrar=reg, keep_host_buffers=True)
    h2.suspend(OFFLOAD, ALL)
    h2.resume(OFFLOAD, ALL)
    assert h.release_host_buffers() == nbytes and h2.release_host_buffers() > nbytes and not reg.live


@pytest.mark.parametrize("batched", [False, True], ids=["per-storage", "batched"])
def test_round_trip_is_bit_exact_and_resume_releases_everything(batched: bool) -> None:
    reg = Registrar()
    tensors = state(1)
    before = raw(tensors)
    h = handler(
        tensors={"a": [tensors["big"], tensors["view"]], "b": [tensors["floats"], tensors["halves"], tensors["odd"]]},
        registrar=reg,
    )
    h._batched = batched
    for _ in range(2):
        h.suspend(OFFLOAD, ALL)
        assert len(reg.live) == 2 and h.device_bytes() == 0  # one buffer per group
        h.resume(OFFLOAD, frozenset({"a"}))  # a group resumed alone gives back its own buffer alone
        assert len(reg.live) == 1
        h.resume(OFFLOAD, ALL)
        assert not reg.live and h.host_bytes() == 0
        assert raw(tensors) == before


def test_prepare_registers_ahead_the_buffer_the_suspend_then_uses() -> None:
    reg = Registrar()
    h = handler(tensors=one_group(state()), registrar=reg)
    prepared = h.prepare()
    assert reg.live == {next(iter(reg.live)): prepared} and h.host_bytes() == prepared
    h.suspend(OFFLOAD, ALL)
    assert len(reg.registered) == 1  # the prepared one
    h.resume(OFFLOAD, ALL)
    assert not reg.live
    h.prepare()
    assert h.release_host_buffers() == prepared and not reg.live and reg.unregistered == 2


def test_discard_and_drop_release_the_buffer() -> None:
    reg = Registrar()
    tensors = state()
    h = handler(tensors=one_group(tensors), registrar=reg)
    h.prepare()
    h.suspend(DISCARD, ALL)  # the state is dropped: nothing to keep on the host
    assert not reg.live and h.host_bytes() == 0
    h.resume(DISCARD, ALL)
    h.suspend(OFFLOAD, ALL)
    assert len(reg.live) == 1
    assert h.drop_saved() == reg.registered[-1] and not reg.live and h.host_bytes() == 0
    assert h.suspended_tags == frozenset() and h.device_bytes() == 0  # the tensors stay empty
    assert h.resume(OFFLOAD, ALL).bytes_moved == 0


def failing(seed: int, batched: bool) -> tuple[FailingCopy, Registrar, dict[str, Any], dict[str, bytes]]:
    """A handler whose copies fail when told (``fail_at``), over ``state(seed)`` in registered host memory (a fresh
    registrar): the handler, the registrar, the tensors and their bytes before anything moved."""
    reg, tensors = Registrar(), state(seed)
    before = raw(tensors)
    h = FailingCopy(
        tensors=one_group(tensors),
        device="cpu",
        host_memory="registered",
        registrar=reg,
        keep_host_buffers=False,
        batched=batched,
    )
    return h, reg, tensors, before


@pytest.mark.parametrize("batched", [False, True], ids=["per-storage", "batched"])
def test_a_suspend_failing_midway_rolls_back_and_releases_its_buffer(batched: bool) -> None:
    h, reg, tensors, before = failing(2, batched)
    h.fail_at = 3
    with pytest.raises(RuntimeError, match="injected"):
        h.suspend(OFFLOAD, ALL)
    assert not reg.live and len(reg.registered) == 1 and h.host_bytes() == 0  # registered, then undone
    assert raw(tensors) == before and h.suspended_tags == frozenset()
    h.suspend(OFFLOAD, ALL)
    h.resume(OFFLOAD, ALL)
    assert raw(tensors) == before and not reg.live


def test_a_suspend_refused_at_a_later_group_releases_the_earlier_groups_buffers() -> None:
    reg = Registrar()
    later = torch.zeros(8)
    h = handler(tensors={"a": state()["big"], "b": later}, registrar=reg)
    later.numpy()  # marks b's storage as one torch will not resize: refused at the suspend, after a's plan
    with pytest.raises(HandlerError):
        h.suspend(OFFLOAD, ALL)
    assert len(reg.registered) == 1 and not reg.live and h.host_bytes() == 0


@pytest.mark.parametrize("batched", [False, True], ids=["per-storage", "batched"])
def test_a_resume_failing_midway_keeps_the_buffer_until_a_resume_succeeds(batched: bool) -> None:
    h, reg, tensors, before = failing(3, batched)
    h.suspend(OFFLOAD, ALL)
    held = dict(reg.live)
    h.fail_at = h.calls + 2
    with pytest.raises(RuntimeError, match="injected"):
        h.resume(OFFLOAD, ALL)
    assert reg.live == held and h.suspended_tags == {"state"}  # the bytes are still needed: kept, once
    h.resume(OFFLOAD, ALL)
    assert raw(tensors) == before and not reg.live and len(reg.registered) == 1


def test_a_failed_registration_falls_back_to_torchs_allocator_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    why = f"no pinning here {uuid.uuid4().hex[:8]}"
    reg = Registrar(fail=why)
    tensors = state(4)
    before = raw(tensors)
    h = handler(tensors=one_group(tensors), registrar=reg)
    with caplog.at_level(logging.WARNING, logger="timeslice.client"):
        for _ in range(3):
            h.suspend(OFFLOAD, ALL)
            h.resume(OFFLOAD, ALL)
            assert raw(tensors) == before
    assert h.host_memory_in_use == "cached" and why in (h.host_memory_fallback or "")
    assert len(reg.registered) == 1  # tried once, not at every suspend
    warned = [r for r in caplog.records if why in r.getMessage()]
    assert len(warned) == 1 and "torch's pinned allocator" in warned[0].getMessage()
    assert h.host_bytes() >= STATE_BYTES  # a cached buffer: kept across cycles, as before


def test_an_unregister_failure_is_logged_and_the_state_stays_intact(caplog: pytest.LogCaptureFixture) -> None:
    class Stuck(Registrar):
        def unregister(self, ptr: int) -> None:
            raise OSError("driver says no")

    tensors = state(5)
    before = raw(tensors)
    h = handler(tensors=one_group(tensors), registrar=Stuck())
    h.suspend(OFFLOAD, ALL)
    with caplog.at_level(logging.WARNING, logger="timeslice.client"):
        h.resume(OFFLOAD, ALL)
    assert raw(tensors) == before and h.host_bytes() == 0
    assert any("driver says no" in r.getMessage() for r in caplog.records)


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("registrar", [True, False], ids=["registered", "unregistered"])
def test_host_memory_goes_back_to_the_os_at_resume(registrar: bool) -> None:
    """64 MiB of state: after a cycle the process holds what it held before it, not 64 MiB more (torch's
    allocators keep the buffer; on today's code this grows by the state's size)."""
    big = torch.ones(64 * MiB, dtype=torch.uint8)
    h = TorchOffloadHandler(
        big,
        device="cpu",
        host_memory="registered",
        registrar=Registrar() if registrar else None,
        keep_host_buffers=False,
    )
    gc.collect()
    start = _rss()
    h.suspend(OFFLOAD, ALL)
    assert h.host_bytes() >= 64 * MiB and _rss() > start - 16 * MiB  # the bytes moved to the host buffer
    h.resume(OFFLOAD, ALL)
    gc.collect()
    assert _rss() - start < 16 * MiB, (start, _rss())
    assert int(big[-1]) == 1


def test_defaults_and_validation() -> None:
    assert TorchOffloadHandler(torch.zeros(4), device="cpu").host_memory_in_use == "cached"  # CPU: as before
    with pytest.raises(ValueError, match="host_memory"):
        TorchOffloadHandler(torch.zeros(4), device="cpu", host_memory="exact")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        HostMemory("registered", pinned=False).allocate(0)


class FakeRuntime:
    """torch.cuda.cudart()'s two calls, answering ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.calls: list[tuple[Any, ...]] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # the runtime's names
        self.calls.append(("register", ptr, nbytes, flags))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return self.code

    def cudaError(self, code: int) -> int:
        return code

    def cudaGetErrorString(self, code: int) -> str:
        return "out of memory"


def test_the_cuda_registrar_pins_portable_and_says_why_it_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    ok = FakeRuntime(0)
    monkeypatch.setattr(_pinned_host, "_runtime", lambda: ok)
    CudaRegistrar().register(4096, 10)
    CudaRegistrar().unregister(4096)
    assert ok.calls == [("register", 4096, 10, 1), ("unregister", 4096)]  # 1: cudaHostRegisterPortable
    cleared: list[bool] = []
    monkeypatch.setattr(_pinned_host, "_clear_last_error", lambda: cleared.append(True))
    monkeypatch.setattr(_pinned_host, "_runtime", lambda: FakeRuntime(2))
    with pytest.raises(OSError, match=r"cudaHostRegister of 10 bytes failed: out of memory \(2\)"):
        CudaRegistrar().register(4096, 10)
    assert cleared == [True]  # the runtime's last error, which torch's next launch check would report as its own
