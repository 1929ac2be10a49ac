"""``torch_swap.swap``: two handlers of one process switched, overlapped where the device allows.

On CPU the overlap gains nothing (``can_overlap`` says no), but forcing it runs the same threads and
ordering as on CUDA, so correctness and failure handling are tested here; the bandwidth is measured by
``bench/gpu_check.py`` on a GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from timeslice_client.errors import HandlerError  # noqa: E402
from timeslice_client.protocol import SuspendMode  # noqa: E402
from timeslice_client.torch_offload import TorchOffloadHandler  # noqa: E402
from timeslice_client.torch_swap import can_overlap, swap  # noqa: E402

MB = 1 << 20


def job(seed: int, n: int = 3) -> tuple[list[object], TorchOffloadHandler]:
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(MB // 4 + i, generator=gen) for i in range(n)]
    return tensors, TorchOffloadHandler(tensors={"state": tensors}, device="cpu")


@pytest.mark.parametrize("overlap", [False, True])
def test_swap_moves_both_ways_bit_exact_into_the_same_tensors(overlap: bool) -> None:
    a, ha = job(1)
    b, hb = job(2)
    a_bytes = [t.clone() for t in a]  # type: ignore[attr-defined]
    b_bytes = [t.clone() for t in b]  # type: ignore[attr-defined]
    hb.suspend(SuspendMode.OFFLOAD, frozenset())
    assert hb.device_bytes() == 0 and sum(hb.saved_bytes_by_device().values()) == sum(x.nbytes for x in b_bytes)
    ids = [id(t) for t in b]
    res = swap(ha, hb, overlap=overlap)
    assert res.overlapped is overlap
    assert ha.device_bytes() == 0 and ha.suspended_tags and not hb.suspended_tags
    assert res.suspended.bytes_moved == sum(x.nbytes for x in a_bytes)
    assert res.resumed.bytes_moved == sum(x.nbytes for x in b_bytes)
    assert [id(t) for t in b] == ids
    for t, want in zip(b, b_bytes, strict=True):
        assert torch.equal(t, want)
    swap(hb, ha, overlap=overlap)
    for t, want in zip(a, a_bytes, strict=True):
        assert torch.equal(t, want)


def test_on_cpu_overlap_is_not_chosen() -> None:
    _, ha = job(1)
    _, hb = job(2)
    hb.suspend(SuspendMode.OFFLOAD, frozenset())
    assert can_overlap(ha, hb) is False
    assert swap(ha, hb).overlapped is False


def test_a_failing_suspend_is_rolled_back_and_the_resume_still_completes() -> None:
    a, ha = job(1)
    borrowed = torch.ones(1024)
    bad = TorchOffloadHandler(tensors={"state": [borrowed, *a]}, device="cpu")
    borrowed.numpy()  # not resizable from now on: its suspend is refused
    b, hb = job(2)
    want = [t.clone() for t in b]  # type: ignore[attr-defined]
    hb.suspend(SuspendMode.OFFLOAD, frozenset())
    with pytest.raises(HandlerError, match=r"suspend of the outgoing state failed.*the incoming state was resumed"):
        swap(bad, hb, overlap=True)
    assert not bad.suspended_tags and bad.device_bytes() > 0
    for t, w in zip(b, want, strict=True):
        assert torch.equal(t, w)
    assert not ha.suspended_tags


def test_swap_needs_two_handlers() -> None:
    _, ha = job(1)
    with pytest.raises(ValueError, match="two different handlers"):
        swap(ha, ha)
