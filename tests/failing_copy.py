"""A torch offload handler whose copies fail on purpose, for the tests of its rollback. It needs torch: import it
after ``pytest.importorskip("torch")``."""

from __future__ import annotations

from typing import Any

from timeslice_client.torch_offload import TorchOffloadHandler


class FailingCopy(TorchOffloadHandler):
    """Raises on the ``fail_at``-th storage copied, either way (0: never; it fails once, then copies again): each
    storage is one ``_copy_bytes`` call (per storage, as on CUDA), or one pair of the one ``_copy_all`` call
    (batched, as on CPU). ``freed_before_failure``: how many of ``tracked`` had their storage freed by then."""

    def __init__(self, *args: Any, fail_at: int = 0, batched: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batched = batched
        self.fail_at = fail_at
        self.calls = 0
        self.freed_before_failure = 0
        self.tracked: list[Any] = []

    def _fail(self, n: int) -> None:
        self.calls += n
        if self.fail_at and self.calls >= self.fail_at:
            self.fail_at = 0
            self.freed_before_failure = sum(t.untyped_storage().nbytes() == 0 for t in self.tracked)
            raise RuntimeError("injected copy failure")

    def _copy_bytes(self, dst: Any, src: Any) -> None:
        self._fail(1)
        super()._copy_bytes(dst, src)

    def _copy_all(self, pairs: list[tuple[Any, Any]]) -> None:
        self._fail(len(pairs))
        super()._copy_all(pairs)
