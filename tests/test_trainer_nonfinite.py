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


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_check_names_a_non_finite_parameter_wherever_it_is(bad: float, dtype) -> None:
    from fuelline.trainer.finite import NonFiniteError, check_finite

    model = torch.nn.Sequential(torch.nn.Linear(4, 300), torch.nn.Linear(300, 2)).to(dtype)
    with torch.no_grad():
        model[1].weight[1, 299] = bad
    with pytest.raises(NonFiniteError, match=r"step 7: parameter '1.weight' is no longer finite \(1 of 600 values\)"):
        check_finite(model, 7)


def test_finite_parameters_whose_sum_overflows_pass_the_check() -> None:
    from fuelline.trainer.finite import check_finite

    model = torch.nn.Linear(100, 100)
    with torch.no_grad():
        model.weight.fill_(3e37)  # every element finite, their sum past float32's range
    assert not torch.isfinite(model.weight.sum())
    check_finite(model, 1)  # no error
    half = torch.nn.Linear(100, 100).half()
    with torch.no_grad():
        half.weight.fill_(60000.0)  # finite in float16, the sum of 10,000 of them is not
    check_finite(half, 1)
