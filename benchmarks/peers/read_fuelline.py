"""fuelline: ``fuelline serve`` on the Parquet table, in its default setup (shuffled, blocks of 8
row groups, decoded row groups kept, a client on the host moved to the Unix socket and shared
memory; ``--shuffle-block N`` mixes N row groups instead), read by ``ServerDataStream(tensors=True)``
in this process, which has imported torch before the timing starts, as a trainer has.

With ``--dataset DIR`` it serves that converted multimodal dataset instead (``fuelline convert``'s
output): windows aligned by the server as they are served, blocks of 8 recordings, every source
the data folder's ``columns.json`` lists; ``--decoded-cache-mb 0`` aligns every epoch anew.

The server is started by this reader, as its child, so that its CPU and memory are in the tree the
reader measures; time to first batch is taken both from the server's start and from the stream's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import readerlib
import torch  # as a trainer has it already: tensors=True would import it at the stream's construction

from benchmarks.common import ServerProcess
from fuelline.client import ServerDataStream

HWM = 10


def _read(tree: readerlib.ProcTree, args: Any, host: str, port: int, server_started: float | None) -> dict[str, Any]:
    started = time.perf_counter()
    sources = tuple(c.name for c in readerlib.columns(args.data))
    with ServerDataStream(sources, host=host, port=port, hwm=HWM, timeout=args.timeout,
                          tensors=True) as stream:

        def epoch(e: int) -> Any:
            return stream.get_epoch_iterator()

        return readerlib.measure(tree, epoch, args, started, server_started)


def main() -> int:
    p = readerlib.parser(__doc__)
    p.add_argument("--shuffle-block", type=int, default=None, help="the server's --shuffle-block (default: its own)")
    p.add_argument("--decoded-cache-mb", type=int, default=None, help="the server's --decoded-cache-mb (default: its own)")
    p.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="read from this server (started by the benchmark on another host) instead of starting one")
    args = p.parse_args()
    try:
        with readerlib.ProcTree() as tree:
            if args.server:
                host, port = args.server.rsplit(":", 1)
                result = _read(tree, args, host, int(port), None)
                readerlib.emit(result, tree, versions={"torch": torch.__version__})
                return 0
            server_started = time.perf_counter()
            served = args.dataset or str(Path(args.data) / "parquet")
            argv = [sys.executable, "-m", "fuelline.server.cli", "serve", served,
                    "--port", "0", "--batch-size", str(args.batch_size), "--hwm", str(HWM), "--seed", str(args.seed),
                    "--status-interval", "0"]
            if args.shuffle_block is not None:
                argv += ["--shuffle-block", str(args.shuffle_block)]
            if args.decoded_cache_mb is not None:
                argv += ["--decoded-cache-mb", str(args.decoded_cache_mb)]
            log = Path(args.data) / "logs" / f"fuelline-serve-{args.seed}.log"
            with ServerProcess("fuelline serve", argv, log, ready_timeout=args.timeout) as server:
                result = _read(tree, args, server.host, server.port, server_started)
                # The tree's memory and processes before the server is stopped.
                peak, names = tree.peak_rss_bytes(), tree.process_names()
            readerlib.emit(result, tree, server_exit=server.exit_status, peak_rss_bytes=peak, processes=names,
                           versions={"torch": torch.__version__})
        return 0
    except Exception as exc:
        return readerlib.fail(exc)


if __name__ == "__main__":
    raise SystemExit(main())
