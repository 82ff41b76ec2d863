"""The Parquet path: one epoch of a Parquet dataset through ``fuelline serve``, against reading
the same files in-process with pyarrow.

The in-process reader is what a training script would do without a data server: iterate every
file's record batches and turn each column into numpy. fuelline does the same work in another
process (decode row groups, cut batches, shuffle if asked) and then moves every batch over tcp
loopback, so the ratio says what serving costs against reading the data yourself.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import (
    DEFAULT_DATA_DIR,
    RESULTS_DIR,
    Contender,
    Round,
    ServerProcess,
    alternate,
    progress,
    time_batches,
)
from benchmarks.report import Metric, RatioSpec, build_report, environment, write_results
from fuelline.client import ServerDataStream
from fuelline.server.sources.sample import write_sample_dataset

__all__ = ["run", "ensure_dataset", "dataset_rows"]

# The dataset: ~1 KB rows, as many files and row groups as a modest real dataset.
DIM = 256
FILES = 16
ROW_GROUP_ROWS = 8192
VAL_FRACTION = 0.2  # write_sample_dataset's default: that share of rows goes to val/
# sample_id int64 + features DIM × float32 + label int64 + weight float32, per write_sample_dataset.
ROW_BYTES = 8 + 4 * DIM + 8 + 4
DATASET_FORMAT = 1  # bump when the generated data changes, so that an old dataset is not reused

BATCH_SIZE = 256
HWM = 10
TIMEOUT_S = 60.0

IN_PROCESS, SERVE_ORDERED, SERVE_SHUFFLED = "in-process pyarrow", "fuelline serve --no-shuffle", "fuelline serve (shuffled)"
SERVE_SHUFFLED_BEFORE = "fuelline serve (shuffled), --before checkout"
SHUFFLED_TARGET = 0.90


# -- the dataset -----------------------------------------------------------------------------------
def dataset_rows(gb: float) -> int:
    """Total rows such that the train split alone (what is read) holds at least ``gb`` GB."""
    train_needed = math.ceil(gb * 1e9 / ROW_BYTES)
    rows = math.ceil(train_needed / (1 - VAL_FRACTION))
    while rows - max(1, int(rows * VAL_FRACTION)) < train_needed:  # the same split arithmetic
        rows += 1
    return rows


def ensure_dataset(data_dir: Path, gb: float) -> tuple[Path, dict[str, Any]]:
    """The dataset for ``gb``, generated on first use and reused after (its name holds every
    parameter, and it appears by an atomic rename, so a directory that exists is complete)."""
    rows = dataset_rows(gb)
    name = f"sample-v{DATASET_FORMAT}-{rows}rows-{DIM}dim-{FILES}files-{ROW_GROUP_ROWS}rg"
    path = data_dir / name
    sidecar = data_dir / f"{name}.json"
    if path.is_dir():
        meta = json.loads(sidecar.read_text()) if sidecar.exists() else {}
        meta["reused"] = True
        return path, meta
    data_dir.mkdir(parents=True, exist_ok=True)
    progress(f"generating {path} ({rows:,} rows, ~{rows * ROW_BYTES / 1e9:.2f} GB in memory) ...")
    started = time.perf_counter()
    counts = write_sample_dataset(str(path), rows=rows, dim=DIM, files=FILES, row_group_rows=ROW_GROUP_ROWS)
    seconds = time.perf_counter() - started
    meta = {"rows": rows, "splits": counts, "dim": DIM, "files": FILES, "row_group_rows": ROW_GROUP_ROWS,
            "generation_s": round(seconds, 2), "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    sidecar.write_text(json.dumps(meta, indent=2) + "\n")
    progress(f"generated in {seconds:.1f}s")
    meta["reused"] = False
    return path, meta


def train_files(dataset: Path) -> list[Path]:
    files = sorted((dataset / "train").glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"{dataset}/train holds no .parquet files")
    return files


def warm_page_cache(files: list[Path]) -> int:
    """Read every file once, so that no contender is first to pay for the disk."""
    total = 0
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                total += len(chunk)
    return total


# -- in-process pyarrow ----------------------------------------------------------------------------
def _column_numpy(col: pa.Array) -> np.ndarray:
    if pa.types.is_fixed_size_list(col.type):
        return col.flatten().to_numpy().reshape(len(col), col.type.list_size)
    return col.to_numpy()


def pyarrow_batches(files: list[Path], batch_size: int = BATCH_SIZE) -> Iterator[tuple[np.ndarray, ...]]:
    for path in files:
        pf = pq.ParquetFile(path)
        try:
            for rb in pf.iter_batches(batch_size=batch_size):
                yield tuple(_column_numpy(col) for col in rb.columns)
        finally:
            pf.close()


def in_process_round(files: list[Path], train_rows: int) -> Round:
    return _checked(time_batches(pyarrow_batches(files)), train_rows, IN_PROCESS)


# -- fuelline serve ------------------------------------------------------------------------------
def serve_process(name: str, dataset: Path, shuffle: bool, log_dir: Path, checkout: Path | None = None) -> ServerProcess:
    """``fuelline serve`` of this tree, or of ``checkout`` (another revision's working tree) when given."""
    python = [sys.executable, "-m", "fuelline.server.cli"] if checkout is None else _checkout_python(checkout, log_dir)
    argv = [*python, "serve", str(dataset), "--port", "0",
            "--batch-size", str(BATCH_SIZE), "--hwm", str(HWM), "--shuffle" if shuffle else "--no-shuffle",
            "--decoded-cache-mb", "0"]  # like in-process pyarrow, every round reads the files again
    log = f"{'shuffled' if shuffle else 'ordered'}{'' if checkout is None else '-before'}.log"
    return ServerProcess(name, argv, log_dir / log)


def _checkout_python(checkout: Path, scratch: Path) -> list[str]:
    """A command line that runs the fuelline CLI of ``checkout``: its top-level folders are the
    ``fuelline.*`` packages (setup.cfg maps them), so a folder of links named as those packages,
    put first on sys.path, is found before this tree's editable install."""
    checkout = checkout.resolve()
    if not (checkout / "server" / "cli" / "__main__.py").is_file():
        raise FileNotFoundError(f"--before {checkout}: not a checkout of this project (no server/cli/__main__.py)")
    links = scratch / "before-links" / "fuelline"
    links.mkdir(parents=True, exist_ok=True)
    for folder in ("protocol", "client", "server", "trainer"):
        if not (links / folder).exists():
            (links / folder).symlink_to(checkout / folder)
    boot = (f"import runpy, sys; sys.path.insert(0, {str(links.parent)!r}); "
            "runpy.run_module('fuelline.server.cli', run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", boot]


def served_round(server: ServerProcess, train_rows: int) -> Round:
    with ServerDataStream(None, host=server.host, port=server.port, hwm=HWM, split="train", timeout=TIMEOUT_S,
                          receive_timeout=TIMEOUT_S) as stream:
        r = time_batches(stream.get_epoch_iterator(), producer_pid=server.pid)
    return _checked(r, train_rows, server.name)


def _checked(r: Round, train_rows: int, who: str) -> Round:
    """Every contender must deliver the whole split: a fast reader that drops rows is no result."""
    first = train_rows - r.rows  # the first batch is not in r.rows
    if not 0 < first <= BATCH_SIZE:
        raise RuntimeError(f"{who}: an epoch delivered {r.rows} rows after its first batch; the split has {train_rows}")
    return r


# -- the benchmark ----------------------------------------------------------------------------------
def run(rounds: int, gb: float, data_dir: Path, results_dir: Path = RESULTS_DIR, before: Path | None = None) -> dict[str, Any]:
    """Run the Parquet benchmark, print its table and write its results; returns the record.
    With ``before`` (a checkout of another revision), its shuffled server runs too, in the same
    rounds, for a before/after comparison."""
    env = environment()
    dataset, generation = ensure_dataset(data_dir, gb)
    files = train_files(dataset)
    train_rows = sum(pq.read_metadata(f).num_rows for f in files)
    cached = warm_page_cache(files)
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-") as logs, ExitStack() as stack:
        ordered = stack.enter_context(serve_process(SERVE_ORDERED, dataset, False, Path(logs)))
        shuffled = stack.enter_context(serve_process(SERVE_SHUFFLED, dataset, True, Path(logs)))
        contenders = [
            Contender(IN_PROCESS, lambda: in_process_round(files, train_rows)),
            Contender(SERVE_ORDERED, lambda: served_round(ordered, train_rows)),
            Contender(SERVE_SHUFFLED, lambda: served_round(shuffled, train_rows)),
        ]
        servers = [ordered, shuffled]
        if before is not None:
            earlier = stack.enter_context(serve_process(SERVE_SHUFFLED_BEFORE, dataset, True, Path(logs), before))
            servers.append(earlier)
            contenders.append(Contender(SERVE_SHUFFLED_BEFORE, lambda: served_round(earlier, train_rows)))
        rows_s = Metric("rows/s", lambda r: r.rows / r.seconds, "{:,.0f}")
        mb_s = Metric("MB/s", lambda r: r.bytes / r.seconds / 1e6, "{:,.0f}")
        results = alternate(contenders, rounds, lambda r: f"{rows_s.of(r):,.0f} rows/s, {mb_s.of(r):,.0f} MB/s")
        stack.close()  # stop the servers now: their exit status belongs in the record
        exits = {server.name: server.exit_status for server in servers}
    disk = sum(f.stat().st_size for f in files)
    parameters = {
        "rounds": rounds, "gb": gb, "dataset": str(dataset), "train_files": len(files), "train_rows": train_rows,
        "train_bytes_in_memory": train_rows * ROW_BYTES, "train_bytes_on_disk": disk, "dim": DIM,
        "row_group_rows": ROW_GROUP_ROWS, "batch_size": BATCH_SIZE, "hwm": HWM,
        "columns": "sample_id int64, features fixed_size_list<float32>[256], label int64, weight float32",
        "order": "one untimed warm-up pass of each, then rounds of " + ", ".join(c.name for c in contenders),
    }
    gen = "reused from an earlier run" if generation.get("reused") else "generated by this run"
    notes = [
        f"Train split: {train_rows:,} rows in {len(files)} files, {train_rows * ROW_BYTES / 1e9:.2f} GB of numbers in "
        f"memory, {disk / 1e9:.2f} GB on disk; dataset {gen} (generation took {generation.get('generation_s', '?')}s).",
        f"Page cache warm for all contenders alike: every train file was read once ({cached / 1e9:.2f} GB), then "
        "each contender made one untimed warm-up pass, before any timed round.",
        f"{rounds} timed rounds, contenders alternately (" + " ".join(c.name for c in contenders) + " ...); "
        f"one epoch of split train per round, batches of {BATCH_SIZE} rows, all four columns as numpy arrays.",
        "A rate counts the rows after the first batch over the time from its arrival to the last batch's: "
        "connection setup and the first read are excluded, alike for all contenders. MB = 10^6 bytes.",
        "in-process pyarrow: ParquetFile(path).iter_batches(batch_size=256) per file, every column to numpy "
        "(fixed-size lists flattened and reshaped), no copy beyond pyarrow's own.",
        "fuelline serve: one server process per mode, started once and kept across rounds; a new "
        "ServerDataStream(hwm=10) per round; xxh3 checksums on (the default); --decoded-cache-mb 0, so every "
        "round reads and decodes the files again, as in-process does (a server keeping decoded row groups "
        "would serve its later rounds from memory).",
        "CPU s/GB adds the consumer's and the server's CPU time (all threads, /proc) over the timed span; "
        "in-process has no server.",
    ]
    ratios = [RatioSpec(SERVE_ORDERED, IN_PROCESS, 0.80), RatioSpec(SERVE_SHUFFLED, IN_PROCESS, SHUFFLED_TARGET)]
    if before is not None:
        ratios += [RatioSpec(SERVE_SHUFFLED_BEFORE, IN_PROCESS, SHUFFLED_TARGET), RatioSpec(SERVE_SHUFFLED, SERVE_SHUFFLED_BEFORE)]
        notes.append(f"{SERVE_SHUFFLED_BEFORE}: the same server run from {before.resolve()} (another revision), "
                     "in the same rounds, for a before/after comparison.")
    record, md = build_report(
        "parquet", f"parquet — one epoch of a {train_rows * ROW_BYTES / 1e9:.2f} GB train split", results,
        [rows_s, mb_s], ratios,
        parameters, notes, env, exits=exits, extra={"generation": generation},
    )
    print(md, flush=True)
    for path in write_results("parquet", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parquet_path", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per contender (default 5, at least 2)")
    parser.add_argument("--gb", type=float, default=1.0, help="GB of in-memory numbers in the train split (default 1.0)")
    parser.add_argument("--quick", action="store_true", help="a small run: 0.05 GB, 2 rounds (a check, not a measurement)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where the dataset is generated and reused")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where parquet.json/.md/.png are written (default benchmarks/results; with --quick or "
                             "--before, a new temporary directory)")
    parser.add_argument("--before", type=Path, default=None, metavar="CHECKOUT",
                        help="also serve shuffled from this checkout of another revision (e.g. made with "
                             "`git worktree add /tmp/parquet-before HEAD`), in the same rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.gb = 2, 0.05
    if args.rounds < 2 or not args.gb > 0:
        parser.error("--rounds must be >= 2 and --gb > 0")
    results_dir = args.results_dir
    if results_dir is None:
        quiet = args.quick or args.before is not None  # the published figures come from a plain run
        results_dir = Path(tempfile.mkdtemp(prefix="fuelline-bench-parquet-")) if quiet else RESULTS_DIR
    record = run(args.rounds, args.gb, args.data_dir, results_dir, before=args.before)
    from benchmarks import plots  # (matplotlib: only when a plot is drawn)

    print(f"wrote {plots.for_record(record, results_dir)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
