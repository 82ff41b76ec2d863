"""``python -m benchmarks [transport|parquet|windows|trainer]``: run one benchmark, or all."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from benchmarks.common import DEFAULT_DATA_DIR, RESULTS_DIR

BENCHMARKS = ("transport", "parquet", "windows", "trainer")


def _at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("benchmark", nargs="?", choices=BENCHMARKS, help="which one (default: all)")
    # Two rounds at least: a single run's figure says nothing about its own noise.
    parser.add_argument("--rounds", type=_at_least(2), default=5, help="timed rounds per contender (default 5)")
    parser.add_argument("--batches", type=_at_least(2), default=400,
                        help="transport: 3 MB batches per round (default 400, about 1.2 GB)")
    parser.add_argument("--gb", type=_positive_float, default=1.0,
                        help="parquet: GB of in-memory numbers in the train split (default 1.0)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="parquet: where the dataset is generated and reused (default benchmarks/.data)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help="where <name>.json and <name>.md are written (default benchmarks/results)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    chosen = [args.benchmark] if args.benchmark else list(BENCHMARKS)
    for name in chosen:
        if name == "transport":
            from benchmarks import transport

            transport.run(args.rounds, args.batches, args.results_dir)
        elif name == "parquet":
            from benchmarks import parquet_path

            parquet_path.run(args.rounds, args.gb, args.data_dir, args.results_dir)
        elif name == "windows":
            from benchmarks import windows

            windows.run(args.rounds, args.data_dir, args.results_dir)
        else:
            from benchmarks import trainer

            trainer.run(args.rounds, args.data_dir, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
