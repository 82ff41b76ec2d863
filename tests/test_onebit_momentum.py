"""1-bit momentum SGD, and ``--compression onebit`` running the compressed-momentum optimizers.

The optimizer tests run on real gloo groups (the rank processes of support.onebit); the trainer
tests on torchrun against a real data server.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.trainer.cli import ONEBIT_SGD_MAX_WORLD, parse_args
from fuelline.trainer.onebit import OneBitState
from fuelline.trainer.onebit_momentum import register_momentum_hook
from fuelline.trainer.onebit_sgd import OneBitSGD

from support.onebit import _assert_replicas_identical, _message_bytes, _mlp, ranks  # noqa: F401
from support.trainer import lines, torchrun

WARMUP, STEPS = 5, 25


def _sgd_worker(rank: int, world_size: int, momentum: float) -> dict[str, Any]:
    model = _mlp(seed=1)
    ddp = DDP(model)
    state = register_momentum_hook(ddp)
    opt = OneBitSGD(ddp.parameters(), lr=0.05, momentum=momentum, warmup_steps=WARMUP, state=state)
    # Each rank its own data: the ranks' gradients, and so their momenta, differ.
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(256, 16, generator=gen)
    y = (x[:, :4] * torch.arange(1, 5)).argmax(dim=1)
    out: dict[str, Any] = {"local_before": state.local_gradients}
    for step in range(STEPS):
        if step == WARMUP:
            out["warmup_bytes_per_element"] = state.bytes_per_element
            state.reset_stats()
        idx = torch.randint(0, 256, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
        opt.step()
        _assert_replicas_identical(model, world_size, step)
    out["local_after"] = state.local_gradients
    out["bytes_sent"], out["elements"] = state.bytes_sent, state.elements
    out["elements_per_step"] = sum(p.numel() for p in model.parameters())
    out["tensors"] = len(list(model.parameters()))
    # Each rank keeps its own momentum once compressing: they differ across ranks.
    out["momentum"] = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_onebit_sgd_keeps_replicas_identical_and_sends_a_thirty_second_of_fp32(ranks, world_size: int) -> None:  # noqa: F811
    results = ranks(_sgd_worker, world_size, 0.9)  # replicas compared after every step, in the ranks
    first = results[0]
    assert not first["local_before"] and first["local_after"]  # fp32 warm-up, then the optimizer's exchange
    ring = 2 * (world_size - 1) / world_size * 4
    assert first["warmup_bytes_per_element"] == pytest.approx(ring, rel=0.1)
    n = first["elements_per_step"]
    compressed = STEPS - WARMUP
    assert first["elements"] == n * compressed
    # Each step also all-reduces one fp32 scale per tensor (the per-tensor scales), as a ring would.
    tensor_scales = 2 * (world_size - 1) * math.ceil(first["tensors"] / world_size) * 4
    per_step = 2 * (world_size - 1) * _message_bytes(n, world_size) + tensor_scales
    assert first["bytes_sent"] == compressed * per_step
    share = (first["bytes_sent"] / compressed - tensor_scales) / n / ring
    assert 1 / 32 <= share <= 0.033, share  # signs, plus one fp32 scale per 1024 elements
    assert not torch.equal(results[0]["momentum"], results[1]["momentum"])


def test_onebit_sgd_is_momentum_sgd_before_compressing() -> None:
    # No process group: during the warm-up the optimizer communicates nothing itself.
    params = {}
    for name in ("sgd", "onebit_sgd"):
        model = _mlp(seed=2)
        opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3) if name == "sgd"
               else OneBitSGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, warmup_steps=1000))
        gen = torch.Generator().manual_seed(5)
        for _ in range(15):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=gen)).square().mean().backward()
            opt.step()
        params[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(params["onebit_sgd"], params["sgd"])
    state = OneBitState()
    restored = OneBitSGD(_mlp(seed=2).parameters(), warmup_steps=10, state=state)
    restored.load_state_dict(opt.state_dict())
    assert restored.steps == 15 and state.local_gradients and state.payload == "momentum"


@pytest.mark.parametrize("bad", [{"momentum": 1.0}, {"lr": -1.0}, {"warmup_steps": -1}, {"error_decay": 1.5}])
def test_onebit_sgd_refuses_hyperparameters_out_of_range(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        OneBitSGD(_mlp().parameters(), **bad)


# -- a quiet tensor beside loud ones ------------------------------------------------------------
QUIET_LR, QUIET_WARMUP, WAKE, QUIET_STEPS = 2e-6, 10, 35, 60


class _Sensors(nn.Module):
    """A linear model on two sensors' raw readings (scale 100, unnormalised). The first sensor is
    offline until step ``WAKE`` (its inputs are zeros); its weights come first, so they share a
    block of the exchange with the other sensor's loud weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.late = nn.Linear(16, 1, bias=False)
        self.raw = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.late(z) + self.raw(x)


