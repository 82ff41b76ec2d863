"""A resumed 1-bit run carries on where it stopped: no second warm-up, the same parameters.

The run stopped is an uninterrupted run's own checkpoint at step STOP, as a job preempted just
after it leaves its directory; its launch also gives the uninterrupted parameters to compare with."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fuelline.server.ingest.convert import convert  # noqa: E402
from fuelline.server.ingest.synth import synthesize  # noqa: E402

from support.trainer import torchrun_args  # noqa: E402

STEPS, STOP = 8, 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainer-resume")
    synthesize(str(root / "raw"), 16, 20.0, 2, video_dim=8, drop=0.001)
    convert(str(root / "raw"), str(root / "data"), progress=False)
    return root / "data"


def launch(endpoint: str, *options: str) -> str:
    result = subprocess.run(torchrun_args(endpoint, "--epochs", "1", *options), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def saved(ck: Path, rank: int) -> dict:
    return torch.load(ck / f"step{STEPS:09d}-rank{rank}.pt", weights_only=True)


def tensors(value, path: str = ""):
    """Every tensor in a nested state, with where it is."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from tensors(v, f"{path}/{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from tensors(v, f"{path}/{i}")


@pytest.mark.timeout(300)
# (``--optimizer onebit-adam`` is the old name of ``--compression onebit --optimizer adam``: the same
# optimizer and hook, run end to end by test_trainer_output.py.)
@pytest.mark.parametrize("options", [
    ("--compression", "onebit", "--optimizer", "sgd", "--lr", "0.01", "--warmup-iters", "2"),
    ("--compression", "onebit", "--optimizer", "adam", "--freeze-step", "3"),
    ("--compression", "onebit", "--optimizer", "sgd", "--momentum", "0", "--lr", "0.01", "--warmup-iters", "2"),
], ids=["onebit-sgd", "onebit-compressed-adam", "onebit-plain-sgd"])
def test_a_resumed_one_bit_run_matches_an_uninterrupted_one_bit_for_bit(dataset: Path, start_serve, tmp_path: Path,
                                                                        options: tuple[str, ...]) -> None:
    server = start_serve(dataset, "--batch-size", "8", "--seed", "3")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    uninterrupted = launch(server.endpoint, *options, "--checkpoint-dir", str(whole), "--max-steps", str(STEPS),
                           "--checkpoint-every", str(STOP))
    assert "1-bit compression starts" in uninterrupted  # (the options start it before step STOP)
    # The job as a preemption after its step-STOP checkpoint leaves it: that checkpoint is the latest.
    parts.mkdir()
    for rank in range(2):
        name = f"step{STOP:09d}-rank{rank}.pt"
        (parts / name).write_bytes((whole / name).read_bytes())
    (parts / "latest.json").write_text(json.dumps({"step": STOP, "world_size": 2}))
    resumed = launch(server.endpoint, *options, "--checkpoint-dir", str(parts), "--max-steps", str(STEPS - STOP),
                     "--resume")
    assert f"resumed at step {STOP}" in resumed
    # The hook did not warm up again: it never announced the start of compression, and it sent
    # exactly the bytes of the uninterrupted run (a warm-up step sends 32 times as many).
    assert "1-bit compression starts" not in resumed
    for rank in range(2):
        a, b = saved(whole, rank), saved(parts, rank)
        for key in ("bytes_sent", "elements", "iter"):
            assert b["comm"][key] == a["comm"][key], (rank, key)
        # CPU, gloo, two ranks, fixed seeds: the run is deterministic, so equal means bit-equal.
        for part in ("model", "optimizer"):
            ours, theirs = dict(tensors(b[part])), dict(tensors(a[part]))
            assert ours.keys() == theirs.keys()
            different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
            assert not different, (rank, part, different)
