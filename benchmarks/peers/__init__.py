"""``python -m benchmarks peers``: fuelline beside what a user would pick instead (a DataLoader over
pyarrow, Mosaic Streaming, LitData, Ray Data, tf.data service) on the same flat Parquet table.

- ``bench``: the run and its report (``benchmarks/results/peers.json``, ``.md``, ``.png``);
- ``contenders``: the peers and how a pass of one is run, as a child process;
- ``venvs``: each peer's own environment under ``benchmarks/.venvs/``, built on demand;
- ``dataset``: the table; ``plot``: the figure;
- ``readerlib`` and ``read_*.py``: the readers, one per peer, each run in its peer's environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

__all__ = ["run"]


def run(rounds: int, data_dir: Path, results_dir: Path | None = None, quick: bool = False,
        peers: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, write peers.json, .md and .png; returns the record."""
    from benchmarks.common import RESULTS_DIR
    from benchmarks.peers import bench, plot

    results_dir = RESULTS_DIR if results_dir is None else results_dir
    record = bench.run(rounds, data_dir, results_dir, quick=quick, peers=peers)
    print(f"wrote {plot.draw(record, results_dir)}", flush=True)
    return record
