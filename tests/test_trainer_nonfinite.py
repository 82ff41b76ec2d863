"""A run whose parameters stop being finite stops at that step, says so in one line naming the
step and the parameter, exits non-zero, and leaves the last finite checkpoint the newest.

Real torchrun ranks (gloo) training a model of the user's own from a real ``fuelline serve``,
with a learning rate no model survives.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_trainer_own_model import CLASSES, separable_dataset, torchrun  # noqa: E402,F401  (the fixture too)


@pytest.mark.timeout(180)
def test_a_run_that_goes_non_finite_stops_at_that_step_and_keeps_the_last_finite_checkpoint(
        separable_dataset: Path, start_serve, tmp_path: Path) -> None:
    server = start_serve(separable_dataset, "--batch-size", "64")
    ck = tmp_path / "ck"
    metrics = tmp_path / "metrics.jsonl"
    result = torchrun(server.endpoint, "--model", "examples.own_model:build", "--epochs", "3", "--classes",
                      str(CLASSES), "--optimizer", "sgd", "--lr", "1e30", "--checkpoint-dir", str(ck),
                      "--checkpoint-every", "1", "--metrics-json", str(metrics))
    assert result.returncode != 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "is no longer finite" in line]
    assert len(said) == 1, result.stderr[-3000:]  # once, by rank 0, not once per rank
    step = int(re.search(r"step (\d+): parameter '[\w.]+' is no longer finite", said[0]).group(1))
    assert step < 32, said[0]  # the first epoch's 16 steps a rank: stopped at once, not trained on
    assert not metrics.exists() or not metrics.read_text().strip(), "an epoch of NaN was reported as done"
    # The newest checkpoint is the step before, and every parameter in it is finite.
    latest = json.loads((ck / "latest.json").read_text())
    assert latest["step"] == step - 1, (latest, said[0])
    for rank in (0, 1):
        state = torch.load(ck / f"step{step - 1:09d}-rank{rank}.pt", weights_only=True)
        assert all(bool(torch.isfinite(t).all()) for t in state["model"].values())
