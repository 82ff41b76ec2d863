"""The multimodal path: convert speed; aligned windows per second through ``fuelline serve`` beside
the same pipeline run in-process; and the server's CPU per window beside a naive in-memory numpy
alignment of the same windows.

Data: ``fuelline synth`` recordings (AMIGOS-like: EEG 128 Hz × 14, ECG 256 Hz × 2, GSR 4 Hz,
face video 30 fps × 136, clocks off by hundreds of seconds, drifting, jittering, dropping samples),
converted once per round to time ``convert``. Contenders, alternately:

- naive alignment: ``benchmarks.naive_align``, the same windows aligned one by one from samples
  held in memory (no decode, no send): the yardstick of CPU per window;
- in-process: ``WindowSource.iter_batches`` in this process: read, align, window, normalise and
  batch, exactly as the server does, but in the trainer's own process;
- fuelline serve: the same options in a server process, read through ``ServerDataStream``, every
  epoch decoded again (``--decoded-cache-mb 0``);
- fuelline serve, decoded kept: the default decoded cache, which holds the split after the
  warm-up pass: what a long-running server costs from its second epoch on;
- with ``--before REV``: the two served contenders again, as revision REV serves them (its own
  ``fuelline convert`` of the same raw recordings), for before and after in one run.

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

from benchmarks import naive_align
from benchmarks.common import (
    RESULTS_DIR,
    Contender,
    Round,
    ServerProcess,
    SourceTree,
    alternate,
    process_cpu_seconds,
    progress,
    time_batches,
)
from benchmarks.report import Metric, RatioSpec, build_report, environment, server_cpu_ms_per_window, write_results
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

EPOCHS_PER_ROUND = 10  # about half a second of the server's CPU a round (at 0.03 ms a window)
NAIVE, IN_PROCESS = "naive numpy alignment, in memory", "in-process pipeline"
SERVED, KEPT = "fuelline serve", "fuelline serve, decoded kept"
PER_CPU = "windows per CPU s"


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


def in_process_round(dataset: str, epoch: list[int], epochs: int) -> Round:
    """``epochs`` epochs of a new in-process source; its CPU is the producer's (it has no server)."""
    src = WindowSource(dataset, batch_size=BATCH_SIZE, decoded_cache_mb=0)
    first = epoch[0] + 1
    epoch[0] += epochs
    batches = (tuple(b.values()) for e in range(first, first + epochs)
               for b in src.iter_batches("train", e, 0, 1, 0, src.sources))
    r = time_batches(batches)
    src.close()
    return Round(r.batches, r.rows, r.bytes, r.seconds, 0.0, r.consumer_cpu_s)


def served_round(server: ServerProcess, epochs: int) -> Round:
    """``epochs`` epochs through a new client. The server's CPU is taken from before the client
    connects to after its last batch (the server decodes ahead of what was received, so the span
    of the timed batches alone would miss some of it), and counted per timed window."""
    cpu0 = process_cpu_seconds(server.pid)
    windows = 0

    def counted() -> Any:
        nonlocal windows
        with ServerDataStream(None, host=server.host, port=server.port, hwm=HWM, timeout=TIMEOUT_S,
                              receive_timeout=TIMEOUT_S) as stream:
            for _ in range(epochs):
                for batch in stream.get_epoch_iterator():
                    windows += len(batch[0])
                    yield batch

    r = time_batches(counted())
    cpu = process_cpu_seconds(server.pid) - cpu0
    return Round(r.batches, r.rows, r.bytes, r.seconds, r.consumer_cpu_s, cpu * r.rows / windows)


def _serve_argv(dataset: str, cache_mb: int) -> list[str]:
    return [sys.executable, "-m", "fuelline.server.cli", "serve", dataset, "--port", "0", "--batch-size",
            str(BATCH_SIZE), "--hwm", str(HWM), "--decoded-cache-mb", str(cache_mb)]


def _servers(stack: ExitStack, dataset: str, work: Path, label: str = "", pythonpath: str | None = None) -> list[ServerProcess]:
    """A server that decodes every epoch again, and one that keeps the decoded split (1 GB)."""
    return [stack.enter_context(ServerProcess(f"{name}{label}", _serve_argv(dataset, mb), work / f"serve{label}-{mb}.log",
                                              pythonpath=pythonpath))
            for name, mb in ((SERVED, 0), (KEPT, 1024))]


