"""DataLoader workers: ``DataLoader(ServerDataset(...), batch_size=None, num_workers=K)`` against
a plain ``ServerDataStream(tensors=True)``, reading one served Parquet table, in one run.

``python -m benchmarks loader-workers``. A data server already does the reading, decoding and
batching in a process of its own; a DataLoader worker can only add a hop: each batch arrives in
the worker, is copied into shared memory for the DataLoader's queue, its file descriptor passed
and mapped again in the main process. This measures what that hop costs, so that the docs can
say which setup to use: rows/s from the first batch to the last, and CPU per 1,000 rows over
every process (the server, the reader, its workers).
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterable

from benchmarks import parquet_path
from benchmarks.common import (
    DEFAULT_DATA_DIR,
    RESULTS_DIR,
    Contender,
    Round,
    ServerProcess,
    alternate,
    process_cpu_seconds,
)
from benchmarks.report import Metric, RatioSpec, build_report, environment, write_results

__all__ = ["run"]

BATCH_SIZE = 1024
HWM = 10
TIMEOUT_S = 60.0
STREAM = "ServerDataStream(tensors=True)"


def _loader(workers: int) -> str:
    return f"DataLoader(ServerDataset), num_workers={workers}"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # (workers that ended, once reaped)
    return usage.ru_utime + usage.ru_stime


def _all_cpu(server: ServerProcess) -> float:
    return (process_cpu_seconds(server.pid) or 0.0) + (process_cpu_seconds(os.getpid()) or 0.0) + _children_cpu()


def _timed(batches: Iterable[Any], server: ServerProcess, rows_expected: int, who: str) -> Round:
    """One epoch: rows/s from the first batch's arrival to the last's; CPU of every process over it."""
    first = last = None
    rows = nbytes = count = 0
    cpu0 = 0.0
    for batch in batches:
        now = time.perf_counter()
        count += 1
        float(batch[0].reshape(-1)[0])  # (touch it)
        if first is None:
            first, cpu0 = now, _all_cpu(server)
            continue
        last = now
        rows += len(batch[0])
        nbytes += sum(t.numel() * t.element_size() for t in batch)
    cpu = _all_cpu(server) - cpu0  # (after the loader's workers were joined: theirs is in)
    if first is None or last is None or not 0 < rows_expected - rows <= BATCH_SIZE:
        raise RuntimeError(f"{who}: {rows} rows after the first batch, the split has {rows_expected}")
    return Round(count, rows, nbytes, last - first, cpu, None)


def stream_round(server: ServerProcess, rows: int) -> Round:
    from fuelline.client import ServerDataStream

    with ServerDataStream(("features", "label"), host=server.host, port=server.port, hwm=HWM, tensors=True,
                          timeout=TIMEOUT_S, receive_timeout=TIMEOUT_S) as stream:
        return _timed(stream.get_epoch_iterator(), server, rows, STREAM)


def loader_round(server: ServerProcess, rows: int, workers: int, dataset: Any) -> Round:
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=None, num_workers=workers, timeout=TIMEOUT_S if workers else 0)
    return _timed(iter(loader), server, rows, _loader(workers))


def run(rounds: int, data_dir: Path = DEFAULT_DATA_DIR, results_dir: Path = RESULTS_DIR, gb: float = 0.25,
        workers: tuple[int, ...] = (0, 2, 4)) -> dict[str, Any]:
    from benchmarks import plots
    from fuelline.client import ServerDataset

    env = environment()
    dataset, _ = parquet_path.ensure_dataset(data_dir, gb)
    files = parquet_path.train_files(dataset)
    rows = sum(parquet_path.pq.read_metadata(f).num_rows for f in files)
    parquet_path.warm_page_cache(files)
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-") as logs, ExitStack() as stack:
        argv = [sys.executable, "-m", "fuelline.server.cli", "serve", str(dataset), "--port", "0",
                "--batch-size", str(BATCH_SIZE), "--hwm", str(HWM)]
        server = stack.enter_context(ServerProcess("fuelline serve", argv, Path(logs) / "serve.log"))
        contenders = [Contender(STREAM, lambda: stream_round(server, rows))]
        for k in workers:
            data = ServerDataset(("features", "label"), host=server.host, port=server.port, hwm=HWM,
                                 timeout=TIMEOUT_S, receive_timeout=TIMEOUT_S)
            contenders.append(Contender(_loader(k), lambda k=k, data=data: loader_round(server, rows, k, data)))
        rows_s = Metric("rows/s", lambda r: r.rows / r.seconds, "{:,.0f}")
        cpu = Metric("CPU ms per 1,000 rows", lambda r: 1e6 * r.consumer_cpu_s / r.rows, "{:.2f}")
        results = alternate(contenders, rounds, lambda r: f"{rows_s.of(r):,.0f} rows/s, {cpu.of(r):.2f} CPU ms/1k rows")
        stack.close()
        exits = {STREAM: server.exit_status}
    ratios = [RatioSpec(_loader(k), STREAM, 0.9) for k in workers]
    ratios += [RatioSpec(_loader(k), STREAM, metric="CPU ms per 1,000 rows", higher=False) for k in workers]
    notes = [
        f"{rounds} rounds, contenders alternately, one epoch each of the train split of {dataset.name} "
        f"({rows:,} rows of 256 float32 features + an int64 label), served by one `fuelline serve` (default "
        f"options: shuffled) in batches of {BATCH_SIZE}, read on the same host.",
        "DataLoader(ServerDataset(...), batch_size=None, num_workers=K) as the README showed it, workers not "
        "persistent (new each epoch, as by default); the worker start is before the first batch and not timed.",
        "CPU: the server (with its children), this process and its DataLoader workers (reaped ones included), "
        "from the first batch to the end of the epoch.",
    ]
    record, md = build_report("loader-workers", "DataLoader workers over a data server — one served table",
                              results, [rows_s, cpu], ratios, {"rounds": rounds, "rows": rows, "batch_size": BATCH_SIZE,
                                                               "workers": list(workers)}, notes, env, exits)
    print(md, flush=True)
    for path in write_results("loader-workers", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    print(f"wrote {plots.for_record(record, results_dir)}", flush=True)
    return record
