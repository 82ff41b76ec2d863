"""``python -m benchmarks.peers [--quick] [--rounds N] [--workload table|windows|both] [--peers KEYS]
[--bed]``: the peers benchmark with its own options (``python -m benchmarks peers`` runs it with the
common ones: both workloads). ``--bed`` runs
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
from benchmarks.peers.contenders import PEERS, WINDOWS_PEERS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per contender (default 3, at least 2)")
    parser.add_argument("--quick", action="store_true",
                        help="a 20,000-row table and 2 rounds, with the peers whose environments are already built "
                             "(a check, not a measurement)")
    parser.add_argument("--workload", choices=("table", "windows", "both"), default=None,
                        help="the flat table (peers.*), multimodal windows (peers-windows.*) or both, one after the "
                             "other (default both; with --quick, the table: windows with a 10-recording dataset "
                             "when named)")
    keys = dict.fromkeys(p.key for p in (*PEERS, *WINDOWS_PEERS))
    parser.add_argument("--peers", default="", help="comma-separated, of: " + ", ".join(keys)
                        + " (default all of the workload's; fuelline always; fuelline-block80 is the table's, "
                          "fuelline-decode and fuelline-all the windows')")
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
    chosen = [k for k in args.peers.split(",") if k] or None
    workloads = None if args.workload is None else ("table", "windows") if args.workload == "both" else (args.workload,)
    if args.bed:
        if workloads not in (None, ("table",)):
            parser.error("--bed runs the table workload only")
        from benchmarks.peers import across_hosts, plot

        record = across_hosts.run(args.rounds, args.data_dir, results, quick=args.quick, peers=chosen)
        print(f"wrote {plot.draw(record, results, name='peers-bed')}", flush=True)
        return 0
    run(args.rounds, args.data_dir, results, quick=args.quick, peers=chosen, workloads=workloads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