def run(rounds: int, data_dir: Path, results_dir: Path = RESULTS_DIR, quick: bool = False,
        before: str | None = None) -> dict[str, Any]:
    env = environment()
    recordings, seconds = (QUICK_RECORDINGS, QUICK_SECONDS) if quick else (RECORDINGS, SECONDS)
    epochs = 1 if quick else EPOCHS_PER_ROUND
    raw = ensure_raw(data_dir, recordings, seconds)
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-", dir=data_dir) as work, ExitStack() as stack:
        conv = time_convert(raw, rounds, Path(work))
        dataset = conv["dataset"]
        windows = WindowSource(dataset).rows("train")
        servers = _servers(stack, dataset, Path(work))
        label = ""
        if before is not None:
            tree = stack.enter_context(SourceTree(before, Path(work)))
            label = f" @ {tree.commit[:8]}"
            old = str(Path(work) / "converted-before")
            tree.run("convert", str(raw), old)
            servers += _servers(stack, old, Path(work), label, tree.pythonpath)
        naive_data, length = naive_align.load(dataset)
        epoch = [0]
        contenders = [
            Contender(NAIVE, lambda: naive_align.naive_round(naive_data, length, BATCH_SIZE, epochs)),
            Contender(IN_PROCESS, lambda: in_process_round(dataset, epoch, epochs)),
            *(Contender(s.name, lambda s=s: served_round(s, epochs)) for s in servers),
        ]
        wps = Metric("windows/s", lambda r: r.rows / r.seconds, "{:,.0f}")
        mbs = Metric("MB/s", lambda r: r.bytes / r.seconds / 1e6, "{:,.0f}")
        cpu = server_cpu_ms_per_window()
        per_cpu = Metric(PER_CPU, lambda r: r.rows / r.producer_cpu_s if r.producer_cpu_s else float("nan"), "{:,.0f}")
        results = alternate(contenders, rounds, lambda r: f"{wps.of(r):,.0f} windows/s, {cpu.of(r):.3f} CPU ms/window")
        stack.close()
        exits = {s.name: s.exit_status for s in servers}
    served = statistics.median(wps.of(r) for r in results[SERVED])
    parameters = {
        "rounds": rounds, "quick": quick, "recordings": recordings, "seconds": seconds, "seed": SEED, "train_windows": windows,
        "window": "2.0 s every 1.0 s, max gap 2, zscore", "batch_size": BATCH_SIZE, "hwm": HWM, "epochs_per_round": epochs,
        "before": before,
    }
    ratios = [RatioSpec(SERVED, IN_PROCESS, 1.0),
              RatioSpec(SERVED, NAIVE, 3.0, metric=PER_CPU), RatioSpec(KEPT, NAIVE, None, metric=PER_CPU)]
    if label:
        ratios += [RatioSpec(SERVED, SERVED + label, None, metric=PER_CPU), RatioSpec(KEPT, KEPT + label, None, metric=PER_CPU),
                   RatioSpec(SERVED + label, NAIVE, None, metric=PER_CPU)]
    notes = [
        f"convert: {conv['tsv_mb']:.1f} MB of TSV → {conv['dataset_mb']:.1f} MB of dataset (Parquet shards and master "
        f"grids), {conv['compression_ratio']:.2f}:1; {conv['mb_per_s']['median']:.0f} MB/s of TSV read (median of {rounds}, "
        f"{conv['mb_per_s']['min']:.0f}–{conv['mb_per_s']['max']:.0f}).",
        f"fuelline serve delivers {served / REFERENCE_WINDOWS_PER_S:.1f}× the {REFERENCE_WINDOWS_PER_S:.0f} windows/s "
        "of the Arrow pipeline this work started from (target ≥ 20×).",
        f"{rounds} timed rounds after one untimed warm-up pass of each, contenders alternately; {epochs} epoch(s) of the "
        f"train split ({windows} windows) per round; all seven sources (eeg, ecg, gsr, video, label, sample_id, t_start) "
        "of every window.",
        "A rate counts the windows after the first batch over the time from its arrival to the last batch's.",
        f"{PER_CPU}: windows per CPU second of the side that aligns them (a server process, from before its client "
        "connects to after the last batch; the naive alignment's and the in-process pipeline's own process). "
        "server CPU ms/window is its inverse. Target: the server (every epoch decoded) at ≤ 1/3 of the naive "
        "alignment's CPU per window, i.e. ≥ 3× its windows per CPU second.",
        "naive alignment: benchmarks/naive_align.py; samples decoded and in memory beforehand, per window and modality "
        "searchsorted + np.interp per channel (nearest frame for video) into the batch; no normalisation, no send.",
        "in-process: WindowSource.iter_batches, a new source per round (its start-up scan not timed, its first reads are); "
        "served: one server process per contender for all rounds, a new client per round.",
    ]
    if label:
        notes.append(f"{SERVED}{label} and {KEPT}{label}: the same, as commit {before} serves them, from its own "
                     "conversion of the same raw recordings (a git worktree of that commit).")
    record, md = build_report(
        "windows", f"windows — aligned 2 s windows of {recordings} recordings × {seconds:.0f} s", results,
        [wps, mbs, cpu, per_cpu], ratios, parameters, notes, env, exits=exits,
        extra={"convert": conv, "reference_windows_per_s": REFERENCE_WINDOWS_PER_S,
               "served_over_reference": served / REFERENCE_WINDOWS_PER_S},
    )
    print(md, flush=True)
    for path in write_results("windows", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    return record