def _quiet_tensors(rank: int, world_size: int) -> dict[str, Any]:
    """Momentum SGD and 1-bit SGD on the same data: how far the offline sensor's weights moved
    before it woke, and the largest step of the raw sensor's bias and, once awake, of the late
    sensor's weights."""
    out: dict[str, Any] = {}
    for mode in ("sgd", "onebit_sgd"):
        model = _Sensors()
        ddp = DDP(model)
        if mode == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(ddp.parameters(), lr=QUIET_LR, momentum=0.9)
        else:
            state = register_momentum_hook(ddp)
            opt = OneBitSGD(ddp.parameters(), lr=QUIET_LR, momentum=0.9, warmup_steps=QUIET_WARMUP, state=state)
        gen = torch.Generator().manual_seed(rank)
        asleep = model.late.weight.detach().clone()
        largest = {"bias": 0.0, "late": 0.0}
        for step in range(QUIET_STEPS):
            x = torch.randn(16, 32, generator=gen) * 100.0
            z = torch.randn(16, 16, generator=gen) * 100.0 if step >= WAKE else torch.zeros(16, 16)
            y = (x.sum(dim=1) + z.sum(dim=1)) / 100.0
            before = {"bias": model.raw.bias.detach().clone(), "late": model.late.weight.detach().clone()}
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x, z).squeeze(1), y).backward()
            opt.step()
            if mode == "onebit_sgd":
                _assert_replicas_identical(model, world_size, step)
            if step == WAKE - 1:
                out[f"{mode}_moved_asleep"] = float((model.late.weight.detach() - asleep).abs().max())
            if step >= QUIET_WARMUP:
                largest["bias"] = max(largest["bias"], float((model.raw.bias.detach() - before["bias"]).abs().max()))
            if step >= WAKE:
                largest["late"] = max(largest["late"], float((model.late.weight.detach() - before["late"]).abs().max()))
        out[f"{mode}_bias"], out[f"{mode}_late"] = largest["bias"], largest["late"]
        out[f"{mode}_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out


@pytest.mark.timeout(120)
def test_a_quiet_tensor_takes_steps_of_its_own_size_not_its_loud_neighbours(ranks) -> None:  # noqa: F811
    out = ranks(_quiet_tensors, 2)[0]  # replicas compared after every step, in the ranks
    assert out["sgd_finite"] and out["onebit_sgd_finite"], out
    # No gradient on any rank: momentum SGD does not move it, and neither does 1-bit SGD (without
    # per-tensor scales it was delivered its block's mean, and had moved 0.003 by then).
    assert out["sgd_moved_asleep"] == 0.0 and out["onebit_sgd_moved_asleep"] == 0.0, out
    # The bias's gradient is a hundredth of its weights': measured 1.15 times momentum SGD's largest
    # step (122 times, at the scale of the weights, without per-tensor scales).
    assert out["onebit_sgd_bias"] <= 4 * out["sgd_bias"], out
    # Awake, the late sensor is scaled by what it carries now: no blow-up (measured 0.4 times).
    assert out["onebit_sgd_late"] <= 4 * out["sgd_late"], out


# -- the trainer ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("onebit-momentum")
    synthesize(str(root / "raw"), 12, 20.0, 4, video_dim=8, drop=0.001)
    convert(str(root / "raw"), str(root / "data"), progress=False)
    return root / "data"


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("options", "compressed"), [
    # The warm-up left at auto: 15 % of the run's steps.
    (("--optimizer", "adam"), "momentum"),
    (("--optimizer", "sgd", "--lr", "0.01", "--warmup-iters", "3"), "momentum"),
    # Without momentum there is none to exchange: the gradient hook compresses the gradients.
    (("--optimizer", "sgd", "--momentum", "0", "--lr", "0.01", "--warmup-iters", "3"), "gradients"),
], ids=["adam", "sgd", "sgd-without-momentum"])
def test_compression_onebit_exchanges_the_momentum_in_one_bit(dataset: Path, start_serve, tmp_path: Path,
                                                             options: tuple[str, ...], compressed: str) -> None:
    server = start_serve(dataset, "--batch-size", "16")
    metrics = tmp_path / "metrics.jsonl"
    result = torchrun(server.endpoint, "--epochs", "2", "--compression", "onebit", "--metrics-json", str(metrics),
                      *options, timeout=150)
    records = lines(metrics)
    assert [r["epoch"] for r in records] == [0, 1]
    # Said once, by rank 0: from which step of how many it compresses.
    said = re.findall(r"1-bit from step (\d+) of (\d+) \((--[\w-]+)\)", result.stderr)
    assert len(said) == 1, result.stderr[-3000:]
    start, planned, option = int(said[0][0]), int(said[0][1]), said[0][2]
    assert planned == records[-1]["step"], (said, records[-1]["step"])  # epochs x batches per epoch
    given = "--freeze-step" in options or "--warmup-iters" in options
    assert start == (3 if given else max(1, round(0.15 * planned))), (said, options)
    assert option == ("--freeze-step" if "adam" in options else "--warmup-iters")
    # The whole run's bytes per element lie between the warm-up's fp32 and the compressed epoch's.
    assert records[1]["grad_bytes_per_element"] < records[1]["run_grad_bytes_per_element"] < 4.0
    # Past the warm-up (the variance frozen, for Adam) the optimizer's momentum crosses the wire,
    # not the gradients.
    assert {r["compression"] for r in records} == {"onebit-momentum" if compressed == "momentum" else "onebit"}
    assert records[1]["compressed"] == compressed
    share = records[1]["grad_bytes_per_element"] / (2 * (2 - 1) / 2 * 4)
    # 1-bit SGD also all-reduces one fp32 scale per tensor each step (onebit_sgd's design note
    # "per-tensor scales"): 52 tensors of 3,750 elements in all here, which makes 0.046.
    per_tensor = "sgd" in options and compressed == "momentum"
    assert 1 / 32 <= share <= (0.047 if per_tensor else 0.033), share
    assert all(math.isfinite(r["train_loss"]) for r in records)


