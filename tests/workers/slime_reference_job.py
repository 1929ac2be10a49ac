"""One slime job as a process, with the reference project's slime package as its phase callback, over gRPC.

Run as (the environment as the reference package reads it: ``TIMESLICE_JOB_ID``, ``TIMESLICE_ORCH_ADDR``,
``TIMESLICE_TRAINER_GROUP``, ``TIMESLICE_SAMPLER_GROUP``)::

    python -m tests.workers.slime_reference_job --out RESULT.json [--steps N --seed S ...]

It runs slime's synchronous driver (``tests/workers/slime_standins.train``) with the callback slime would load
for ``--phase-callback-path timeslice_slime.callback.TimesliceCallback`` (made with no arguments, as slime's
``load_phase_callback`` does), and writes the intervals its actors worked on each pool, its final state's digest,
and which implementations it ran: the real ones wherever they are importable (``timeslice_slime`` from
``pkg/integrations/slime``, ``timeslice`` from ``pkg/client/python``, ``slime.utils.phase_callback`` from slime;
``$TIMESLICE_REFERENCE_PATH``, a checkout of the reference project, puts its two packages first on the path), else
the stand-ins of ``tests/workers/slime_reference_*.py`` and the protocol's base class below.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import time
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from . import slime_standins as slime

CALLBACK_PATH = "timeslice_slime.callback.TimesliceCallback"


def _importable(name: str, attr: str | None = None) -> bool:
    try:
        if importlib.util.find_spec(name) is None:
            return False
        return attr is None or hasattr(importlib.import_module(name), attr)
    except ImportError:  # a parent package is missing, or is another package of that name
        return False


class PhaseCallback:
    """slime's ``slime.utils.phase_callback.PhaseCallback`` (aishukamal/slime@feat/phase-callbacks): hooks that do
    nothing until a subclass overrides them."""

    def on_phase_begin(self, phase: str, role: str, context: dict[str, Any] | None = None) -> None:
        pass

    def on_phase_end(self, phase: str, role: str, context: dict[str, Any] | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def load_function(path: str) -> Any:
    """slime's ``slime.utils.misc.load_function``: ``module.attr`` by its dotted path."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def load_phase_callback(args: Any) -> Any:
    """slime's ``load_phase_callback``: the class named by ``--phase-callback-path``, made with no arguments."""
    path = getattr(args, "phase_callback_path", None)
    return load_function(path)() if path else None


def setup(reference: str | None) -> dict[str, str]:
    """Make the three imports resolve: the real modules where they exist, else the stand-ins."""
    if reference:
        root = Path(reference)
        sys.path[0:0] = [str(root / "pkg" / "client" / "python"), str(root / "pkg" / "integrations" / "slime")]
    used: dict[str, str] = {}
    if _importable("slime.utils.phase_callback", "PhaseCallback"):
        used["slime"] = "real"
    else:
        mods = {
            n: types.ModuleType(n) for n in ("slime", "slime.utils", "slime.utils.phase_callback", "slime.utils.misc")
        }
        mods["slime"].__path__ = []
        mods["slime.utils"].__path__ = []
        mods["slime.utils.phase_callback"].PhaseCallback = PhaseCallback  # type: ignore[attr-defined]
        mods["slime.utils.phase_callback"].load_phase_callback = load_phase_callback  # type: ignore[attr-defined]
        mods["slime.utils.misc"].load_function = load_function  # type: ignore[attr-defined]
        sys.modules.update(mods)
        used["slime"] = "stand-in"
    if _importable("timeslice", "TimeSliceOrchestratorClient"):
        used["timeslice"] = "real"
    else:
        sys.modules["timeslice"] = importlib.import_module("tests.workers.slime_reference_client")
        used["timeslice"] = "stand-in"
    if _importable("timeslice_slime.callback", "TimesliceCallback"):
        used["timeslice_slime"] = "real"
    else:
        from . import slime_reference_package

        slime_reference_package.install()
        used["timeslice_slime"] = "stand-in"
    return used


def run(a: argparse.Namespace) -> dict[str, Any]:
    used = setup(os.environ.get("TIMESLICE_REFERENCE_PATH"))
    from slime.utils.phase_callback import load_phase_callback as load

    args = slime.Args(num_rollout=a.steps, seed=a.seed, size=a.size, gen_s=a.gen_s, train_s=a.train_s, sync_s=a.sync_s)
    work: list[tuple[str, str, float, float]] = []

    @contextlib.contextmanager
    def on_work(pool: str, call: str) -> Iterator[None]:
        t0 = time.time()
        try:
            yield
        finally:
            work.append((pool, call, t0, time.time()))

    phase_cb = load(argparse.Namespace(phase_callback_path=CALLBACK_PATH))
    actors = slime.Actors(args, on_work=on_work)
    start = time.time()
    slime.train(args, actors, phase_cb)
    return {
        "used": used,
        "callback": f"{type(phase_cb).__module__}.{type(phase_cb).__qualname__}",
        "digest": actors.digest(),
        "work": work,
        "start": start,
        "end": time.time(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--gen-s", type=float, default=0.1)
    p.add_argument("--train-s", type=float, default=0.1)
    p.add_argument("--sync-s", type=float, default=0.02)
    result = run(p.parse_args(argv))
    Path(p.parse_args(argv).out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
