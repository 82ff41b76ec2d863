"""The trainer's per-epoch timing figures, GPU figures, progress reports and JSON logs."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from fuelline.server.ingest.convert import convert  # noqa: E402
from fuelline.server.ingest.synth import synthesize  # noqa: E402
from fuelline.trainer.cli import parse_args  # noqa: E402
from fuelline.trainer.progress import EpochProgress, use_bar  # noqa: E402
from fuelline.trainer.timing import (  # noqa: E402
    GpuSampler,
    Reservoir,
    StepTimes,
    gpu_report,
    pool,
    report,
    summarize,
    wait_share,
)

from support.trainer import lines, torchrun  # noqa: E402

SUMMARY = {"p50", "p90", "p99", "max", "mean"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainer-metrics")
    synthesize(str(root / "raw"), 16, 20.0, 2, video_dim=8, drop=0.001)
    convert(str(root / "raw"), str(root / "data"), progress=False)
    return root / "data"


# -- timing.py ---------------------------------------------------------------------------------------
def test_summarize_gives_percentiles_of_known_data() -> None:
    s = summarize(range(1, 101))  # 1..100: linear interpolation between order statistics
    assert s == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01, "max": 100.0, "mean": 50.5})
    assert summarize([0.002, 0.004], scale=1000.0) == pytest.approx(
        {"p50": 3.0, "p90": 3.8, "p99": 3.98, "max": 4.0, "mean": 3.0})
    assert summarize([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0, "max": 7.0, "mean": 7.0}
    assert summarize([]) == dict.fromkeys(SUMMARY)


def test_wait_share_is_wait_over_wait_plus_step() -> None:
    assert wait_share(1.0, 3.0) == pytest.approx(0.25)
    assert wait_share(0.0, 2.0) == 0.0 and wait_share(2.0, 0.0) == 1.0
    assert wait_share(0.0, 0.0) is None


def test_step_times_pool_every_rank_and_time_whole_iterations() -> None:
    ranks = []
    for r in range(2):
        t = StepTimes()
        arrival = 10.0
        for i in range(5):
            wait, step = 0.001 * (i + 1) * (r + 1), 0.010
            arrival += wait
            t.record(wait, step, arrival=arrival)
            arrival += step + 0.002  # after the step: logging, checkpoints
        ranks.append(t)
    assert ranks[0].steps == 5
    batch0 = ranks[0].series["batch"].samples
    assert batch0 == pytest.approx([0.010 + 0.002 + 0.001 * i for i in range(2, 6)])  # one fewer than steps
    out = report([t.state() for t in ranks])
    waits = [0.001 * (i + 1) * (r + 1) for r in range(2) for i in range(5)]
    assert out["data_wait_ms"] == pytest.approx(summarize(waits, 1000.0))
    assert out["step_ms"] == pytest.approx(dict.fromkeys(SUMMARY, 10.0))
    assert out["data_wait_share"] == pytest.approx(sum(waits) / (sum(waits) + 10 * 0.010))
    assert out["data_wait_share_per_rank"] == pytest.approx([ranks[0].share(), ranks[1].share()])
    assert out["batch_ms"]["p50"] <= out["batch_ms"]["p90"] <= out["batch_ms"]["p99"] <= out["batch_ms"]["max"]
    assert out["timing_over"] == "all ranks pooled"
    # The shares can be of other totals (a resumed epoch's, kept in the checkpoint).
    assert report([t.state() for t in ranks], totals=[(1.0, 1.0), (1.0, 3.0)])["data_wait_share"] == pytest.approx(1 / 3)
    assert report([StepTimes().state()])["data_wait_ms"] == dict.fromkeys(SUMMARY)


def test_a_full_reservoir_keeps_exact_totals_and_close_percentiles() -> None:
    r = Reservoir(capacity=500, seed=1)
    for v in range(20_000):
        r.add(float(v))
    assert len(r.samples) == 500 and r.count == 20_000 and r.max == 19_999.0
    assert r.total == pytest.approx(sum(range(20_000)))
    small = Reservoir(capacity=500)
    for v in range(100):
        small.add(float(v))
    pooled = pool([r.state(), small.state()])
    assert pooled["max"] == 19_999.0
    assert pooled["mean"] == pytest.approx((sum(range(20_000)) + sum(range(100))) / 20_100)
    exact = np.percentile(np.r_[np.arange(20_000), np.arange(100)], [50, 90, 99])
    got = [pooled["p50"], pooled["p90"], pooled["p99"]]
    assert got == pytest.approx(exact, rel=0.1)  # a sample of 500 weighted against 100 exact values
    assert pooled["p50"] <= pooled["p90"] <= pooled["p99"] <= pooled["max"]


def test_gpu_figures_are_none_without_cuda_and_never_raise() -> None:
    torch = pytest.importorskip("torch")
    cpu = GpuSampler.for_device(torch.device("cpu"), every=1)
    for step in range(1, 5):
        cpu.maybe_sample(step)
    assert cpu.read is None and cpu.samples == []
    assert gpu_report([None, []]) is None

    def broken() -> float:
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    failing = GpuSampler(broken, every=1)
    failing.maybe_sample(1)
    failing.maybe_sample(2)
    assert failing.read is None and failing.samples == []

    readings = iter([40.0, 60.0, 100.0])
    sampler = GpuSampler(lambda: next(readings), every=3)
    for step in range(1, 10):
        sampler.maybe_sample(step)  # steps 3, 6 and 9
    assert sampler.samples == [40.0, 60.0, 100.0]
    assert gpu_report([sampler.samples, [0.0]]) == {"mean": 50.0, "max": 100.0}


# -- progress.py -------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def progress_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("epoch ")]


def test_progress_logs_every_tenth_of_the_epoch(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fuelline.trainer")
    clock = Clock()
    p = EpochProgress(3, 50, clock=clock)
    for step in range(1, 51):
        clock.now += 0.1
        p.update(step, 1.0 / step, 0.25)
    p.close()
    records = progress_records(caplog)
    assert [r.step for r in records] == list(range(5, 51, 5))
    # The text counts epochs from 1 (the stream's epoch 3 is the 4th), as the epoch summary line does.
    assert records[-1].getMessage() == "epoch 4: step 50/50, loss 0.0200, data wait 25.0%"
    assert records[-1].steps == 50 and records[-1].data_wait_share == 0.25
    assert records[-1].epoch == 3  # (a JSON log's field: the stream's number, as in --metrics-json)
    caplog.clear()
    of = EpochProgress(0, 10, epochs=10, clock=clock)
    of.update(10, 0.5, 0.1)
    assert progress_records(caplog)[-1].getMessage() == "epoch 1/10: step 10/10, loss 0.5000, data wait 10.0%"


def test_progress_records_come_at_even_steps_whatever_the_epoch_length_or_step_time(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fuelline.trainer")
    clock = Clock()
    p = EpochProgress(0, 25, clock=clock)
    for step in range(1, 26):
        clock.now += 10.0  # slow steps: a time rule mixed in would add records between the marks
        p.update(step, 0.5, 0.1)
    steps = [r.step for r in progress_records(caplog)]
    assert steps == [3, 6, 9, 12, 15, 18, 21, 24, 25]  # every ceil(25 / 10) steps, and the last
    caplog.clear()
    resumed = EpochProgress(0, 25, initial=10, clock=clock)  # the same marks after a resume
    for step in range(11, 26):
        resumed.update(step, 0.5, 0.1)
    assert [r.step for r in progress_records(caplog)] == [12, 15, 18, 21, 24, 25]


def test_progress_without_a_length_logs_on_a_fixed_time_grid(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fuelline.trainer")
    clock = Clock()
    p = EpochProgress(0, None, interval_s=10.0, clock=clock)
    for step, dt in enumerate([4.0, 4.0, 4.0, 4.0, 4.0, 25.0, 1.0, 4.0], start=1):
        clock.now += dt  # at 4, 8, 12, 16, 20, 45, 46, 50 s
        p.update(step, 0.5, None)
    # Marks at 10, 20, 30, 40, 50 s: the slow step passes three at once and logs once.
    assert [r.step for r in progress_records(caplog)] == [3, 5, 6, 8]


def test_progress_logs_every_interval_when_the_epoch_is_of_unknown_length(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fuelline.trainer")
    clock = Clock()
    p = EpochProgress(0, None, clock=clock)
    for step in range(1, 101):
        clock.now += 1.0
        p.update(step, 0.5, None)
    assert [r.step for r in progress_records(caplog)] == [30, 60, 90]
    assert progress_records(caplog)[0].getMessage() == "epoch 1: step 30, loss 0.5000, data wait n/a"


def test_progress_is_a_bar_or_log_lines_never_both(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert use_bar("text", Tty()) and not use_bar("json", Tty()) and not use_bar("text", io.StringIO())
    caplog.set_level(logging.INFO, logger="fuelline.trainer")
    bar_out = Tty()
    monkeypatch.setattr("sys.stderr", bar_out)
    p = EpochProgress(0, 10, bar=True)
    for step in range(1, 11):
        p.update(step, 0.5, 0.1)
    p.close()
    assert progress_records(caplog) == []
    assert "10/10" in bar_out.getvalue() and "data_wait=10.0%" in bar_out.getvalue()
    # Not rank 0: nothing at all.
    quiet = EpochProgress(0, 10, enabled=False, bar=True)
    quiet.update(10, 0.5, 0.1)
    quiet.close()
    assert progress_records(caplog) == []


def test_cli_log_options() -> None:
    args = parse_args(["--servers", "h:1"])
    assert (args.log_format, args.log_level) == ("text", "INFO")
    assert parse_args(["--servers", "h:1", "--log-format", "json"]).log_format == "json"
    with pytest.raises(SystemExit):
        parse_args(["--servers", "h:1", "--log-format", "xml"])


def test_cli_connections_must_be_at_least_one() -> None:
    assert parse_args(["--servers", "h:1"]).connections == 1
    assert parse_args(["--servers", "h:1", "--connections", "2"]).connections == 2
    with pytest.raises(SystemExit):
        parse_args(["--servers", "h:1", "--connections", "0"])


# -- a real run --------------------------------------------------------------------------------------
TEXT_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ fuelline")


@pytest.mark.timeout(300)
def test_json_logs_and_timing_figures_of_a_two_rank_run(dataset: Path, start_serve, tmp_path: Path) -> None:
    server = start_serve(dataset, "--batch-size", "16")
    metrics = tmp_path / "metrics.jsonl"
    result = torchrun(server.endpoint, "--epochs", "1", "--metrics-json", str(metrics), "--log-format", "json")
    (record,) = lines(metrics)
    assert 0 <= record["data_wait_share"] <= 1
    assert len(record["data_wait_share_per_rank"]) == 2
    assert all(0 <= s <= 1 for s in record["data_wait_share_per_rank"])
    for key in ("data_wait_ms", "step_ms", "batch_ms"):
        s = record[key]
        assert set(s) == SUMMARY, key
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (key, s)
        assert 0 <= s["mean"] <= s["max"], (key, s)
    assert record["step_ms"]["p50"] > 0 and record["batch_ms"]["max"] > 0
    assert record["timing_over"] == "all ranks pooled"
    assert record["gpu_util"] is None and record["gpu_mem_max_mb"] is None  # CPU
    for key in ("train_loss", "samples_per_s", "data_wait_s", "step_time_s", "val_accuracy"):
        assert key in record, key

    stderr = result.stderr.splitlines()
    assert not [x for x in stderr if TEXT_LOG_LINE.match(x)]  # no text-format log line from the ranks
    logs = [json.loads(x) for x in stderr if x.startswith("{")]
    assert all({"level", "message", "logger", "time"} <= set(r) for r in logs)
    progress = [r for r in logs if r["message"].startswith("epoch 1/1: step ")]  # (from 1, as the summary line)
    assert progress, "no progress records in the JSON logs"
    assert all(r["logger"] == "fuelline.trainer" and r["level"] == "INFO" for r in progress)
    assert [r["step"] for r in progress] == sorted(r["step"] for r in progress)
    last = progress[-1]
    assert last["steps"] and last["step"] == last["steps"]  # the whole epoch, once per rank-0 run
    assert 0 <= last["data_wait_share"] <= 1 and np.isfinite(last["loss"])
    assert len(progress) <= last["steps"]  # every tenth of the epoch at most (or every 30 s)
