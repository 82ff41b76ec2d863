"""``python -m benchmarks.peers [--quick] [--rounds N] [--peers KEYS] [--bed]``: the peers benchmark
with its own options (``python -m benchmarks peers`` runs it with the common ones). ``--bed`` runs
the peers that serve from another host across two hosts of a bed instead (root only; after a run
without it has built the environments and copies): ``peers-bed.json``, ``.md`` and ``.png``."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from benchmarks.common import DEFAULT_DATA_DIR, RESULTS_DIR
from benchmarks.peers import run
from benchmarks.peers.contenders import PEERS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per contender (default 3, at least 2)")
    parser.add_argument("--quick", action="store_true",
                        help="a 20,000-row table and 2 rounds, with the peers whose environments are already built "
                             "(a check, not a measurement)")
    parser.add_argument("--peers", default="", help="comma-separated, of: " + ", ".join(p.key for p in PEERS)
                        + " (default all; fuelline always)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where the table is made and reused")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where peers.json/.md/.png go (default benchmarks/results; with --quick, a new temporary directory)")
    parser.add_argument("--bed", action="store_true",
                        help="fuelline, tf.data service and Ray across two hosts of a bed (root only)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 2
    if args.rounds < 2:
        parser.error("--rounds must be >= 2")
    results = args.results_dir or (Path(tempfile.mkdtemp(prefix="fuelline-bench-peers-")) if args.quick else RESULTS_DIR)
    keys = [k for k in args.peers.split(",") if k] or None
    if args.bed:
        from benchmarks.peers import across_hosts, plot

        record = across_hosts.run(args.rounds, args.data_dir, results, quick=args.quick, peers=keys)
        print(f"wrote {plot.draw(record, results, name='peers-bed')}", flush=True)
        return 0
    run(args.rounds, args.data_dir, results, quick=args.quick, peers=keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
