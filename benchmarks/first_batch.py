"""``python -m benchmarks first-batch``: from starting ``fuelline serve`` on a large Parquet table
to a reader's first batch.

What a user waits for when a job starts: the server's start (imports, every file's footer, the
fingerprint), its plan of the epoch, decoding the first rows' row groups, and the connection. The
table is the peers' flat table (64 float32 features, a label, a row id: 272 bytes a row) made
``--gb`` large, in files of row groups of ``--row-group-rows`` rows, generated once and reused.

Each round starts a new server (this tree's, and with ``--before REV`` that revision's, in
turn) for each reader: rank 0 of 1, and the last rank of ``--world`` (whose rows start at the
end of the epoch's order). The reader is a ``ServerDataStream`` in this process, already imported
(numpy arrays: a trainer's ``import torch`` is its own cost), that connects once the server says
it is serving. Times run from the server's spawn. The files are in the page cache (read once
before the first round), as on a host that served them before; a cold disk adds its own reading.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Sequence

from benchmarks.common import DEFAULT_DATA_DIR, RESULTS_DIR, ServerProcess, SourceTree, progress
from benchmarks.parquet_path import warm_page_cache
from benchmarks.peers import dataset
from benchmarks.report import environment, write_results
from fuelline.client import ServerDataStream

__all__ = ["run", "table_for"]

BATCH_SIZE = 1024
FILES = 32
TIMEOUT_S = 120.0


def table_for(gb: float, row_group_rows: int) -> dataset.Table:
    """The flat table of at least ``gb`` GB of rows, in ``FILES`` files of whole row groups."""
    per = row_group_rows * FILES
    rows = max(1, -(-int(gb * 1e9 / dataset.ROW_BYTES) // per)) * per
    return dataset.Table(rows, row_group_rows, FILES)


def _one(argv: list[str], log: Path, pythonpath: str | None, rank: int, world: int) -> dict[str, float]:
    started = time.perf_counter()
    server = ServerProcess("serve", argv, log, ready_timeout=TIMEOUT_S, pythonpath=pythonpath)
    with server:
        ready = time.perf_counter() - started
        stream = ServerDataStream(host=server.host, port=server.port, rank=rank, world_size=world, timeout=TIMEOUT_S)
        try:
            batch = next(iter(stream.get_epoch_iterator()))
            first = time.perf_counter() - started
            if len(batch[0]) != BATCH_SIZE:
                raise RuntimeError(f"the first batch has {len(batch[0])} rows, not {BATCH_SIZE}")
        finally:
            stream.close()
    return {"ready_s": ready, "first_batch_s": first}


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


Readings = dict[str, dict[str, list[dict[str, float]]]]  # server → reader → one dict a round


def _readings(root: Path, readers: list[tuple[str, int, int]], rounds: int, before: str | None) -> Readings:
    """Every reader's times, a new server each, round after round, this tree's and ``before``'s in turn."""
    results: Readings = {}
    with tempfile.TemporaryDirectory(prefix="fuelline-first-batch-") as tmp, ExitStack() as stack:
        trees: list[tuple[str, str | None]] = [("fuelline", None)]
        if before:
            tree = stack.enter_context(SourceTree(before, Path(tmp)))
            trees.append((before, tree.pythonpath))
        argv = [sys.executable, "-m", "fuelline.server.cli", "serve", str(root / "parquet"), "--port", "0",
                "--batch-size", str(BATCH_SIZE)]
        for i in range(rounds + 1):  # round 0 is a warm-up, for all alike
            for name, pythonpath in trees:
                for who, rank, w in readers:
                    got = _one(argv, Path(tmp) / f"{name}-{i}.log", pythonpath, rank, w)
                    progress(f"{'warm-up' if not i else f'round {i}/{rounds}'} {name}, {who}: ready {got['ready_s']:.2f}s, "
                             f"first batch {got['first_batch_s']:.2f}s")
                    if i:
                        results.setdefault(name, {}).setdefault(who, []).append(got)
    return results


