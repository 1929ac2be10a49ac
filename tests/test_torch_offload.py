"""TorchOffloadHandler on CPU tensors (standing in for the device when CUDA is absent)."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from timeslice_client import errors  # noqa: E402
from timeslice_client.errors import HandlerError, TimeSliceError  # noqa: E402
from timeslice_client.handlers import HandlerResult, WorkloadHandler  # noqa: E402
from timeslice_client.protocol import SuspendMode  # noqa: E402
from timeslice_client.torch_offload import TorchOffloadHandler as _Handler  # noqa: E402

from .failing_copy import FailingCopy  # noqa: E402

OFFLOAD = SuspendMode.OFFLOAD
DISCARD = SuspendMode.DISCARD
ALL: frozenset[str] = frozenset()


class TorchOffloadHandler(_Handler):
    """The handler on CPU tensors, also where CUDA is available (where it would only touch CUDA tensors)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("device", "cpu")
        super().__init__(*args, **kwargs)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)  # buffers: running stats, num_batches_tracked
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: Any) -> Any:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def make(seed: int = 0) -> tuple[Net, Any]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: Net, opt: Any, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=gen)
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()


def state_tensors(model: Net, opt: Any) -> dict[str, Any]:
    """Every tensor of the model (params, grads, buffers) and the optimizer state, by a stable name."""
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        out[name] = p
        if p.grad is not None:
            out[name + ".grad"] = p.grad
    for name, b in model.named_buffers():
        out[name] = b
    for i, p in enumerate(model.parameters()):
        for key, value in opt.state[p].items():
            out[f"opt.{i}.{key}"] = value
    return out


def bits(t: Any) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def snapshot(tensors: dict[str, Any]) -> dict[str, bytes]:
    return {name: bits(t) for name, t in tensors.items()}


def unique_nbytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.fixture
def trained() -> tuple[Net, Any]:
    model, opt = make()
    train(model, opt, 1, seed=1)  # Adam creates its state lazily, in the first step
    return model, opt


def test_offload_frees_and_restores_bit_exact_with_same_objects(trained: tuple[Net, Any]) -> None:
    model, opt = trained
    handler = TorchOffloadHandler(modules={"weights": model}, optimizers={"optimizer": opt})
    assert isinstance(handler, WorkloadHandler)
    tensors = state_tensors(model, opt)
    before = snapshot(tensors)
    params = list(model.parameters())
    opt_state = {id(p): dict(opt.state[p]) for p in params}
    total = unique_nbytes(tensors.values())
    assert handler.device_bytes() == total > 0

    result = handler.suspend(OFFLOAD, ALL)
    assert result == HandlerResult(bytes_moved=total, device_bytes_freed=total)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
    assert handler.device_bytes() == 0
    assert handler.host_bytes() >= total
    assert handler.suspended_tags == {"weights", "optimizer"}

    result = handler.resume(OFFLOAD, ALL)
    assert result == HandlerResult(bytes_moved=total, device_bytes_freed=total)
    assert handler.device_bytes() == total
    assert handler.suspended_tags == frozenset()
    assert snapshot(tensors) == before
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params, strict=True))
    for p in params:
        assert isinstance(p, torch.nn.Parameter)
        for key, value in opt.state[p].items():
            assert value is opt_state[id(p)][key]
    after = state_tensors(model, opt)
    assert all(after[name] is tensors[name] for name in tensors)


def test_training_after_resume_matches_uninterrupted_run() -> None:
    ref_model, ref_opt = make(seed=3)
    train(ref_model, ref_opt, 6, seed=7)

    model, opt = make(seed=3)
    handler = TorchOffloadHandler(model, opt)  # positional form: tags "weights" and "optimizer"
    assert handler.tags == {"weights", "optimizer"}
    gen_seed = 7
    gen = torch.Generator().manual_seed(gen_seed)
    for step in range(6):
        x = torch.randn(5, 8, generator=gen)
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()
        if step in (0, 3):
            handler.suspend(OFFLOAD, ALL)
            handler.resume(OFFLOAD, ALL)
    assert snapshot(state_tensors(model, opt)) == snapshot(state_tensors(ref_model, ref_opt))


