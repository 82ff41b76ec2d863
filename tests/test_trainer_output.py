"""What a trainer run prints: one line per epoch for people on stdout, the full JSON record in
--metrics-json (and on stdout only with --json-stdout), and a record that names what crossed the
wire compressed."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from fuelline.server.ingest.convert import convert  # noqa: E402
from fuelline.server.ingest.synth import synthesize  # noqa: E402
from fuelline.trainer.onebit import OneBitState  # noqa: E402
from fuelline.trainer.report import epoch_summary, wire_compression  # noqa: E402

from support.trainer import lines, torchrun  # noqa: E402

SUMMARY = re.compile(r"^epoch (\d+)/(\d+)  loss (\d+\.\d{3})  val acc (\d\.\d{3})  macro-F1 (\d\.\d{3})  "
                     r"([\d,]+) samples/s  data wait (\d+\.\d) %  (grad|momentum) (\d+\.\d{3}) B/elem$")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainer-output")
    synthesize(str(root / "raw"), 16, 20.0, 2, video_dim=8, drop=0.001)
    convert(str(root / "raw"), str(root / "data"), progress=False)
    return root / "data"


def record(**changes) -> dict:
    return {"epoch": 2, "train_loss": 0.41234, "val_accuracy": 0.8731, "val_macro_f1": 0.80149,
            "samples_per_s": 1234.4, "data_wait_share": 0.0081, "grad_bytes_per_element": 0.12891,
            "compressed": "gradients"} | changes


def test_the_summary_line_holds_the_epoch_figures() -> None:
    assert epoch_summary(record(), 10) == ("epoch 3/10  loss 0.412  val acc 0.873  macro-F1 0.801  1,234 samples/s  "
                                           "data wait 0.8 %  grad 0.129 B/elem")
    assert SUMMARY.match(epoch_summary(record(), 10))
    # Past 1-bit Adam's freeze the bytes are the momentum's; figures that are unknown say so.
    line = epoch_summary(record(compressed="momentum", data_wait_share=None, grad_bytes_per_element=None), 3)
    assert line.endswith("data wait n/a  momentum n/a")


def test_the_record_names_what_is_compressed() -> None:
    adam = OneBitState(warmup_iters=2)
    assert wire_compression("onebit-adam", "none", adam) == {"compression": "onebit-momentum", "compressed": None}
    adam.local_gradients = True  # the variance froze: the optimizer exchanges the momentum in 1 bit
    assert wire_compression("onebit-adam", "none", adam) == {"compression": "onebit-momentum", "compressed": "momentum"}
    sgd = OneBitState(warmup_iters=2)
    assert wire_compression("sgd", "onebit", sgd)["compressed"] is None  # fp32 during the warm-up
    sgd.iter = 2
    assert wire_compression("sgd", "onebit", sgd) == {"compression": "onebit", "compressed": "gradients"}
    assert wire_compression("adam", "fp16", None) == {"compression": "fp16", "compressed": "gradients"}
    assert wire_compression("adam", "none", None) == {"compression": "none", "compressed": None}


@pytest.mark.timeout(200)
def test_a_run_prints_one_line_per_epoch_and_keeps_the_record_in_the_metrics_file(
        dataset: Path, start_serve, tmp_path: Path) -> None:
    server = start_serve(dataset, "--batch-size", "16")
    metrics = tmp_path / "metrics.jsonl"
    result = torchrun(server.endpoint, "--epochs", "2", "--optimizer", "onebit-adam", "--freeze-step", "3",
                      "--metrics-json", str(metrics), timeout=150)
    out = result.stdout.splitlines()
    assert len(out) == 2 and not [x for x in out if x.lstrip().startswith("{")], result.stdout
    records = lines(metrics)
    assert [r["epoch"] for r in records] == [0, 1]
    for line, r in zip(out, records):
        m = SUMMARY.match(line)
        assert m, line
        assert (int(m[1]), int(m[2])) == (r["epoch"] + 1, 2)
        assert float(m[3]) == pytest.approx(r["train_loss"], abs=6e-4)
        assert float(m[4]) == pytest.approx(r["val_accuracy"], abs=6e-4)
        assert float(m[5]) == pytest.approx(r["val_macro_f1"], abs=6e-4)
        assert int(m[6].replace(",", "")) == pytest.approx(r["samples_per_s"], abs=0.6)
        assert float(m[7]) == pytest.approx(100 * r["data_wait_share"], abs=0.06)
        assert float(m[9]) == pytest.approx(r["grad_bytes_per_element"], abs=6e-4)
        for key in ("val_recall", "data_wait_ms", "step_ms", "modality_loss", "alphas", "world_size", "step"):
            assert key in r, key
    # The momentum, not the gradient, crosses the wire in 1 bit once the variance froze.
    assert {r["compression"] for r in records} == {"onebit-momentum"}
    assert records[1]["compressed"] == "momentum" and SUMMARY.match(out[1])[8] == "momentum"
    assert records[1]["grad_bytes_per_element"] < 0.033 * 4  # what the record counts is the compressed exchange
    # Per-rank chatter stays out of the INFO log: the move to the Unix socket is a DEBUG record.
    assert "reading through ipc://" not in result.stderr


@pytest.mark.timeout(200)
def test_json_stdout_prints_the_records_and_the_summary_on_stderr(dataset: Path, start_serve, tmp_path: Path) -> None:
    server = start_serve(dataset, "--batch-size", "16")
    metrics = tmp_path / "metrics.jsonl"
    result = torchrun(server.endpoint, "--epochs", "1", "--json-stdout", "--metrics-json", str(metrics), timeout=150)
    printed = [json.loads(x) for x in result.stdout.splitlines()]  # stdout is JSON lines and nothing else
    assert printed == lines(metrics) and len(printed) == 1
    assert printed[0]["compression"] == "none" and printed[0]["compressed"] is None
    assert len([x for x in result.stderr.splitlines() if SUMMARY.match(x)]) == 1


def test_the_trainer_prints_its_version_as_the_fuelline_command_does() -> None:
    trainer = subprocess.run([sys.executable, "-m", "fuelline.trainer", "--version"], capture_output=True, text=True,
                             timeout=120)
    command = subprocess.run([sys.executable, "-m", "fuelline.server.cli", "--version"], capture_output=True, text=True,
                             timeout=60)
    assert trainer.returncode == 0 and command.returncode == 0, trainer.stderr + command.stderr
    assert trainer.stdout == command.stdout == f"fuelline {importlib.metadata.version('fuelline')}\n"
