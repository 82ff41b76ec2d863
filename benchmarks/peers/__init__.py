"""``python -m benchmarks peers``: fuelline beside what a user would pick instead (a DataLoader over
pyarrow, Mosaic Streaming, LitData, Ray Data, tf.data service) on the same flat Parquet table, and
on time-aligned multimodal windows (which fuelline aligns as it serves them, and the others read
materialised).

- ``bench``: the run and its reports (``benchmarks/results/peers.json``, ``.md``, ``.png`` for the
  table; ``peers-windows.json``, ``.md``, ``.png`` for the windows);
- ``contenders``: the peers and how a pass of one is run, as a child process;
- ``venvs``: each peer's own environment under ``benchmarks/.venvs/``, built on demand;
- ``dataset``: the table; ``windows_data``: the windows, and their materialised copy; ``plot``: the figure;
- ``readerlib`` and ``read_*.py``: the readers, one per peer, each run in its peer's environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

__all__ = ["run"]


def run(rounds: int, data_dir: Path, results_dir: Path | None = None, quick: bool = False,
        peers: Sequence[str] | None = None, workloads: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark on ``workloads`` ("table", "windows"; default: both, or in quick mode the
    table only), write each one's .json, .md and .png; returns the records by workload."""
    from benchmarks.common import RESULTS_DIR
    from benchmarks.peers import bench, plot

    results_dir = RESULTS_DIR if results_dir is None else results_dir
    if workloads is None:
        workloads = ("table",) if quick else bench.WORKLOADS
    records = bench.run(rounds, data_dir, results_dir, quick=quick, peers=peers, workloads=workloads)
    for record in records.values():
        print(f"wrote {plot.draw(record, results_dir, name=record['benchmark'])}", flush=True)
    return records
