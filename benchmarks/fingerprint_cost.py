"""``python -m benchmarks.fingerprint_cost``: what the sequence fingerprint costs a Parquet server at
start-up, before and after it was taken from what the files hold (their footers) rather than from
their names, sizes and modification times.

Data: N small Parquet files in one folder (1,000 and 10,000 by default; each 64 rows of an int64
id and a float32 feature in one row group, uncompressed, as another tool might write them),
written once per N.

Per N and round, each revision in a process of its own, its imports done before the clock starts:

- start-up: ``ParquetSource(DATASET)``: list the files, read and parse every footer, take the
  fingerprint of every split: what a ``fuelline serve`` waits for before it accepts clients;
- fingerprint: ``_fingerprint`` of the split, run again on the source just built: the step alone
  (before: a stat of every file for its size and mtime; after: a digest of the sizes and footer
  digests the scan took, which reads nothing).

Revisions take turns (before, after, before, after …) so that a noisy neighbour slows both; medians
over the rounds, after one untimed round that leaves every file in the page cache: what is timed is
the work, not the disk. The revision before is ``--before REV`` (a git worktree of REV, as
``benchmarks.windows`` makes one) or ``--before-tree DIR`` (a checkout already on disk, holding
``protocol/``, ``server/`` …); without either, only this tree is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import DEFAULT_DATA_DIR, RESULTS_DIR, ROOT, SourceTree, progress
from benchmarks.report import environment, write_results

__all__ = ["run", "main"]

NAME = "fingerprint_cost"
SHARDS = (1_000, 10_000)
ROWS = 64
DATA_FORMAT = 1  # bump when the files written change
TIMEOUT_S = 600.0

# Run in a process of its own per revision and round: the source's construction and the
# fingerprint step, timed after the imports.
PROBE = """
import json, sys, time
import fuelline.server.sources.parquet as parquet
started = time.perf_counter()
source = parquet.ParquetSource(sys.argv[1])
built = time.perf_counter()
split = source._splits["train"]
again = time.perf_counter()
fingerprint = source._fingerprint(split)
done = time.perf_counter()
print(json.dumps({"startup_s": built - started, "fingerprint_s": done - again, "files": len(split.files),
                  "parts": sorted(fingerprint), "module": parquet.__file__}))
"""


def ensure_shards(data_dir: Path, n: int) -> Path:
    """``n`` small Parquet files under ``data_dir``, written once (reused by later runs)."""
    folder = data_dir / f"fingerprint-{n}-v{DATA_FORMAT}"
    if (folder / "complete").exists():
        return folder
    progress(f"writing {n:,} Parquet files to {folder}")
    (folder / "train").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        ids = np.arange(i * ROWS, (i + 1) * ROWS, dtype=np.int64)
        table = pa.table({"sample_id": ids, "x": (ids / 10).astype(np.float32)})
        pq.write_table(table, folder / "train" / f"part-{i:05d}.parquet", compression="none")
    (folder / "complete").write_text("")
    return folder


def probe(dataset: Path, pythonpath: str | None) -> dict[str, Any]:
    """One timed start-up of a revision (``pythonpath`` first on the path; None: this tree)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", PROBE, str(dataset)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"the probe exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def links_tree(checkout: Path, parent: Path) -> str:
    """A folder importable as ``fuelline`` from ``checkout``'s folders (as ``SourceTree`` makes
    one): the folders are mapped into the namespace by setup.cfg, not nested under fuelline/."""
    root = parent / "before-root"
    (root / "fuelline").mkdir(parents=True)
    for folder in ("protocol", "client", "server", "trainer"):
        (root / "fuelline" / folder).symlink_to(checkout.resolve() / folder)
    return str(root)


def run(rounds: int, shards: Sequence[int], data_dir: Path, results_dir: Path = RESULTS_DIR,
        before: str | None = None, before_tree: Path | None = None) -> dict[str, Any]:
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-", dir=data_dir) as work, ExitStack() as stack:
        revisions: dict[str, str | None] = {}
        if before is not None:
            revisions[f"before ({before})"] = stack.enter_context(SourceTree(before, Path(work))).pythonpath
        elif before_tree is not None:
            revisions[f"before ({before_tree})"] = links_tree(before_tree, Path(work))
        revisions["after (this tree)"] = None
        figures: dict[str, dict[str, Any]] = {}
        for n in shards:
            dataset = ensure_shards(data_dir, n)
            for pythonpath in revisions.values():  # untimed: imports compiled, files in the page cache
                probe(dataset, pythonpath)
            taken: dict[str, list[dict[str, Any]]] = {name: [] for name in revisions}
            for r in range(rounds):
                for name, pythonpath in revisions.items():
                    got = probe(dataset, pythonpath)
                    taken[name].append(got)
                    progress(f"{n:,} files, round {r + 1}/{rounds}, {name}: start-up {got['startup_s'] * 1e3:,.1f} ms, "
                             f"fingerprint {got['fingerprint_s'] * 1e3:,.2f} ms ({got['module']})")
            figures[str(n)] = {
                name: {
                    "startup_ms": statistics.median(t["startup_s"] for t in got) * 1e3,
                    "fingerprint_ms": statistics.median(t["fingerprint_s"] for t in got) * 1e3,
                    "startup_ms_all": [round(t["startup_s"] * 1e3, 2) for t in got],
                    "fingerprint_ms_all": [round(t["fingerprint_s"] * 1e3, 3) for t in got],
                    "parts": got[0]["parts"],
                }
                for name, got in taken.items()
            }
    record = {"name": NAME, "environment": environment(),
              "parameters": {"rounds": rounds, "shards": list(shards), "rows_per_file": ROWS, "before": before,
                             "before_tree": None if before_tree is None else str(before_tree)},
              "figures": figures}
    write_results(NAME, record, _markdown(record), results_dir)
    return record


def _markdown(record: dict[str, Any]) -> str:
    lines = ["## Fingerprint cost at start-up (Parquet)", "",
             f"Median of {record['parameters']['rounds']} rounds, revisions alternately, each in a process of its own.",
             "", "| files | revision | start-up ms | fingerprint step ms | parts |", "|---:|---|---:|---:|---|"]
    for n, by_revision in record["figures"].items():
        for name, f in by_revision.items():
            lines.append(f"| {int(n):,} | {name} | {f['startup_ms']:,.1f} | {f['fingerprint_ms']:,.2f} | "
                         f"{', '.join(f['parts'])} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fingerprint_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per revision and size (default 5)")
    parser.add_argument("--shards", type=int, nargs="+", default=list(SHARDS),
                        help="numbers of files to time (default 1000 10000)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where the files are written and reused")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--before", metavar="REV", help="the revision to compare with (a git worktree of it)")
    which.add_argument("--before-tree", metavar="DIR", type=Path,
                       help="a checkout of the revision to compare with, already on disk")
    args = parser.parse_args(argv)
    if args.rounds < 1 or any(n < 1 for n in args.shards):
        parser.error("--rounds and every --shards value must be >= 1")
    if args.before_tree is not None and not (args.before_tree / "server").is_dir():
        parser.error(f"--before-tree {args.before_tree}: no server/ folder there; give a checkout of the project")
    record = run(args.rounds, args.shards, args.data_dir, args.results_dir, args.before, args.before_tree)
    print(_markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
