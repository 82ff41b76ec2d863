"""The trainer with a model of one's own (``--model package.module:function``), and the built-in
model refusing data it cannot train with one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from fuelline.protocol import DataError  # noqa: E402
from fuelline.trainer.model_spec import ModelSpec, class_facts, heads_of, load_factory  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CLASSES, DIM = 4, 8


@pytest.fixture(scope="module")
def separable_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample dataset's layout (``sample_id``, ``features`` [8] float32, ``label``), but with
    labels a model can learn: each class is a cluster of features. (The sample dataset's labels
    are random, so no model beats chance on it.)"""
    out = tmp_path_factory.mktemp("own-model") / "data"
    rng = np.random.default_rng(0)
    centers = rng.normal(0.0, 2.0, (CLASSES, DIM))
    first = 0
    for split, rows in (("train", 2048), ("val", 512)):
        (out / split).mkdir(parents=True)
        label = rng.integers(0, CLASSES, rows)
        feats = (centers[label] + rng.normal(0.0, 1.0, (rows, DIM))).astype(np.float32)
        table = pa.table({
            "sample_id": pa.array(np.arange(first, first + rows, dtype=np.int64)),
            "features": pa.FixedSizeListArray.from_arrays(pa.array(feats.reshape(-1)), DIM),
            "label": pa.array(label.astype(np.int64)),
        })
        pq.write_table(table, out / split / "part-00000.parquet", row_group_size=256)
        first += rows
    return out


def torchrun(endpoint: str, *options: str, nproc: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         "-m", "fuelline.trainer", "--servers", endpoint, "--timeout", "20", *options],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


@pytest.mark.timeout(180)
def test_own_model_trains_above_chance_on_two_ranks(separable_dataset: Path, start_serve, tmp_path: Path) -> None:
    server = start_serve(separable_dataset, "--batch-size", "64")
    metrics = tmp_path / "metrics.jsonl"
    result = torchrun(server.endpoint, "--model", "examples.own_model:build", "--epochs", "2", "--lr", "0.01",
                      "--width", "16", "--metrics-json", str(metrics))
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    last = records[-1]
    assert last["world_size"] == 2 and last["val_windows"] == 512
    assert last["val_accuracy"] > 0.7, last  # chance is 0.25
    assert 0.0 < last["val_macro_f1"] <= 1.0
    assert set(last["val_recall"]) == {str(c) for c in range(CLASSES)}  # classes counted from the labels
    assert set(last["modality_loss"]) == {"output"} and last["alphas"] == {"output": 1.0}  # one head: no weighting
    assert "4 counted from the train labels" in result.stderr
    assert "no class counts: class weights off" in result.stderr


@pytest.mark.timeout(180)
def test_own_model_resumes_from_its_checkpoint(separable_dataset: Path, start_serve, tmp_path: Path) -> None:
    server = start_serve(separable_dataset, "--batch-size", "64", "--seed", "3")
    common = ("--model", "examples.own_model:build", "--epochs", "2", "--classes", str(CLASSES), "--lr", "0.01",
              "--checkpoint-dir", str(tmp_path / "ck"), "--sample-log", str(tmp_path / "ids"),
              "--metrics-json", str(tmp_path / "metrics.jsonl"))
    stopped = torchrun(server.endpoint, *common, "--max-steps", "10", nproc=1)  # mid epoch 0 (32 steps)
    assert stopped.returncode == 0, stopped.stderr[-4000:]
    assert "counted from the train labels" not in stopped.stderr  # --classes: no pass over the labels
    resumed = torchrun(server.endpoint, *common, "--resume", nproc=1)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed at step 10" in resumed.stderr
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1] and records[-1]["step"] == 64
    logged = [json.loads(line) for line in (tmp_path / "ids.rank0").read_text().splitlines()]
    for epoch in (0, 1):
        ids = [x for r in logged if r["epoch"] == epoch for x in r["ids"]]
        assert sorted(ids) == list(range(2048))  # every train example once: nothing lost, nothing repeated


@pytest.mark.timeout(180)
def test_data_of_features_and_a_label_only_trains_and_evaluates_every_val_example_once(
        separable_dataset: Path, start_serve, tmp_path: Path) -> None:
    # The same data without sample_id: the trainer needs only what the model reads and a label.
    # 512 val rows on 3 ranks: 171 a rank, so the last one's span ends with a repeat (padding).
    bare = tmp_path / "bare"
    for split in ("train", "val"):
        (bare / split).mkdir(parents=True)
        table = pq.read_table(separable_dataset / split / "part-00000.parquet").drop(["sample_id"])
        pq.write_table(table, bare / split / "part-00000.parquet", row_group_size=256)
    server = start_serve(bare, "--batch-size", "64")
    metrics = tmp_path / "metrics.jsonl"
    result = torchrun(server.endpoint, "--model", "examples.own_model:build", "--epochs", "1", "--lr", "0.01",
                      "--width", "16", "--metrics-json", str(metrics), nproc=3)
    assert result.returncode == 0, result.stderr[-4000:]
    (record,) = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert record["val_windows"] == 512, record  # each val example once: the padding's repeat dropped
    assert record["val_accuracy"] > 0.5, record  # chance is 0.25


