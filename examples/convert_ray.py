"""``fuelline convert`` on a Ray cluster: one Ray task per part, then the finish.

    python examples/convert_ray.py RAW DATASET --parts 8 --address auto       # a running cluster
    python examples/convert_ray.py RAW DATASET --parts 2                      # a local Ray, started here

RAW and DATASET must be paths every node sees (a shared file system): each task converts its part
into DATASET.parts on the node Ray places it on, exactly as ``fuelline convert RAW DATASET --part
I/N`` would; a task that fails is retried by Ray, and a part already done is not converted again.
With ``--zscore``, a second wave of tasks writes each part's z-scored grids, so that the finish,
which runs here, only links files and writes the manifest. The dataset is the one a one-part
``fuelline convert RAW DATASET`` writes, file for file.

Needs ``pip install ray`` (fuelline's ``dev`` extra has it); a data server does not.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", metavar="RAW")
    parser.add_argument("dataset", metavar="DATASET")
    parser.add_argument("--parts", type=int, required=True, help="parts, one Ray task each")
    parser.add_argument("--address", default=None,
                        help="a running cluster (auto, or HOST:PORT); default: start a local Ray on loopback")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray (without --address)")
    parser.add_argument("--cpus-per-part", type=float, default=1, help="CPUs Ray reserves for each part's task")
    parser.add_argument("--zscore", action="store_true", help="write the z-scored grids in tasks too")
    parser.add_argument("--timeout", type=float, default=24 * 3600, help="seconds to wait for the tasks")
    parser.add_argument("--val-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recordings-per-shard", type=int, default=16)
    args = parser.parse_args(argv)
    options = {"val_fraction": args.val_fraction, "seed": args.seed, "recordings_per_shard": args.recordings_per_shard}

    import ray

    from fuelline.server.ingest.parts import convert_part, finish, zscore_part

    @ray.remote(max_retries=2)
    def part_task(part: int) -> dict[str, Any]:
        record = convert_part(args.raw, args.dataset, part, args.parts, progress=False, **options)
        return {k: record[k] for k in ("part", "recordings", "signal_bytes", "seconds", "skipped")}

    @ray.remote(max_retries=2)
    def zscore_task(part: int) -> float:
        return zscore_part(args.raw, args.dataset, part, args.parts, **options)["seconds"]

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        start = time.perf_counter()
        tasks = [part_task.options(num_cpus=args.cpus_per_part).remote(i) for i in range(args.parts)]
        for done in ray.get(tasks, timeout=args.timeout):
            rate = done["signal_bytes"] / 1e6 / done["seconds"] if done["seconds"] > 0 else 0.0
            state = "already there" if done["skipped"] else f"{rate:.1f} MB/s"
            print(f"part {done['part']}/{args.parts}: recordings {done['recordings'][0]}..{done['recordings'][1] - 1}, "
                  f"{done['signal_bytes'] / 1e6:.1f} MB of TSV, {done['seconds']:.2f}s ({state})", flush=True)
        if args.zscore:
            ray.get([zscore_task.options(num_cpus=args.cpus_per_part).remote(i) for i in range(args.parts)],
                    timeout=args.timeout)
        manifest = finish(args.raw, args.dataset, args.parts, **options)
        seconds = time.perf_counter() - start
        print(f"wrote {args.dataset}: {len(manifest.recordings)} recordings from {args.parts} parts, "
              f"{manifest.source_bytes / 1e6:.1f} MB of TSV in {seconds:.2f}s "
              f"({manifest.source_bytes / 1e6 / seconds:.1f} MB/s)")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
