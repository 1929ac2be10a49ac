"""NumpyOffloadHandler: arrays really leave (their memory is freed, the objects stay) and come back
bit-exact; tags select what moves; DISCARD brings back zeros; arrays it cannot free are refused up front.
(The handler driven by a real agent over the bus is covered by tests/test_demo.py's numpy run.)"""

from __future__ import annotations

import numpy as np
import pytest
from timeslice_client import HandlerError, SuspendMode
from timeslice_client.numpy_offload import NumpyOffloadHandler


def _arrays(seed: int = 7) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    # Random bit patterns (NaN payloads and negative zeros included): only a byte-exact restore keeps them.
    shapes = ((33, 17), (17,), (5, 3, 2))
    weights = [rng.integers(0, 2**32, size=s, dtype=np.uint32).view(np.float32).copy() for s in shapes]
    optimizer = [rng.standard_normal(s) for s in ((33, 17), (17,))]
    return weights, optimizer


def _bytes(arrays: list[np.ndarray]) -> list[bytes]:
    return [a.tobytes() for a in arrays]


def test_offload_frees_and_restores_bit_exact_into_the_same_objects() -> None:
    weights, optimizer = _arrays()
    before = _bytes(weights + optimizer)
    shapes = [a.shape for a in weights + optimizer]
    ids = [id(a) for a in weights + optimizer]
    h = NumpyOffloadHandler(weights=weights, optimizer=optimizer)
    total = sum(len(b) for b in before)
    assert h.device_bytes() == total and h.host_bytes() == 0

    r = h.suspend(SuspendMode.OFFLOAD, frozenset())
    assert (r.bytes_moved, r.device_bytes_freed) == (total, total)
    assert all(a.size == 0 for a in weights + optimizer), "suspended arrays must hold no data"
    assert h.device_bytes() == 0 and h.host_bytes() >= total
    assert h.suspended_tags == {"weights", "optimizer"}

    r = h.resume(SuspendMode.OFFLOAD, frozenset())
    assert (r.bytes_moved, r.device_bytes_freed) == (total, total)
    assert [id(a) for a in weights + optimizer] == ids
    assert [a.shape for a in weights + optimizer] == shapes
    assert _bytes(weights + optimizer) == before
    assert h.suspended_tags == frozenset()


def test_cycles_reuse_the_host_buffer_and_track_updates_in_between() -> None:
    weights, optimizer = _arrays()
    h = NumpyOffloadHandler(weights=weights, optimizer=optimizer)
    for step in range(4):
        for i in range(len(optimizer)):
            optimizer[i] += step  # the job's work between two switches: what comes back is the latest state
        expected = _bytes(weights + optimizer)
        h.suspend(SuspendMode.OFFLOAD, frozenset())
        host = h.host_bytes()
        h.resume(SuspendMode.OFFLOAD, frozenset())
        assert _bytes(weights + optimizer) == expected
        assert h.host_bytes() == host


def test_tags_select_what_moves_and_repeats_are_harmless() -> None:
    weights, optimizer = _arrays()
    opt_before = _bytes(optimizer)
    w_before = _bytes(weights)
    h = NumpyOffloadHandler(weights=weights, optimizer=optimizer)
    r = h.suspend(SuspendMode.OFFLOAD, frozenset({"weights"}))
    assert r.bytes_moved == sum(len(b) for b in w_before)
    assert all(a.size == 0 for a in weights) and _bytes(optimizer) == opt_before
    assert h.suspend(SuspendMode.OFFLOAD, frozenset({"weights"})).bytes_moved == 0  # already suspended
    assert h.resume(SuspendMode.OFFLOAD, frozenset({"optimizer"})).bytes_moved == 0  # never suspended
    h.resume(SuspendMode.OFFLOAD, frozenset({"weights"}))
    assert _bytes(weights) == w_before
    with pytest.raises(HandlerError, match="unknown tags"):
        h.suspend(SuspendMode.OFFLOAD, frozenset({"kv_cache"}))


def test_discard_frees_without_copying_and_resumes_zeroed() -> None:
    weights, optimizer = _arrays()
    h = NumpyOffloadHandler(weights=weights, optimizer=optimizer)
    r = h.suspend(SuspendMode.DISCARD, frozenset({"optimizer"}))
    assert r.bytes_moved == 0 and r.device_bytes_freed == sum(a.nbytes for a in _arrays()[1])
    assert h.host_bytes() == 0
    r = h.resume(SuspendMode.DISCARD, frozenset({"optimizer"}))
    assert r.bytes_moved == 0
    assert all(a.shape == b.shape and not a.any() for a, b in zip(optimizer, _arrays()[1], strict=True))


def test_arrays_it_cannot_free_are_refused_up_front() -> None:
    base = np.arange(12, dtype=np.float64).reshape(3, 4).copy()
    with pytest.raises(HandlerError, match="own its memory"):
        NumpyOffloadHandler(weights=[base[1:]])  # a view
    with pytest.raises(HandlerError, match="C-contiguous"):
        NumpyOffloadHandler(weights=[np.asfortranarray(base)])
    with pytest.raises(ValueError, match="already registered"):
        NumpyOffloadHandler(weights=[base], optimizer=[base])
    with pytest.raises(TypeError, match="numpy array"):
        NumpyOffloadHandler(weights=[[1.0, 2.0]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="nothing to offload"):
        NumpyOffloadHandler()