def test_optimizer_state_created_after_construction_is_included() -> None:
    model, opt = make()
    handler = TorchOffloadHandler(modules={"weights": model}, optimizers={"optimizer": opt})
    assert handler.device_bytes({"optimizer"}) == 0
    assert handler.suspend(OFFLOAD, frozenset({"optimizer"})) == HandlerResult()  # nothing there yet
    handler.resume(OFFLOAD, frozenset({"optimizer"}))
    train(model, opt, 1, seed=1)
    state = [t for p in model.parameters() for t in opt.state[p].values()]
    state_bytes = unique_nbytes(state)
    assert handler.device_bytes({"optimizer"}) == state_bytes > 0
    result = handler.suspend(OFFLOAD, frozenset({"optimizer"}))
    # (no tensor in an assert while suspended: pytest's repr would read freed memory)
    freed = [t.untyped_storage().nbytes() == 0 for t in state]
    assert result.device_bytes_freed == state_bytes
    assert all(freed)
    handler.resume(OFFLOAD, frozenset({"optimizer"}))


def test_tied_weights_and_views_are_moved_once() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.out = torch.nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight
            self.register_buffer("table", torch.arange(12.0))

    model = Tied()
    table_views = [model.table[2:5], model.table.view(3, 4), model.table]
    row = model.emb.weight[1]  # a view the handler does not know about
    handler = TorchOffloadHandler(modules={"weights": model}, tensors={"views": table_views})
    total = 10 * 4 * 4 + 12 * 4
    assert handler.device_bytes() == total
    before = bits(model.emb.weight), bits(model.table)

    assert handler.suspend(OFFLOAD, ALL) == HandlerResult(total, total)
    assert row.untyped_storage().nbytes() == 0
    assert handler.resume(OFFLOAD, ALL) == HandlerResult(total, total)
    assert (bits(model.emb.weight), bits(model.table)) == before
    assert model.out.weight is model.emb.weight
    with torch.no_grad():
        model.emb.weight[1, 0] = 42.0
        model.table[3] = -1.0
    assert row[0].item() == 42.0  # views still alias the (re-allocated) storage
    assert table_views[0][1].item() == -1.0 and table_views[1][0, 3].item() == -1.0


def test_tags_select_subsets(trained: tuple[Net, Any]) -> None:
    model, opt = trained
    cache = [torch.randn(3, 5), torch.randn(7)]
    handler = TorchOffloadHandler(
        modules={"weights": model}, optimizers={"optimizer": opt}, tensors={"kv_cache": cache}
    )
    weights = handler.device_bytes({"weights"})
    optim = handler.device_bytes({"optimizer"})
    kv = handler.device_bytes({"kv_cache"})
    assert kv == (15 + 7) * 4 and handler.device_bytes() == weights + optim + kv
    before = snapshot(state_tensors(model, opt)), [bits(t) for t in cache]

    assert handler.suspend(OFFLOAD, frozenset({"optimizer", "kv_cache"})).device_bytes_freed == optim + kv
    assert handler.device_bytes({"optimizer", "kv_cache"}) == 0
    assert handler.device_bytes() == weights
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert handler.suspend(OFFLOAD, frozenset({"optimizer"})) == HandlerResult()  # already suspended
    assert handler.resume(OFFLOAD, frozenset({"weights"})) == HandlerResult()  # was never suspended
    assert handler.resume(OFFLOAD, frozenset({"unknown-tag"})) == HandlerResult()

    assert handler.resume(OFFLOAD, frozenset({"kv_cache"})) == HandlerResult(kv, kv)
    assert handler.suspended_tags == {"optimizer"}
    assert handler.resume(OFFLOAD, ALL) == HandlerResult(optim, optim)
    assert (snapshot(state_tensors(model, opt)), [bits(t) for t in cache]) == before