@pytest.mark.timeout(120)
def test_builtin_model_on_the_sample_dataset_fails_with_one_clear_line(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "64")
    result = torchrun(server.endpoint, "--epochs", "1")
    assert result.returncode != 0
    lines = [x for x in result.stderr.splitlines() if "the built-in emotion model cannot train this data" in x]
    assert len(lines) == 2, result.stderr[-4000:]  # one per rank
    for line in lines:
        assert "the server names no emotions" in line and "['eeg', 'ecg', 'gsr', 'video'] are missing" in line
        assert "--model package.module:function" in line
    # The ranks' own output (before torchrun's launcher reports the failure, with a traceback of its own).
    ranks = result.stderr.split("failed (exitcode")[0]
    assert "KeyError" not in result.stderr and "Traceback" not in ranks, result.stderr[-4000:]
    assert [x for x in ranks.splitlines() if "fuelline.trainer ERROR" in x] == lines  # nothing else logged as an error


def spec(classes: int = 3) -> ModelSpec:
    return ModelSpec(sources=("x", "label"), schema={"x": {"dtype": "float32", "shape": [5]},
                                                     "label": {"dtype": "int64", "shape": []}},
                     classes=classes, class_names=None, label_source="label", width=8, seed=0, info={})


def test_a_model_with_logits_of_the_wrong_width_is_refused_naming_the_head() -> None:
    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 2)

        def forward(self, batch):
            return {"fused": self.a(batch["x"]), "aux": self.b(batch["x"])}

    with pytest.raises(DataError, match=r"head 'aux' gives logits of shape \[2, 2\].*expected \[2, 3\]"):
        heads_of(TwoHeads(), spec(), torch.device("cpu"), "test:two_heads")


def test_heads_are_named_and_several_need_a_fused_one() -> None:
    class Net(torch.nn.Module):
        def __init__(self, names) -> None:
            super().__init__()
            self.names, self.lin = names, torch.nn.Linear(5, 3)

        def forward(self, batch):
            assert "label" not in batch  # the model never sees the labels
            z = self.lin(batch["x"])
            return z if self.names is None else {n: z for n in self.names}

    cpu = torch.device("cpu")
    assert heads_of(Net(None), spec(), cpu, "n") == ["output"]
    assert heads_of(Net(["x", "fused"]), spec(), cpu, "n") == ["x", "fused"]
    with pytest.raises(DataError, match="one must be 'fused'"):
        heads_of(Net(["p", "q"]), spec(), cpu, "n")


def test_model_option_errors_name_the_module() -> None:
    with pytest.raises(DataError, match="cannot import 'no_such_pkg.mod'"):
        load_factory("no_such_pkg.mod:build")
    with pytest.raises(DataError, match="has no callable 'nope'"):
        load_factory("fuelline.trainer.model_spec:nope")


def test_classes_come_from_the_server_then_the_option_then_the_labels() -> None:
    info = {"emotions": ["a", "b", "c"], "class_counts": {"a": 5, "b": 1, "c": 2}}
    assert class_facts(info, None, lambda: 99) == (("a", "b", "c"), 3, [5, 1, 2])
    with pytest.raises(DataError, match="--classes 4: the server names 3 classes"):
        class_facts(info, 4, lambda: 99)
    assert class_facts({}, 7, lambda: 99) == (None, 7, None)
    assert class_facts({}, None, lambda: 5) == (None, 5, None)


def test_a_server_without_a_val_split_is_refused_before_training_with_one_line(separable_dataset: Path, start_serve) -> None:
    # A folder of Parquet files is one split, train: nothing to evaluate on. (A converted dataset
    # of a few recordings can leave val empty as well.)
    server = start_serve(separable_dataset / "train", "--batch-size", "64")
    result = torchrun(server.endpoint, "--epochs", "1", "--model", "examples.own_model:build")
    assert result.returncode != 0
    ranks = result.stderr.split("failed (exitcode")[0]
    errors = [x for x in ranks.splitlines() if "fuelline.trainer ERROR" in x]
    assert len(errors) == 2 and all("no 'val' split" in x and "['train']" in x for x in errors), result.stderr[-4000:]
    assert "Traceback" not in ranks and "step 1/" not in ranks, result.stderr[-4000:]  # refused before training
