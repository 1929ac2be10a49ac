"""``timeslice advise`` predicts the demo's shared run from its solo runs (made before the shared run starts:
demo/_predict.py) within 10% of what the demo then measures. Numpy jobs of 6 steps with the demo's default modelled
reward latency (500 ms), so each run is a few seconds of real phases, not start-up noise."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_demo import run_demo

# Compares wall-clock runs (shared against solo or predicted): one CI worker runs these modules one after another
# (``--dist loadgroup``), so they never load the 2 cores against each other.
pytestmark = pytest.mark.xdist_group("wall_clock")


def test_advise_predicts_the_demos_shared_run_within_ten_percent(tmp_path: Path) -> None:
    rep, out = run_demo(tmp_path, "--numpy", "--steps", "6", "--reward-latency-ms", "500")
    predicted, measured, ratio = rep["predicted_shared_s"], rep["shared_s"], rep["prediction_ratio"]
    print(f"demo: predicted {predicted:.2f} s, measured {measured:.2f} s ({ratio:.2f}x)")
    assert rep["predicted_switch_costs"] == "timed by each job"
    assert 0.9 <= ratio <= 1.1, (predicted, measured)
    assert f"{ratio:.2f} x measured" in out