def test_suspend_twice_and_resume_unsuspended_are_noops(trained: tuple[Net, Any]) -> None:
    model, opt = trained
    handler = TorchOffloadHandler(model, opt)
    assert handler.resume(OFFLOAD, ALL) == HandlerResult()
    first = handler.suspend(OFFLOAD, ALL)
    assert first.bytes_moved > 0
    assert handler.suspend(OFFLOAD, ALL) == HandlerResult()
    assert handler.suspend(DISCARD, ALL) == HandlerResult()
    assert handler.resume(OFFLOAD, ALL) == first
    assert handler.resume(OFFLOAD, ALL) == HandlerResult()


def test_discard_frees_without_copying_and_resume_zero_fills(trained: tuple[Net, Any]) -> None:
    model, opt = trained
    handler = TorchOffloadHandler(modules={"weights": model}, optimizers={"optimizer": opt})
    tensors = state_tensors(model, opt)
    total = handler.device_bytes()
    result = handler.suspend(DISCARD, ALL)
    assert result == HandlerResult(bytes_moved=0, device_bytes_freed=total)
    assert handler.host_bytes() == 0 and handler.device_bytes() == 0
    assert handler.resume(OFFLOAD, ALL) == HandlerResult(bytes_moved=0, device_bytes_freed=total)
    assert handler.device_bytes() == total
    for t in tensors.values():
        assert t.untyped_storage().nbytes() > 0
        assert not bits(t).strip(b"\0")


@pytest.mark.parametrize("batched", [False, True], ids=["per-storage", "batched"])
def test_failed_suspend_rolls_back_every_tensor(trained: tuple[Net, Any], batched: bool) -> None:
    model, opt = trained
    handler = FailingCopy(model, opt, device="cpu", fail_at=3, batched=batched)
    tensors = state_tensors(model, opt)
    handler.tracked = list(tensors.values())
    before = snapshot(tensors)
    total = handler.device_bytes()
    with pytest.raises(RuntimeError, match="injected"):
        handler.suspend(OFFLOAD, ALL)
    if batched:
        assert handler.freed_before_failure == 0  # every copy comes before the first free
    else:
        assert handler.freed_before_failure >= 2  # the rollback had something to put back
    assert all(t.untyped_storage().nbytes() > 0 for t in tensors.values())
    assert snapshot(tensors) == before
    assert handler.device_bytes() == total and handler.suspended_tags == frozenset()
    # The handler is usable afterwards.
    handler.fail_at = 0
    assert handler.suspend(OFFLOAD, ALL).bytes_moved == total
    assert handler.resume(OFFLOAD, ALL).bytes_moved == total
    assert snapshot(tensors) == before


@pytest.mark.parametrize("batched", [False, True], ids=["per-storage", "batched"])
def test_failed_resume_stays_suspended_and_can_retry(trained: tuple[Net, Any], batched: bool) -> None:
    model, opt = trained

    class FailOnce(TorchOffloadHandler):
        armed = False

        def _arm(self) -> None:
            if self.armed:
                self.armed = False
                raise RuntimeError("injected restore failure")

        def _copy_bytes(self, dst: Any, src: Any) -> None:
            self._arm()
            super()._copy_bytes(dst, src)

        def _copy_all(self, pairs: list[tuple[Any, Any]]) -> None:
            self._arm()
            super()._copy_all(pairs)

    handler = FailOnce(model, opt)
    handler._batched = batched
    tensors = state_tensors(model, opt)
    before = snapshot(tensors)
    handler.suspend(OFFLOAD, ALL)
    handler.armed = True
    with pytest.raises(RuntimeError, match="injected"):
        handler.resume(OFFLOAD, ALL)
    assert handler.suspended_tags == {"weights", "optimizer"} and handler.device_bytes() == 0
    handler.resume(OFFLOAD, ALL)
    assert snapshot(tensors) == before


