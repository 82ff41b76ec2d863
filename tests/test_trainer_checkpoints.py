"""Checkpoints hold plain data only, and a resume refuses a file that would run code as it loads."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fuelline.server.ingest.convert import convert  # noqa: E402
from fuelline.server.ingest.synth import synthesize  # noqa: E402
from fuelline.trainer.checkpoint import plain  # noqa: E402

from support.trainer import lines, torchrun_args  # noqa: E402


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainer-checkpoints")
    synthesize(str(root / "raw"), 16, 20.0, 2, video_dim=8, drop=0.001)
    convert(str(root / "raw"), str(root / "data"), progress=False)
    return root / "data"


class Planted:
    """Unpickling this calls ``open(marker, "w")``: code from the file, run by whoever loads it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.timeout(300)
def test_a_checkpoint_that_would_run_code_is_refused_and_a_clean_one_resumes(dataset: Path, start_serve,
                                                                              tmp_path: Path) -> None:
    server = start_serve(dataset, "--batch-size", "8")
    ck, log = tmp_path / "ck", tmp_path / "ids"
    common = ("--epochs", "1", "--checkpoint-dir", str(ck), "--sample-log", str(log))
    first = subprocess.run(torchrun_args(server.endpoint, *common, "--max-steps", "2"), capture_output=True,
                           text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = sorted(ck.glob("step*-rank*.pt"))
    assert [p.name for p in saved] == ["step000000002-rank0.pt", "step000000002-rank1.pt"]
    clean = tmp_path / "clean"
    clean.mkdir()
    for path in saved:
        shutil.copy(path, clean / path.name)

    marker = tmp_path / "code-ran"
    for path in saved:  # a real checkpoint, with one planted object among its values
        state = torch.load(path, weights_only=True)
        state["epoch_sums"]["planted"] = Planted(marker)
        torch.save(state, path)
    refused = subprocess.run(torchrun_args(server.endpoint, *common, "--resume"), capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0
    assert not marker.exists(), "loading the checkpoint ran code from it"
    for path in saved:
        assert f"{path}: refused to load" in refused.stderr, refused.stderr[-3000:]
    assert "terminate called" not in refused.stderr

    for path in saved:
        shutil.copy(clean / path.name, path)
    resumed = subprocess.run(torchrun_args(server.endpoint, *common, "--resume", "--max-steps", "2"),
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "rank 0 resumed at step 2" in resumed.stderr
    assert [r["step"] for r in lines(Path(f"{log}.rank0"))] == [1, 2, 3, 4]
    assert json.loads((ck / "latest.json").read_text())["step"] == 4


def test_plain_turns_numpy_into_tensors_and_numbers_and_names_what_it_cannot_hold() -> None:
    state = {"a": np.arange(3, dtype=np.int64), "b": [np.float32(0.5), (1, "x")], "t": torch.ones(2)}
    out = plain(state)
    assert isinstance(out["a"], torch.Tensor) and out["a"].tolist() == [0, 1, 2]
    assert out["b"] == [0.5, (1, "x")] and type(out["b"][0]) is float
    assert out["t"] is state["t"]
    kept = {"w": torch.zeros(1)}
    assert plain(kept) is kept  # nothing to convert: the same object, metadata and all
    with pytest.raises(TypeError, match=r"state\['comm'\]\['x'\] is a Planted"):
        plain({"comm": {"x": Planted(Path("unused"))}})
