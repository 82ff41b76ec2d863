"""``fuelline stream HOST:PORT``: read epochs from data servers and report what arrived and how
fast. The client's command: it imports only the client and the protocol."""

from __future__ import annotations

import argparse
import json
import time

from fuelline.protocol.common.argtypes import positive_int, seconds

__all__ = ["register", "run"]


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    stream = sub.add_parser("stream", help="read epochs from a server and report throughput")
    stream.add_argument("endpoint", metavar="HOST:PORT[,HOST:PORT...]",
                        help="a data server, or several serving the same dataset with the same options")
    stream.add_argument("--epochs", type=positive_int, default=1, help="epochs to read")
    stream.add_argument("--split", default="train", help="which split to read")
    stream.add_argument("--rank", type=int, default=0, help="read this rank's share")
    stream.add_argument("--world-size", type=positive_int, default=1, help="of this many ranks")
    stream.add_argument("--hwm", type=positive_int, default=10, help="batches prefetched")
    stream.add_argument("--timeout", type=seconds, default=60.0, help="seconds to keep trying a silent server")
    stream.add_argument("--connect-timeout", type=seconds, default=10.0, metavar="SECONDS",
                        help="seconds to keep trying a server that refuses the connection (nothing listens at "
                             "the port) before it first answers; a server that answered once gets --timeout")
    stream.add_argument("--json", action="store_true", help="print one JSON object per epoch")
    stream.add_argument("--curve-keys", default=None, metavar="DIR",
                        help="connect with CURVE: DIR holds client.key_secret and the server's server.key")
    stream.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from fuelline.client import ServerDataStream

    with ServerDataStream(
        endpoints=args.endpoint, split=args.split, rank=args.rank, world_size=args.world_size,
        hwm=args.hwm, timeout=args.timeout, connect_timeout=args.connect_timeout, curve_keys=args.curve_keys,
    ) as stream:
        for epoch in range(args.epochs):
            batches = rows = nbytes = 0
            ids: list = []
            start = time.perf_counter()
            for batch in stream.get_epoch_iterator(as_dict=True):
                batches += 1
                first = next(iter(batch.values()))
                rows += len(first) if first.ndim else 1
                nbytes += sum(a.nbytes for a in batch.values())
                if "sample_id" in batch:
                    ids.append(batch["sample_id"])
            seconds = time.perf_counter() - start
            report = {
                "epoch": epoch,
                "batches": batches,
                "rows": rows,
                "bytes": nbytes,
                "seconds": round(seconds, 4),
                "rows_per_s": round(rows / seconds, 1) if seconds else None,
                "mb_per_s": round(nbytes / seconds / 1e6, 1) if seconds else None,
                "sources": {k: v for k, v in stream.schema.items()},
            }
            if ids:
                all_ids = np.concatenate(ids)
                report["unique_sample_ids"] = int(len(np.unique(all_ids)))
            if args.json:
                print(json.dumps(report), flush=True)
            else:
                print(
                    f"epoch {epoch}: {batches} batches, {rows} rows, {nbytes / 1e6:.1f} MB in {seconds:.2f}s "
                    f"({report['rows_per_s']} rows/s, {report['mb_per_s']} MB/s)"
                    + (f", {report['unique_sample_ids']} distinct sample_ids" if ids else ""),
                    flush=True,
                )
    return 0