def _tables(record: dict[str, Any], results: Readings, readers: list[tuple[str, int, int]], before: str | None) -> list[str]:
    """The markdown table (and the per-round ratios), filling ``record["results"]`` as it goes."""
    lines = [f"## First batch — `fuelline serve` of a {record['parameters']['gb']} GB table to a reader's first batch", "",
             "| server | reader | ready, median s | first batch, median s | min–max s | rounds |", "|---|---|---:|---:|---|---:|"]
    for name, by_reader in results.items():
        record["results"][name] = {}
        for who, got in by_reader.items():
            ready, first = _stats([g["ready_s"] for g in got]), _stats([g["first_batch_s"] for g in got])
            record["results"][name][who] = {"ready_s": ready, "first_batch_s": first, "rounds": got}
            lines.append(f"| {name} | {who} | {ready['median']:.2f} | {first['median']:.2f} | "
                         f"{first['min']:.2f}–{first['max']:.2f} | {len(got)} |")
    if before:
        lines += ["", "Per round, this tree's first batch over the other's (lower is sooner):", ""]
        for who, _, _ in readers:
            ratios = [a["first_batch_s"] / b["first_batch_s"] for a, b in zip(results["fuelline"][who], results[before][who])]
            record["results"].setdefault("ratios", {})[who] = ratios
            lines.append(f"- {who}: median {statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})")
    return lines


def run(gb: float, row_group_rows: int, world: int, rounds: int, before: str | None, data_dir: Path,
        results_dir: Path) -> list[Path]:
    table = table_for(gb, row_group_rows)
    progress(f"table: {table.rows:,} rows, {table.groups} row groups of {row_group_rows:,} rows in {FILES} files")
    root, meta = dataset.ensure(data_dir, table)
    warm_page_cache(sorted((root / "parquet").glob("*.parquet")))
    env = environment()
    readers = [("rank 0 of 1", 0, 1), (f"rank {world - 1} of {world}", world - 1, world)]
    results = _readings(root, readers, rounds, before)
    record: dict[str, Any] = {"benchmark": "first-batch", **env, "parameters": {
        "gb": round(table.rows * dataset.ROW_BYTES / 1e9, 2), "rows": table.rows, "row_group_rows": row_group_rows,
        "row_groups": table.groups, "files": FILES, "batch_size": BATCH_SIZE, "rounds": rounds, "before": before,
        "table_generation_s": meta.get("generation_s")}, "results": {}}
    lines = _tables(record, results, readers, before)
    m, src = env["machine"], env.get("source") or {}
    record["machine"]["loadavg_at_end"] = list(os.getloadavg())
    lines += ["", "Notes:", "",
              f"- {table.rows:,} rows × 272 bytes (features fixed_size_list<float32>[64], label int64, row_id int64) in "
              f"{FILES} files, {table.groups} row groups of {row_group_rows:,} rows; the default shuffle (blocks of 8 row groups).",
              "- Each reading starts a new server; times run from its spawn: 'ready' to its 'serving on' line, 'first batch' "
              "to the first batch in the reader (this process, imports done, numpy arrays, connecting once the server is ready).",
              "- The table's files are in the page cache, read once before the first round; one warm-up round, not counted.",
              f"- {record['date']}; {m.get('cpu_count')} CPUs, {m.get('platform')}; load average {m.get('loadavg_at_start')} at start, "
              f"{[round(x, 2) for x in m['loadavg_at_end']]} at end.",
              f"- source: commit {src.get('commit', '?')}{' with uncommitted changes' if src.get('dirty') else ''}."]
    return write_results("first-batch", record, "\n".join(lines) + "\n", results_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=10.0, help="GB of rows in the table (default 10)")
    parser.add_argument("--row-group-rows", type=int, default=131_072, help="rows per row group (default 131072, 36 MB)")
    parser.add_argument("--world", type=int, default=8, help="the world size whose last rank also reads (default 8)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--before", metavar="REV", help="also serve with this revision, in the same rounds")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.world < 2 or args.rounds < 2 or args.gb <= 0 or args.row_group_rows < 1:
        parser.error("--world and --rounds must be at least 2, --gb and --row-group-rows positive")
    for path in run(args.gb, args.row_group_rows, args.world, args.rounds, args.before, args.data_dir, args.results_dir):
        progress(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
