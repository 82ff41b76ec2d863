"""The trainer: torchrun ranks against a real data server, resume, and its parts on their own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fuelline.server.ingest.convert import convert  # noqa: E402
from fuelline.server.ingest.synth import synthesize  # noqa: E402
from fuelline.trainer.dynamic_batch import MicroBatcher  # noqa: E402
from fuelline.trainer.losses import DynamicWeightAverage, LSTMWeighting, class_weights  # noqa: E402
from fuelline.trainer.report import classification_report  # noqa: E402

from support.trainer import lines, torchrun, torchrun_args  # noqa: E402,F401


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainer")
    synthesize(str(root / "raw"), 16, 20.0, 2, video_dim=8, drop=0.001)
    convert(str(root / "raw"), str(root / "data"), progress=False)
    return root / "data"


@pytest.mark.timeout(300)
def test_two_ranks_train_evaluate_and_report_each_epoch(dataset: Path, start_serve, tmp_path: Path) -> None:
    # Two data servers at once: each serves a disjoint part of every rank's share.
    servers = [start_serve(dataset, "--batch-size", "16") for _ in range(2)]
    metrics, samples = tmp_path / "metrics.jsonl", tmp_path / "samples"
    result = torchrun(",".join(s.endpoint for s in servers), "--epochs", "2", "--compression", "fp16",
                      "--metrics-json", str(metrics), "--sample-log", str(samples))
    train_windows = servers[0].wait_log(r"split 'train': (\d+) rows")
    windows = int(re.search(r"split 'train': (\d+) rows", train_windows).group(1))
    for epoch in (0, 1):
        ids = [x for rank in range(2) for r in lines(Path(f"{samples}.rank{rank}")) if r["epoch"] == epoch
               for x in r["ids"]]
        assert len(set(ids)) == windows and len(ids) - windows < 2 * 2 * 16  # every window; padding only
    records = lines(metrics)
    assert [r["epoch"] for r in records] == [0, 1]
    assert len(re.findall(r"^epoch [12]/2  loss ", result.stdout, re.M)) == 2  # a line for people each epoch
    for r in records:
        for key in ("train_loss", "val_accuracy", "val_macro_f1", "val_recall", "samples_per_s", "data_wait_s",
                    "step_time_s", "grad_bytes_per_element"):
            assert key in r, key
        assert r["world_size"] == 2 and 0 <= r["val_accuracy"] <= 1
        assert r["grad_bytes_per_element"] == pytest.approx(2.0)  # fp16 ring all-reduce at W = 2
        assert set(r["val_recall"]) == {"neutral", "happiness", "sadness", "surprise", "anger", "fear"}
        assert 0 <= r["data_wait_share"] <= 1 and r["timing_over"] == "all ranks pooled"
        for key in ("data_wait_ms", "step_ms", "batch_ms"):
            assert r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"] <= r[key]["max"], key
        assert r["gpu_util"] is None and r["gpu_mem_max_mb"] is None  # CPU
    # stderr is not a terminal: progress is plain log lines (no bar), up to the epoch's last batch;
    # they count epochs from 1, as the summary lines do
    for epoch in (1, 2):
        progress = re.findall(rf"epoch {epoch}/2: step (\d+)/(\d+), loss \S+, data wait [\d.]+%", result.stderr)
        assert progress and progress[-1][0] == progress[-1][1], result.stderr[-2000:]
        assert re.search(rf"^epoch {epoch}/2  loss ", result.stdout, re.M), result.stdout
    assert not re.search(r"epoch 0\b", result.stdout + result.stderr), "an epoch counted from 0"
    assert "\r" not in result.stderr


@pytest.mark.timeout(400)
def test_resume_continues_the_same_sample_ids(dataset: Path, start_serve, tmp_path: Path) -> None:
    server = start_serve(dataset, "--batch-size", "16", "--seed", "4")
    whole = tmp_path / "whole"
    torchrun(server.endpoint, "--epochs", "2", "--sample-log", str(whole), "--checkpoint-dir", str(tmp_path / "ck0"))
    parts = tmp_path / "parts"
    ck = tmp_path / "ck"
    metrics = tmp_path / "metrics.jsonl"
    common = ("--epochs", "2", "--sample-log", str(parts), "--checkpoint-dir", str(ck), "--metrics-json", str(metrics))
    torchrun(server.endpoint, *common, "--max-steps", "3")  # stops mid-epoch 0, after a checkpoint
    assert json.loads((ck / "latest.json").read_text())["step"] == 3
    torchrun(server.endpoint, *common, "--resume")
    for rank in range(2):
        full = [r["ids"] for r in lines(Path(f"{whole}.rank{rank}"))]
        resumed = [r["ids"] for r in lines(Path(f"{parts}.rank{rank}"))]
        assert resumed == full  # nothing lost, nothing repeated
    assert [r["epoch"] for r in lines(metrics)] == [0, 1]


def test_micro_batches_halve_on_out_of_memory_and_accumulate_the_same_gradient() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))

    def step(batch, scale):
        if len(batch["x"]) > 16:
            raise torch.OutOfMemoryError("simulated: more than 16 rows do not fit")
        (torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"]) * scale).backward()

    micro = MicroBatcher(enabled=True, size=64)
    micro.run({"x": x, "y": y}, step, lambda: model.zero_grad(set_to_none=True))
    assert micro.size == 16 and micro.halvings == 2
    accumulated = model.weight.grad.clone()
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert torch.allclose(accumulated, model.weight.grad, atol=1e-6)


def test_on_cpu_a_batch_is_one_micro_batch() -> None:
    calls = []
    MicroBatcher(enabled=False).run({"x": torch.zeros(10, 2)}, lambda b, s: calls.append((len(b["x"]), s)), lambda: None)
    assert calls == [(10, 1.0)]


def test_class_weights_follow_n_max_over_n_c() -> None:
    w = class_weights([415, 213, 135, 106, 88, 43], eps=1.0)
    assert w[0] == pytest.approx(415 / 416) and w[5] == pytest.approx(415 / 44)
    assert torch.all(w[1:] >= w[:-1])  # rarer classes weigh more


def test_dynamic_weight_average_favours_the_modality_that_learns_slowest() -> None:
    dwa = DynamicWeightAverage(["eeg", "video"])
    dwa.update({"eeg": 1.0, "video": 1.0})
    assert dwa.alphas() == {"eeg": 1.0, "video": 1.0}
    dwa.update({"eeg": 0.5, "video": 0.95})  # eeg halved its loss, video barely moved
    a = dwa.alphas()
    assert a["video"] > 1.0 > a["eeg"] and sum(a.values()) == pytest.approx(2.0)


def test_lstm_weighting_gives_weights_that_sum_to_the_number_of_modalities() -> None:
    lstm = LSTMWeighting(["eeg", "ecg", "video"])
    for t in range(6):
        lstm.update({"eeg": 1.0 / (t + 1), "ecg": 1.0, "video": 1.0 - 0.05 * t})
    a = lstm.alphas()
    assert all(v > 0 for v in a.values()) and sum(a.values()) == pytest.approx(3.0)
    assert a["ecg"] > a["eeg"]  # the stalled modality gets more weight than the improving one


def test_classification_report_counts_right() -> None:
    names = ["a", "b", "c"]
    r = classification_report(np.array([0, 0, 1, 1, 1]), np.array([0, 1, 1, 1, 0]), names)
    assert r["accuracy"] == pytest.approx(3 / 5)
    assert r["recall"] == {"a": 0.5, "b": pytest.approx(2 / 3), "c": None}
    assert r["macro_f1"] == pytest.approx(np.mean([0.5, 2 * (2 / 3) * (2 / 3) / (4 / 3)]))


@pytest.mark.timeout(400)
def test_a_killed_torchrun_job_resumes_the_same_sample_ids(dataset: Path, start_serve, tmp_path: Path) -> None:
    import os
    import signal
    import time

    server = start_serve(dataset, "--batch-size", "8", "--seed", "9")
    whole = tmp_path / "whole"
    torchrun(server.endpoint, "--epochs", "2", "--sample-log", str(whole))
    parts, ck = tmp_path / "parts", tmp_path / "ck"
    common = ("--epochs", "2", "--sample-log", str(parts), "--checkpoint-dir", str(ck), "--checkpoint-every", "2")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "fuelline.trainer", "--servers", server.endpoint, "--width", "8", *common]
    job = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    log0 = Path(f"{parts}.rank0")
    deadline = time.monotonic() + 120
    try:
        # Wait until the job is well into its first epoch and has checkpointed, then kill it all.
        while not (log0.exists() and len(lines(log0)) >= 7 and (ck / "latest.json").exists()):
            assert job.poll() is None, "the job ended before it could be killed"
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.05)  # polling files a separate process writes; bounded by the deadline
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
    saved = json.loads((ck / "latest.json").read_text())["step"]
    # It died mid-epoch at or after its last checkpoint (steps past it, if any, are done again).
    assert saved >= 2 and len(lines(log0)) >= saved
    torchrun(server.endpoint, *common, "--resume")
    for rank in range(2):
        full = [r["ids"] for r in lines(Path(f"{whole}.rank{rank}"))]
        resumed = [r["ids"] for r in lines(Path(f"{parts}.rank{rank}"))]
        assert resumed == full  # the steps after the checkpoint were done again, and only once


@pytest.mark.timeout(400)
def test_a_checkpoint_of_two_ranks_resumes_on_one_without_losing_a_window(dataset: Path, start_serve, tmp_path: Path) -> None:
    server = start_serve(dataset, "--batch-size", "8", "--seed", "5")
    log, ck = tmp_path / "ids", tmp_path / "ck"
    common = ("--epochs", "1", "--sample-log", str(log), "--checkpoint-dir", str(ck))
    torchrun(server.endpoint, *common, "--max-steps", "4")
    torchrun(server.endpoint, *common, "--resume", nproc=1)
    before = [i for rank in range(2) for r in lines(Path(f"{log}.rank{rank}")) if r["step"] <= 4 for i in r["ids"]]
    after = [i for r in lines(Path(f"{log}.rank0")) if r["step"] > 4 for i in r["ids"]]
    from fuelline.server.multimodal.source import WindowSource

    total = WindowSource(str(dataset)).rows("train")
    assert len(set(before)) == len(before) == 2 * 4 * 8  # two ranks, four steps, eight windows
    assert not set(before) & set(after)  # nothing repeated
    assert len(set(before) | set(after)) == total  # nothing lost


@pytest.mark.timeout(400)
# (1-bit momentum SGD, 1-bit Adam under its new name and 1-bit plain SGD are run the same way by
# test_onebit_momentum.py; here, the old name.)
@pytest.mark.parametrize("options", [
    ("--optimizer", "onebit-adam", "--freeze-step", "3"),
])
def test_one_bit_training_sends_a_thirty_second_of_fp32(dataset: Path, start_serve, tmp_path: Path, options) -> None:
    server = start_serve(dataset, "--batch-size", "16")
    metrics = tmp_path / "metrics.jsonl"
    torchrun(server.endpoint, "--epochs", "2", "--metrics-json", str(metrics), *options)
    records = lines(metrics)
    assert [r["epoch"] for r in records] == [0, 1]
    warm = records[1]["grad_bytes_per_element"]
    fp32_ring = 2 * (2 - 1) / 2 * 4
    # After the warm-up, 1/32 of fp32 plus the block scales: at most 3.3 % of an fp32 ring all-reduce.
    assert warm is not None and warm / fp32_ring <= 0.033, warm
    assert all(np.isfinite(r["train_loss"]) for r in records)