def test_unresizable_storage_is_refused_before_anything_moves() -> None:
    owned = torch.randn(4)
    later = torch.randn(4)
    handler = TorchOffloadHandler(tensors={"a": [owned], "b": [later]})
    later.numpy()  # after the handler was made: its storage cannot be resized from now on
    with pytest.raises(HandlerError, match="not resizable") as info:
        handler.suspend(OFFLOAD, ALL)
    assert isinstance(info.value, TimeSliceError) and info.value.tag == "b"
    assert owned.untyped_storage().nbytes() == 16 and handler.suspended_tags == frozenset()


@pytest.mark.parametrize("how", ["numpy", "asarray", "from_numpy", "frombuffer"])
def test_a_tensor_whose_memory_can_never_be_freed_is_refused_when_the_handler_is_made(how: str) -> None:
    """Issue 25 (item 5): a registered CPU tensor made non-resizable by ``.numpy()`` used to fault the job at its
    next switch, with words ("borrowed from numpy") that did not name the call. Refused now, naming it and the fix."""
    import numpy as np

    t = torch.randn(8)
    if how == "numpy":
        t.numpy()
    elif how == "asarray":
        np.asarray(t)
    elif how == "from_numpy":
        t = torch.from_numpy(np.ones(8, dtype=np.float32))
    else:
        t = torch.frombuffer(bytearray(32), dtype=torch.float32)
    with pytest.raises(HandlerError) as info:
        TorchOffloadHandler(tensors={"kv": [torch.randn(2), t]}, device="cpu")
    err = info.value
    assert isinstance(err, getattr(errors, "UnresizableStorage", ())), type(err)
    assert err.tag == "kv" and getattr(err, "what", None) == "tensor [1]"
    assert "`tensor.numpy()`" in str(err) and "`.clone()`" in str(err) and "tensor [1]" in str(err)
    TorchOffloadHandler(tensors={"kv": [t.clone()]}, device="cpu")  # the fix it names works


def test_a_module_parameter_after_numpy_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[1].bias.detach().numpy()
    with pytest.raises(HandlerError) as info:
        TorchOffloadHandler(model, device="cpu")
    assert "parameter '1.bias' of a Sequential" in str(info.value) and info.value.tag == "weights"


def test_numpy_after_the_handler_was_made_is_refused_at_the_suspend_naming_the_call() -> None:
    model = torch.nn.Linear(4, 4)
    handler = TorchOffloadHandler(model, tensors={"kv": {"k": torch.randn(4), "v": torch.randn(4)}}, device="cpu")
    float(model.weight.detach().numpy().sum())  # a log line inside the training loop, say
    with pytest.raises(HandlerError) as info:
        handler.suspend(OFFLOAD, ALL)
    assert isinstance(info.value, getattr(errors, "UnresizableStorage", ())), type(info.value)
    assert "parameter 'weight' of a Linear" in str(info.value) and "`tensor.numpy()`" in str(info.value)
    assert handler.suspended_tags == frozenset() and handler.device_bytes() > 0  # nothing moved


def test_repeated_cycles_reuse_host_buffers(trained: tuple[Net, Any]) -> None:
    model, opt = trained
    handler = TorchOffloadHandler(model, opt)
    assert handler.host_bytes() == 0
    prepared = handler.prepare()
    assert prepared == handler.host_bytes() >= handler.device_bytes()
    buffers = {tag: g.host.tensor.data_ptr() for tag, g in handler._groups.items()}
    for _ in range(5):
        handler.suspend(OFFLOAD, ALL)
        handler.resume(OFFLOAD, ALL)
        train(model, opt, 1, seed=2)
        assert handler.host_bytes() == prepared
        assert {tag: g.host.tensor.data_ptr() for tag, g in handler._groups.items()} == buffers
    assert handler.release_host_buffers() == prepared and handler.host_bytes() == 0


