"""``python -m benchmarks guard``: the ratios users compare, measured in one run of about two
minutes, against the ratios recorded in the repository; it names every one that dropped by more
than a fifth and exits 1 if any did.

Each ratio is fuelline over a reference that runs beside it in the same rounds (alternately, the
median of per-round ratios), so that the figure says what fuelline adds, not how fast this machine
is today:

- fuel stream: a Fuel-style stream of one reused 3 MB array, ``start_server`` read by a default
  ``ServerDataStream`` on the same host, over bare pyzmq over TCP (the Fuel-stream benchmark's path,
  each round a new server and its first pass);
- transport: the same stream read over TCP (``local=False``, checksums on) over bare pyzmq + xxh3;
- table: ``fuelline serve`` of a Parquet table, shuffled, over reading it in-process with pyarrow;
- windows: ``fuelline serve`` of the multimodal windows, decoded kept, over a naive numpy alignment
  in the reader's process.

``--record`` writes the figures as the new reference (``benchmarks/results/guard.json``): do it
when a change moves a ratio on purpose, and say so in its note.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks import fuel_stream, naive_align, parquet_path, transport, windows
from benchmarks.common import DEFAULT_DATA_DIR, RESULTS_DIR, Contender, Round, ServerProcess, alternate, progress
from benchmarks.report import environment

__all__ = ["main", "measure", "compare", "DROP"]

DROP = 0.2  # a ratio that fell by more than this share of its recorded value is named
REFERENCE = RESULTS_DIR / "guard.json"
FUEL_BATCHES = 400  # 3 MB batches a round, fuel stream and transport
TABLE_GB = 0.25
WINDOW_RECORDINGS, WINDOW_SECONDS, WINDOW_EPOCHS = 10, 60.0, 3


def _rate(r: Round) -> float:
    return r.rows / r.seconds


def _pair(name: str, ours: Contender, reference: Contender, rounds: int) -> dict[str, Any]:
    results = alternate([ours, reference], rounds, lambda r: f"{_rate(r):,.0f} rows/s")
    per_round = [_rate(a) / _rate(b) for a, b in zip(results[ours.name], results[reference.name])]
    return {"ratio": statistics.median(per_round), "per_round": per_round, "numerator": ours.name,
            "denominator": reference.name}


def measure(rounds: int, data_dir: Path) -> dict[str, dict[str, Any]]:
    """Each guarded ratio, measured now."""
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="fuelline-guard-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        here = [sys.executable, str(fuel_stream.ENDS)]

        def fuel_round() -> Round:
            return fuel_stream._round(fuel_stream.FUELLINE, [*here, "serve", "fuelline", str(FUEL_BATCHES)],
                                      [*here, "read", "fuelline"], None, work, FUEL_BATCHES)

        bare = stack.enter_context(transport.BareSender())
        bare_xxh3 = stack.enter_context(transport.BareSender(checksum=True))
        progress("guard: fuel stream")
        out["fuel stream"] = _pair("fuel stream", Contender("fuelline, local", fuel_round),
                                   Contender("bare pyzmq", lambda: transport.bare_round(bare, FUEL_BATCHES)), rounds)
        progress("guard: transport")
        served = stack.enter_context(transport.fuelline_server(transport.FUELLINE, FUEL_BATCHES, True, work))
        out["transport"] = _pair(
            "transport", Contender("fuelline, TCP", lambda: transport.fuelline_round(served, FUEL_BATCHES)),
            Contender("bare pyzmq + xxh3", lambda: transport.bare_round(bare_xxh3, FUEL_BATCHES, transport.BARE_XXH3)),
            rounds)

        progress("guard: table")
        dataset, _ = parquet_path.ensure_dataset(data_dir, TABLE_GB)
        files = parquet_path.train_files(dataset)
        rows = sum(parquet_path.pq.read_metadata(f).num_rows for f in files)
        parquet_path.warm_page_cache(files)
        table = stack.enter_context(parquet_path.serve_process("fuelline serve, shuffled", dataset, True, work))
        out["table"] = _pair("table", Contender(table.name, lambda: parquet_path.served_round(table, rows)),
                             Contender("in-process pyarrow", lambda: parquet_path.in_process_round(files, rows)), rounds)

        progress("guard: windows")
        raw = windows.ensure_raw(data_dir, WINDOW_RECORDINGS, WINDOW_SECONDS)
        converted = str(work / "windows")
        windows.convert(str(raw), converted, progress=False)
        server = stack.enter_context(ServerProcess("fuelline serve, windows", windows._serve_argv(converted, 1024),
                                                   work / "windows.log"))
        recordings, length = naive_align.load(converted)
        out["windows"] = _pair(
            "windows", Contender(server.name, lambda: windows.served_round(server, WINDOW_EPOCHS)),
            Contender("naive numpy alignment", lambda: naive_align.naive_round(recordings, length, windows.BATCH_SIZE,
                                                                               WINDOW_EPOCHS)), rounds)
    return out


def compare(now: dict[str, dict[str, Any]], recorded: dict[str, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The report's lines, and the names of the ratios that dropped by more than ``DROP``."""
    lines = ["| ratio | now | recorded | now / recorded | per round now |", "|---|---:|---:|---:|---|"]
    dropped = []
    for name, m in now.items():
        ref = recorded.get(name, {}).get("ratio")
        change = m["ratio"] / ref if ref else None
        if change is not None and change < 1 - DROP:
            dropped.append(name)
        rounds = ", ".join(f"{x:.2f}" for x in m["per_round"])
        lines.append(f"| {name}: {m['numerator']} / {m['denominator']} | {m['ratio']:.3f} | "
                     f"{'—' if ref is None else f'{ref:.3f}'} | {'—' if change is None else f'{change:.2f}'}"
                     f"{' **dropped**' if name in dropped else ''} | {rounds} |")
    return lines, dropped


def main(argv: Sequence[str] | None = None, write: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks guard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds per ratio (default 9)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where datasets are made and reused")
    parser.add_argument("--reference", type=Path, default=REFERENCE, help="the recorded ratios (default %(default)s)")
    parser.add_argument("--record", action="store_true", help="write this run's ratios as the reference")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2")
    started = time.perf_counter()
    now = measure(args.rounds, args.data_dir)
    recorded = json.loads(args.reference.read_text())["ratios"] if args.reference.exists() else {}
    lines, dropped = compare(now, recorded)
    write("\n".join(lines))
    env = environment()
    if args.record:
        args.reference.write_text(json.dumps({"ratios": now, "rounds": args.rounds, "source": env.get("source"),
                                              "machine": env.get("machine")}, indent=2) + "\n")
        write(f"recorded {args.reference}")
    elif not recorded:
        write(f"no reference at {args.reference}: run with --record to make one")
    write(f"{time.perf_counter() - started:.0f} s; " + (
        f"dropped by more than {DROP:.0%}: {', '.join(dropped)}" if dropped else "no ratio dropped by more than "
        f"{DROP:.0%}"))
    return 1 if dropped else 0
