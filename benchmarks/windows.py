"""The multimodal path: convert speed, and aligned windows per second through ``fuelline serve``
beside the same pipeline run in-process.

Data: ``fuelline synth`` recordings (AMIGOS-like: EEG 128 Hz × 14, ECG 256 Hz × 2, GSR 4 Hz,
face video 30 fps × 136, clocks off by hundreds of seconds, drifting, jittering, dropping samples),
converted once per round to time ``convert``. Contenders, alternately:

- in-process: ``WindowSource.iter_batches`` in this process: read, align, window, normalise and
  batch, exactly as the server does, but in the trainer's own process;
- fuelline serve: the same options in a server process, read through ``ServerDataStream``.

The reference figure is the 980 samples (windows) per second of the Arrow pipeline this work
started from.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, Contender, Round, ServerProcess, alternate, progress, time_batches
from benchmarks.report import Metric, RatioSpec, build_report, environment, write_results
from fuelline.client import ServerDataStream
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.server.multimodal.source import WindowSource

__all__ = ["run"]

RECORDINGS, SECONDS, SEED = 40, 60.0, 0
DATASET_FORMAT = 2  # bump when synth or convert change what they write
BATCH_SIZE = 64
HWM = 10
TIMEOUT_S = 60.0
REFERENCE_WINDOWS_PER_S = 980.0

QUICK_RECORDINGS, QUICK_SECONDS = 10, 40.0  # --quick: a check that it runs, not a measurement

IN_PROCESS, SERVED = "in-process pipeline", "fuelline serve"


def ensure_raw(data_dir: Path, recordings: int = RECORDINGS, seconds: float = SECONDS) -> Path:
    raw = data_dir / f"raw-v{DATASET_FORMAT}-{recordings}rec-{int(seconds)}s-seed{SEED}"
    if not raw.is_dir():  # it appears by an atomic rename, so one that exists is complete
        data_dir.mkdir(parents=True, exist_ok=True)
        progress(f"synthesising {raw} ...")
        synthesize(str(raw), recordings, seconds, SEED)
    return raw


def time_convert(raw: Path, rounds: int, work: Path) -> dict[str, Any]:
    """Convert ``rounds`` times; MB/s of TSV read and the compression ratio."""
    rates, seconds = [], []
    manifest = None
    for i in range(rounds):
        out = work / f"converted-{i}"
        started = time.perf_counter()
        manifest = convert(str(raw), str(out), progress=False)
        dt = time.perf_counter() - started
        seconds.append(dt)
        rates.append(manifest.source_bytes / dt / 1e6)
        progress(f"convert {i + 1}/{rounds}: {rates[-1]:.0f} MB/s of TSV")
    assert manifest is not None
    return {
        "tsv_mb": manifest.source_bytes / 1e6,
        "dataset_mb": manifest.dataset_bytes / 1e6,
        "compression_ratio": manifest.source_bytes / manifest.dataset_bytes,
        "mb_per_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "values": rates},
        "seconds": seconds,
        "dataset": str(work / "converted-0"),
    }


def in_process_round(dataset: str, epoch: list[int]) -> Round:
    src = WindowSource(dataset, batch_size=BATCH_SIZE, decoded_cache_mb=0)
    epoch[0] += 1
    batches = (tuple(b.values()) for b in src.iter_batches("train", epoch[0], 0, 1, 0, src.sources))
    r = time_batches(batches)
    src.close()
    return r


def served_round(server: ServerProcess) -> Round:
    with ServerDataStream(None, host=server.host, port=server.port, hwm=HWM, timeout=TIMEOUT_S,
                          receive_timeout=TIMEOUT_S) as stream:
        return time_batches(stream.get_epoch_iterator(), producer_pid=server.pid)


def run(rounds: int, data_dir: Path, results_dir: Path = RESULTS_DIR, quick: bool = False) -> dict[str, Any]:
    env = environment()
    recordings, seconds = (QUICK_RECORDINGS, QUICK_SECONDS) if quick else (RECORDINGS, SECONDS)
    raw = ensure_raw(data_dir, recordings, seconds)
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-", dir=data_dir) as work, ExitStack() as stack:
        conv = time_convert(raw, rounds, Path(work))
        dataset = conv["dataset"]
        windows = WindowSource(dataset).rows("train")
        argv = [sys.executable, "-m", "fuelline.server.cli", "serve", dataset, "--port", "0",
                "--batch-size", str(BATCH_SIZE), "--hwm", str(HWM), "--decoded-cache-mb", "0"]
        server = stack.enter_context(ServerProcess(SERVED, argv, Path(work) / "serve.log"))
        epoch = [0]
        contenders = [
            Contender(IN_PROCESS, lambda: in_process_round(dataset, epoch)),
            Contender(SERVED, lambda: served_round(server)),
        ]
        wps = Metric("windows/s", lambda r: r.rows / r.seconds, "{:,.0f}")
        mbs = Metric("MB/s", lambda r: r.bytes / r.seconds / 1e6, "{:,.0f}")
        results = alternate(contenders, rounds, lambda r: f"{wps.of(r):,.0f} windows/s")
        stack.close()
        exits = {SERVED: server.exit_status}
    served = statistics.median(wps.of(r) for r in results[SERVED])
    parameters = {
        "rounds": rounds, "quick": quick, "recordings": recordings, "seconds": seconds, "seed": SEED, "train_windows": windows,
        "window": "2.0 s every 1.0 s, max gap 2, zscore", "batch_size": BATCH_SIZE, "hwm": HWM,
    }
    notes = [
        f"convert: {conv['tsv_mb']:.1f} MB of TSV → {conv['dataset_mb']:.1f} MB of Parquet, compression "
        f"{conv['compression_ratio']:.2f}:1; {conv['mb_per_s']['median']:.0f} MB/s of TSV read (median of {rounds}, "
        f"{conv['mb_per_s']['min']:.0f}–{conv['mb_per_s']['max']:.0f}).",
        f"fuelline serve delivers {served / REFERENCE_WINDOWS_PER_S:.1f}× the {REFERENCE_WINDOWS_PER_S:.0f} windows/s "
        "of the Arrow pipeline this work started from (target ≥ 20×).",
        f"{rounds} timed rounds, contenders alternately; one epoch of the train split ({windows} windows) per round; "
        "all seven sources (eeg, ecg, gsr, video, label, sample_id, t_start) of every window.",
        "A rate counts the windows after the first batch over the time from its arrival to the last batch's.",
        "in-process: WindowSource.iter_batches, a new source per round (so its start-up scan is not timed, "
        "but its first reads are); served: one server process for all rounds, a new client per round.",
    ]
    record, md = build_report(
        "windows", f"windows — aligned 2 s windows of {recordings} recordings × {seconds:.0f} s", results,
        [wps, mbs], [RatioSpec(SERVED, IN_PROCESS, 1.0)], parameters, notes, env, exits=exits,
        extra={"convert": conv, "reference_windows_per_s": REFERENCE_WINDOWS_PER_S,
               "served_over_reference": served / REFERENCE_WINDOWS_PER_S},
    )
    print(md, flush=True)
    for path in write_results("windows", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    return record