@pytest.mark.timeout(200)
def test_a_run_too_short_for_its_warmup_says_compression_never_starts(dataset: Path, start_serve,
                                                                      tmp_path: Path) -> None:
    server = start_serve(dataset, "--batch-size", "16")
    metrics = tmp_path / "metrics.jsonl"
    result = torchrun(server.endpoint, "--epochs", "1", "--compression", "onebit", "--optimizer", "adam",
                      "--freeze-step", "1000", "--metrics-json", str(metrics), timeout=150)
    warned = [line for line in result.stderr.splitlines() if "1-bit compression never starts in this run" in line]
    assert len(warned) == 1 and "--freeze-step 1000" in warned[0], result.stderr[-3000:]
    (record,) = lines(metrics)
    assert record["compressed"] is None and record["run_grad_bytes_per_element"] == pytest.approx(4.0, rel=0.01)


# -- what the trainer refuses ----------------------------------------------------------------------
SGD_ONEBIT = ["--servers", "127.0.0.1:5557", "--compression", "onebit", "--optimizer", "sgd"]


def test_one_bit_momentum_sgd_on_more_ranks_than_measured_is_refused_naming_what_to_use(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(ONEBIT_SGD_MAX_WORLD + 2))
    with pytest.raises(SystemExit) as exc:
        parse_args(SGD_ONEBIT)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "loses accuracy on more than 2 ranks (this job has 4)" in err
    assert "use --compression onebit --optimizer adam" in err
    # What it names is accepted on the same ranks, and so is the refused one when asked for.
    assert parse_args([*SGD_ONEBIT[:-1], "adam"]).optimizer == "adam"
    assert parse_args([*SGD_ONEBIT, "--accept-accuracy-loss"]).compression == "onebit"
    assert parse_args([*SGD_ONEBIT, "--momentum", "0"]).momentum == 0  # compresses its gradients: not refused
    monkeypatch.setenv("WORLD_SIZE", str(ONEBIT_SGD_MAX_WORLD))
    assert parse_args(SGD_ONEBIT).optimizer == "sgd"


def test_a_refused_rank_exits_with_one_line_before_connecting() -> None:
    result = subprocess.run([sys.executable, "-m", "fuelline.trainer", *SGD_ONEBIT], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "WORLD_SIZE": "4"})
    assert result.returncode == 2
    lines_out = result.stderr.strip().splitlines()
    assert len(lines_out) == 1, result.stderr  # the reason alone, no usage text
    assert "error: --compression onebit --optimizer sgd loses accuracy" in lines_out[0]
    # Every rank of the job refuses it, and only rank 0 says so.
    other = subprocess.run([sys.executable, "-m", "fuelline.trainer", *SGD_ONEBIT], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "WORLD_SIZE": "4", "RANK": "1"})
    assert other.returncode == 2 and other.stderr == "", other.stderr
