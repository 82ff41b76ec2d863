"""1-bit Adam: Adam before freezing, then compressed momentum on real gloo process groups, with
identical replicas and the bytes the hook counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fuelline.trainer.onebit import OneBitState
from fuelline.trainer.onebit_adam import OneBitAdam, register_onebit_adam

from support.onebit import (
    Ranks,
    _assert_replicas_identical,
    _message_bytes,
    _regression_data,
    ranks,  # noqa: F401  (a fixture)
)


# -- 1-bit Adam ---------------------------------------------------------------------------------
def _adam_worker(rank: int, world_size: int, steps: int, freeze_step: int) -> dict[str, Any]:
    x, y, x_all, y_all = _regression_data(rank % 2, torch.ones(32))
    final: dict[str, Any] = {}
    for mode in ["adam", "onebit_adam"]:
        torch.manual_seed(0)
        model = nn.Linear(32, 1)
        final["initial"] = float(nn.functional.mse_loss(model(x_all).squeeze(1), y_all).detach())
        ddp = DDP(model)
        if mode == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(ddp.parameters(), lr=3e-2)
        else:
            state = register_onebit_adam(ddp)
            opt = OneBitAdam(ddp.parameters(), lr=3e-2, freeze_step=freeze_step, state=state)
        gen = torch.Generator().manual_seed(rank)
        for step in range(steps):
            if mode == "onebit_adam" and step == freeze_step:
                final["warmup_bytes_per_element"] = state.bytes_per_element
                state.reset_stats()
            idx = torch.randint(0, x.shape[0], (32,), generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[idx]).squeeze(1), y[idx]).backward()
            opt.step()
            if mode == "onebit_adam":
                _assert_replicas_identical(model, world_size, step)
        with torch.no_grad():
            final[mode] = float(nn.functional.mse_loss(model(x_all).squeeze(1), y_all))
    final["bytes_sent"] = state.bytes_sent
    final["elements"] = state.elements
    return final


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_onebit_adam_converges_with_identical_replicas(ranks: Ranks, world_size: int) -> None:
    steps, freeze_step = 200, 100
    final = ranks(_adam_worker, world_size, steps, freeze_step)[0]
    # Measured: Adam 0.0104 / 0.0103, 1-bit Adam 0.0134 / 0.0131 at W = 2 / 4, from 33.3; the
    # noise floor is 0.01.
    assert final["onebit_adam"] < 1e-3 * final["initial"], final
    assert final["onebit_adam"] <= 2.0 * final["adam"], final
    # Warm-up: an fp32 ring all-reduce of the gradients. After: only the 33-element momentum,
    # counted as in the hook (2 (W - 1) messages of signs and scales per step).
    ring = 2 * (world_size - 1) / world_size * 4
    assert final["warmup_bytes_per_element"] == pytest.approx(ring, rel=0.1)
    compressed_steps = steps - freeze_step
    assert final["elements"] == 33 * compressed_steps
    per_step = 2 * (world_size - 1) * _message_bytes(33, world_size)
    assert final["bytes_sent"] == compressed_steps * per_step


def test_onebit_adam_is_adam_before_freezing() -> None:
    # No process group needed: before freeze_step the optimizer communicates nothing itself.
    x, y, _, _ = _regression_data(0, torch.ones(32))
    params = {}
    for name in ["adam", "onebit_adam"]:
        torch.manual_seed(0)
        model = nn.Linear(32, 1)
        opt = (
            torch.optim.Adam(model.parameters(), lr=1e-2)
            if name == "adam"
            else OneBitAdam(model.parameters(), lr=1e-2, freeze_step=1000)
        )
        for step in range(20):
            opt.zero_grad()
            nn.functional.mse_loss(model(x[step::20]).squeeze(1), y[step::20]).backward()
            opt.step()
        params[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(params["onebit_adam"], params["adam"])
    assert opt.state_dict()["onebit_steps"] == 20
    state = OneBitState()
    restored = OneBitAdam(nn.Linear(32, 1).parameters(), freeze_step=10, state=state)
    restored.load_state_dict(opt.state_dict())
    assert restored.steps == 20 and state.local_gradients  # past freeze_step: the hook stays local


# -- quiet parameters waking after the freeze -----------------------------------------------------
LR = 1e-3
BOUND = (1 - 0.9) / (1 - 0.999) ** 0.5  # Adam's largest step per unit lr with betas (0.9, 0.999)


def _quiet_then_awake(rank: int, world_size: int, steps: int, freeze_step: int) -> dict[str, Any]:
    """A linear model on unnormalised inputs whose second half is zero during the warm-up (a
    sensor that came online late, dead units): those weights freeze a variance of 0, and then
    get gradients of the inputs' scale. Records the largest step any weight took."""
    gen = torch.Generator().manual_seed(rank)
    torch.manual_seed(0)
    model = nn.Linear(32, 1)
    ddp = DDP(model)
    state = register_onebit_adam(ddp)
    opt = OneBitAdam(ddp.parameters(), lr=LR, freeze_step=freeze_step, state=state)
    largest = 0.0
    for step in range(steps):
        x = torch.randn(16, 32, generator=gen) * 100.0  # raw values, as a sensor gives them
        if step < freeze_step:
            x[:, 16:] = 0.0
        y = x.sum(dim=1) / 100.0
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x).squeeze(1), y).backward()
        opt.step()
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if step >= freeze_step:
            largest = max(largest, float((after - before).abs().max()))
    return {"largest": largest, "finite": bool(torch.isfinite(after).all())}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_weight_quiet_during_the_warmup_wakes_without_blowing_up(ranks: Ranks, world_size: int) -> None:
    for out in ranks(_quiet_then_awake, world_size, 60, 20):
        if world_size == 1:
            # Nothing compressed: Adam's own bound, with the bias correction of step 21 (the first
            # after the freeze).
            assert out["finite"] and out["largest"] <= LR * BOUND / (1 - 0.9**21) * 1.001, out
        else:
            # 1-bit: a block's scale is the mean magnitude of what it carries, error feedback
            # included, so a step may exceed Adam's bound by the error carried, never by orders
            # of magnitude (a frozen variance of 0 made it 1e5 times the learning rate).
            assert out["finite"] and out["largest"] <= 10 * LR * BOUND, out
