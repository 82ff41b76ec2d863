"""``python -m benchmarks [BENCHMARK] [--quick]``: run one benchmark, or all, then write the summary.

``python -m benchmarks guard [--record]``: the ratios users compare, in about two minutes, against
those recorded in the repository (``benchmarks.guard``).

``python -m benchmarks first-batch [--gb 10] [--before REV]``: from starting ``fuelline serve`` on a
large table to a reader's first batch (``benchmarks.first_batch``).

Benchmarks: transport, parquet, windows, pipeline, overlap, scaling, scaleout, trainer, compression;
convergence, cost and stages only when named (``python -m benchmarks convergence``, or ``python -m benchmarks.convergence``
with its own options; likewise ``cost``).
Each writes ``<name>.json``, ``<name>.md`` and ``<name>.png`` to the results directory, and every
run ends with ``summary.md`` and ``summary.png`` there. ``--quick`` runs them at tiny sizes with
2 rounds (a check that they work, not a measurement), into a temporary directory unless
``--results-dir`` is given.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from benchmarks.common import DEFAULT_DATA_DIR, RESULTS_DIR, progress

BENCHMARKS = ("transport", "parquet", "windows", "pipeline", "overlap", "scaling", "scaleout", "trainer", "compression")
# Run only when named: 15 epochs per configuration and seed take many minutes, and --quick
# cannot show convergence.
# cost: 34 server configurations, about a quarter of an hour at full size.
# stages: a slow stage beside an honest client, 30 s a case and round.
# exchange: the 1-bit exchange against fp32 all-reduce on gloo ranks (links of a bed with
# ``python -m benchmarks.exchange --links``).
# fuel-stream: fuelline against Fuel 0.2, whose environment is made from the package index on first use.
# loader-workers: DataLoader(ServerDataset) with 0, 2 and 4 workers against ServerDataStream.
# heap: readers in processes of their own, with glibc's heap and with fuelline's.
BY_NAME_ONLY = ("convergence", "cost", "stages", "exchange", "fuel-stream", "loader-workers", "peers", "heap")
QUICK = {"rounds": 2, "batches": 20, "gb": 0.005}


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
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", nargs="?", choices=BENCHMARKS + BY_NAME_ONLY,
                        help="which one (default: all but convergence and cost)")
    # Two rounds at least: a single run's figure says nothing about its own noise.
    parser.add_argument("--rounds", type=_at_least(2), default=5, help="timed rounds per contender (default 5)")
    parser.add_argument("--batches", type=_at_least(2), default=400,
                        help="transport, fuel-stream, heap: 3 MB batches per round (default 400, about 1.2 GB)")
    parser.add_argument("--gb", type=_positive_float, default=1.0,
                        help="parquet: GB of in-memory numbers in the train split (default 1.0)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="parquet: where the dataset is generated and reused (default benchmarks/.data)")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where <name>.json, .md and .png are written (default benchmarks/results; "
                             "with --quick, a new temporary directory)")
    parser.add_argument("--before", metavar="REV", default=None,
                        help="windows, pipeline, stages, exchange, fuel-stream: also measure as commit REV serves (before and after, in one run)")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny sizes and {QUICK['rounds']} rounds: checks that every benchmark works")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["guard"]:  # (options of its own: python -m benchmarks guard --help)
        from benchmarks import guard

        return guard.main(argv[1:])
    if argv[:1] == ["first-batch"]:  # (likewise: python -m benchmarks first-batch --help)
        from benchmarks import first_batch

        return first_batch.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rounds, args.batches, args.gb = QUICK["rounds"], QUICK["batches"], QUICK["gb"]
    if args.results_dir is None:
        args.results_dir = Path(tempfile.mkdtemp(prefix="fuelline-bench-quick-")) if args.quick else RESULTS_DIR
    chosen = [args.benchmark] if args.benchmark else list(BENCHMARKS)
    started = time.perf_counter()
    for name in chosen:
        progress(f"== {name}{' (quick)' if args.quick else ''}")
        run_one(name, args)
    from benchmarks import plots

    for path in plots.summary(args.results_dir):
        print(f"wrote {path}", flush=True)
    progress(f"done in {time.perf_counter() - started:.0f}s; results in {args.results_dir}")
    return 0


def run_one(name: str, args: argparse.Namespace) -> None:
    from benchmarks import plots

    rounds, data, results, quick = args.rounds, args.data_dir, args.results_dir, args.quick
    if name == "transport":
        from benchmarks import transport

        transport.run(rounds, args.batches, results)
    elif name == "parquet":
        from benchmarks import parquet_path

        print(f"wrote {plots.for_record(parquet_path.run(rounds, args.gb, data, results), results)}", flush=True)
    elif name == "windows":
        from benchmarks import windows

        print(f"wrote {plots.for_record(windows.run(rounds, data, results, quick=quick, before=args.before), results)}", flush=True)
    elif name == "pipeline":
        from benchmarks import pipeline

        pipeline.run(rounds, data, results, quick=quick, before=args.before)
    elif name == "overlap":
        from benchmarks import overlap

        overlap.run(rounds, results, quick=quick)
    elif name == "scaling":
        from benchmarks import scaling

        scaling.run(rounds, data, results, quick=quick)
    elif name == "scaleout":
        from benchmarks import scaleout

        for record in scaleout.run(rounds, data, results, quick=quick):
            print(f"wrote {plots.for_record(record, results)}", flush=True)
    elif name == "trainer":
        from benchmarks import trainer

        print(f"wrote {plots.trainer(trainer.run(rounds, data, results, quick=quick), results)}", flush=True)
    elif name == "convergence":
        from benchmarks import convergence

        data.mkdir(parents=True, exist_ok=True)
        convergence.run(data, results, quick=quick)
    elif name == "cost":
        from benchmarks import cost

        cost.run(rounds, data, results, quick=quick)
    elif name == "exchange":
        from benchmarks import exchange

        if quick:
            exchange.run(rounds, args.before, sizes=(100_000,), worlds=(2,), step_params=200_000, reps=3,
                         results_dir=results)
        else:
            exchange.run(rounds, args.before, results_dir=results)
    elif name == "loader-workers":
        from benchmarks import loader_workers

        loader_workers.run(rounds, data, results)
    elif name == "fuel-stream":
        from benchmarks import fuel_stream

        fuel_stream.run(rounds, args.batches, results, before=args.before, quick=quick)
    elif name == "heap":
        from benchmarks import heap

        heap.run(rounds, args.batches, results)
    elif name == "peers":
        from benchmarks import peers

        peers.run(rounds, data, results, quick=quick)
    elif name == "stages":
        from benchmarks import stages

        stages.run(rounds, data, results, quick=quick, before=args.before)
    else:
        from benchmarks import compression

        compression.run(rounds, data, results, quick=quick)


if __name__ == "__main__":
    sys.exit(main())
