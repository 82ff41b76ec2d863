"""Ray Data: a local Ray cluster confined to loopback (``ray.init(_node_ip_address="127.0.0.1",
include_dashboard=False, num_cpus=2)``, shut down after), ``ray.data.read_parquet`` of the table's
files in a shuffled order (``shuffle="files"``), read with ``iter_torch_batches(batch_size=1024,
local_shuffle_buffer_size=--shuffle-rows)``: its local shuffle buffer, the cheaper of its two
shuffles (``random_shuffle`` moves every row through the object store).

Each epoch is another pass over the same dataset. For the windows, the columns are their sources:
a fixed-size list arrives as a [B, n] tensor and is reshaped (a view) to its source's shape. The cluster is started by this reader, so its
processes (GCS, raylet, workers) are in the tree the reader measures; time to first batch is taken
from ``ray.init`` and from the dataset's creation.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import readerlib


def main() -> int:
    p = readerlib.parser(__doc__)
    p.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="join this cluster (started by the benchmark across hosts) instead of starting one")
    p.add_argument("--node-ip", default="127.0.0.1", help="this host's address in that cluster")
    args = p.parse_args()
    try:
        import ray
        import torch

        with readerlib.ProcTree() as tree:
            server_started: float | None = None
            if args.address:
                ray.init(address=args.address, _node_ip_address=args.node_ip, log_to_driver=False,
                         configure_logging=False)
            else:
                server_started = time.perf_counter()
                ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2, log_to_driver=False,
                         configure_logging=False)
            try:
                ray.data.DataContext.get_current().enable_progress_bars = False
                started = time.perf_counter()
                files = sorted(str(p) for p in (Path(args.data) / "parquet").glob("*.parquet"))
                dataset = ray.data.read_parquet(files, shuffle="files")
                cols = readerlib.columns(args.data)

                def epoch(e: int) -> Any:
                    batches = dataset.iter_torch_batches(batch_size=args.batch_size,
                                                         local_shuffle_buffer_size=args.shuffle_rows,
                                                         local_shuffle_seed=args.seed * 1000 + e)
                    return (tuple(b[c.name].reshape(-1, *c.shape) if len(c.shape) > 1 else b[c.name] for c in cols)
                            for b in batches)

                result = readerlib.measure(tree, epoch, args, started, server_started)
                peak, names = tree.peak_rss_bytes(), tree.process_names()
            finally:
                ray.shutdown()
            readerlib.emit(result, tree, peak_rss_bytes=peak, processes=names,
                           versions={"ray": ray.__version__, "torch": torch.__version__})
        return 0
    except Exception as exc:
        return readerlib.fail(exc)


if __name__ == "__main__":
    raise SystemExit(main())