def test_large_tensor_is_copied_in_chunks_bit_exact() -> None:
    """Per storage (as on CUDA): ``_copy_bytes`` splits the storage into chunks."""
    big = torch.randn(100_003)  # 400 012 bytes, not a multiple of the chunk
    view = big[17:]
    handler = TorchOffloadHandler(big, chunk_bytes=4096)
    handler._batched = False
    before = bits(big)
    copies: list[int] = []
    original = handler._copy_bytes

    def spy(dst: Any, src: Any) -> None:
        copies.append(int(src.numel()))
        original(dst, src)

    handler._copy_bytes = spy  # type: ignore[method-assign]
    assert handler.suspend(OFFLOAD, ALL).bytes_moved == 400_012
    assert handler.resume(OFFLOAD, ALL).bytes_moved == 400_012
    assert copies == [400_012, 400_012] and bits(big) == before and view.data_ptr() == big.data_ptr() + 17 * 4


def test_batched_copies_go_in_one_call_of_chunks_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batched (CPU): every storage's chunks in one ``torch._foreach_copy_`` call each way."""
    from timeslice_client import _torch_copies

    big = torch.randn(100_003)  # 400 012 bytes: 97 chunks of 4096 and one of 2700
    small = [torch.randn(10) for _ in range(3)]
    handler = TorchOffloadHandler(tensors={"t": [big, *small]}, chunk_bytes=4096)
    before = [bits(t) for t in (big, *small)]
    calls: list[list[int]] = []
    original = _torch_copies._FOREACH_COPY
    assert original is not None  # torch >= 2.1 here

    def spy(dst: list[Any], src: list[Any]) -> None:
        calls.append([int(s.numel()) for s in src])
        original(dst, src)

    monkeypatch.setattr(_torch_copies, "_FOREACH_COPY", spy)
    assert handler.suspend(OFFLOAD, ALL).bytes_moved == 400_012 + 3 * 40
    assert all(t.untyped_storage().nbytes() == 0 for t in (big, *small))
    assert handler.resume(OFFLOAD, ALL).bytes_moved == 400_012 + 3 * 40
    assert [bits(t) for t in (big, *small)] == before
    assert len(calls) == 2 and calls[0] == calls[1]
    assert sorted(calls[0]) == sorted([4096] * 97 + [2700] + [40] * 3)


def test_callable_source_and_worker_thread() -> None:
    cache: dict[str, Any] = {}
    handler = TorchOffloadHandler(tensors={"kv_cache": lambda: list(cache.values())})
    assert handler.device_bytes() == 0
    cache["k"] = torch.randn(64)
    cache["v"] = torch.randn(64)
    before = {k: bits(v) for k, v in cache.items()}
    results: list[HandlerResult] = []

    def worker() -> None:
        results.append(handler.suspend(OFFLOAD, frozenset({"kv_cache"})))
        results.append(handler.resume(OFFLOAD, frozenset({"kv_cache"})))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert results == [HandlerResult(512, 512), HandlerResult(512, 512)]
    assert {k: bits(v) for k, v in cache.items()} == before


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="nothing to offload"):
        TorchOffloadHandler()
    with pytest.raises(TypeError, match="cannot offload"):
        TorchOffloadHandler("model")
    with pytest.raises(TypeError, match="not a torch"):
        TorchOffloadHandler(modules={"weights": [torch.randn(2)]})
    with pytest.raises(ValueError, match="chunk_bytes"):
        TorchOffloadHandler(torch.randn(2), chunk_bytes=0)
    with pytest.raises(ValueError, match="device"):
        _Handler(torch.randn(2), device="tpu")


def test_importing_the_client_does_not_import_torch() -> None:
    code = "import sys, timeslice_client, timeslice_client.handlers; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0


def test_mode_may_come_as_a_plain_string() -> None:
    t = torch.randn(16)
    before = bits(t)
    handler = TorchOffloadHandler(tensors={"kv_cache": t})
    assert handler.suspend("offload", frozenset({"kv_cache"})) == HandlerResult(64, 64)  # type: ignore[arg-type]
    assert handler.resume("offload", frozenset({"kv_cache"})) == HandlerResult(64, 64)  # type: ignore[arg-type]
    assert bits(t) == before
    with pytest.raises(ValueError):
        handler.suspend("sideways", ALL)  # type: ignore[arg-type]
