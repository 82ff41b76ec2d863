"""``fuelline inspect DATASET [--json]``: what a dataset holds and what a server would serve.

For a converted multimodal dataset: recordings per split and emotion, valid windows per class and
dropped windows per reason (for the given --window/--hop/--max-gap), bytes on disk, the
compression of the Parquet shards against the raw TSV, and the bytes of the master grids. For a plain Parquet dataset: splits, rows, files, row
groups, the columns served and those that are not.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["register", "describe"]


def describe(
    path: str, window: float = 2.0, hop: float = 1.0, max_gap: int = 2, cache_dir: str | None = None, cache_mb: int = 10240,
) -> dict[str, Any]:
    """Everything ``inspect`` prints, as plain data. ``path`` may be a URI (``s3://…``); a remote
    dataset's footers are read by range, and the one recording decoded to probe the served
    columns goes through the disk cache in ``cache_dir``."""
    from fuelline.server.multimodal.manifest import is_converted_dataset
    from fuelline.server.sources.storage import Store

    store = Store(path, cache_dir=cache_dir, cache_mb=cache_mb)
    disk = store.total_bytes()
    name = store.where()
    if is_converted_dataset(store):
        from fuelline.server.multimodal.source import WindowSource

        src = WindowSource(path, window=window, hop=hop, max_gap=max_gap, normalize="none", cache_dir=cache_dir, cache_mb=cache_mb)
        m = src.manifest
        places = [p for r in m.recordings for p in r.modalities.values()]
        shards = sum(store.stat(f).size for f in sorted({p.file for p in places}))
        grids = sum(store.stat(f).size for f in sorted({f for p in places for f in (p.grid_file, p.zgrid_file)}))
        return {
            "dataset": name,
            "kind": "multimodal",
            "window": {"length": window, "hop": hop, "max_gap": max_gap},
            "modalities": {k: {"rate": v.rate, "channels": len(v.channels)} for k, v in m.modalities.items()},
            "splits": {
                s: {
                    "recordings": len(m.split(s)),
                    "recordings_per_class": m.class_counts(s),
                    "windows": src.rows(s),
                    "windows_per_class": src.windows_per_class(s),
                    "dropped_windows": src.dropped(s),
                }
                for s in src.splits
            },
            "disk_bytes": disk,
            "source_bytes": m.source_bytes,
            "shard_bytes": shards,
            "grid_bytes": grids,
            # (the recordings as Parquet shards against the TSV; the grids are a copy for speed)
            "compression_ratio": round(m.source_bytes / shards, 2) if shards else None,
        }
    from fuelline.server.sources.parquet import ParquetSource

    src = ParquetSource(path, cache_dir=cache_dir, cache_mb=cache_mb)
    return {
        "dataset": name,
        "kind": "parquet",
        "sources": src.schema(),
        "not_served": dict(src.unservable),
        "splits": {s: {k: src.info(s)[k] for k in ("rows", "files", "row_groups")} for s in src.splits},
        "disk_bytes": disk,
    }


def _print(report: dict[str, Any]) -> None:
    print(f"{report['dataset']}: {report['kind']} dataset, {report['disk_bytes'] / 1e6:.1f} MB on disk")
    if report["kind"] == "multimodal":
        w = report["window"]
        print("  modalities: " + ", ".join(f"{k} {v['rate']} Hz × {v['channels']}" for k, v in report["modalities"].items()))
        print(f"  windows of {w['length']} s every {w['hop']} s, at most {w['max_gap']} missing samples in a row")
        for split, s in report["splits"].items():
            print(f"  {split}: {s['recordings']} recordings, {s['windows']} windows")
            for emotion, n in s["windows_per_class"].items():
                print(f"    {emotion:<10} {s['recordings_per_class'][emotion]:>5} recordings {n:>8} windows")
            for reason, n in s["dropped_windows"].items():
                print(f"    dropped: {reason}: {n}")
        ratio = report["compression_ratio"]
        if ratio:
            print(f"  raw TSV {report['source_bytes'] / 1e6:.1f} MB → Parquet shards {report['shard_bytes'] / 1e6:.1f} MB, "
                  f"compression {ratio}:1; master grids (raw and z-scored) {report['grid_bytes'] / 1e6:.1f} MB")
    else:
        for split, s in report["splits"].items():
            print(f"  {split}: {s['rows']} rows in {s['files']} files, {s['row_groups']} row groups")
        for name, spec in report["sources"].items():
            print(f"  source {name}: {spec['dtype']} {tuple(spec['shape'])}")
        for why in report["not_served"].values():
            print(f"  not served: {why}")


def run(args: argparse.Namespace) -> int:
    report = describe(args.dataset, args.window, args.hop, args.max_gap, args.cache_dir, args.cache_mb)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    return 0


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("inspect", help="what a dataset holds and what a server would serve")
    p.add_argument("dataset", help="a local path, or a URI such as s3://bucket/prefix")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--window", type=float, default=2.0, help="window length in seconds (multimodal)")
    p.add_argument("--hop", type=float, default=1.0, help="seconds between window starts (multimodal)")
    p.add_argument("--max-gap", type=int, default=2, help="most missing samples in a row (multimodal)")
    p.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="local copies of remote files (default: $XDG_CACHE_HOME/fuelline or ~/.cache/fuelline)")
    p.add_argument("--cache-mb", type=int, default=10240, help="most megabytes of files kept in --cache-dir")
    p.set_defaults(func=run)
