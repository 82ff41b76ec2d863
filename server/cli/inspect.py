"""``fuelline inspect DATASET [--json]``: what a dataset holds and what a server would serve.

For a converted multimodal dataset: recordings per split and emotion, valid windows per class and
dropped windows per reason (for the given --window/--hop/--max-gap), bytes on disk, the
compression of the Parquet shards against the raw TSV, and the bytes of the master grids. For a plain Parquet dataset: splits, rows, files, row
groups, the label's classes where `fuelline import` recorded them, the columns served and those that
are not, and advice where what would be served is most likely not what was meant.
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

    table = ParquetSource(path, cache_dir=cache_dir, cache_mb=cache_mb)
    splits: dict[str, dict[str, Any]] = {}
    for s in table.splits:
        info = table.info(s)
        splits[s] = {k: info[k] for k in ("rows", "files", "row_groups", "max_row_group_bytes")}
        splits[s].update({k: info[k] for k in ("label", "class_names", "class_counts") if k in info})
    sources = {k: dict(v) for k, v in table.schema().items()}
    return {
        "dataset": name,
        "kind": "parquet",
        "sources": sources,
        "not_served": dict(table.unservable),
        "splits": splits,
        "disk_bytes": disk,
        "advice": advice(sources, dict(table.unservable), splits),
    }


SCALAR_SOURCES = 16  # more sources of one number each than this: advise a group


def advice(sources: dict[str, Any], not_served: dict[str, str], splits: dict[str, Any]) -> list[str]:
    """What a plain Parquet dataset would serve that a user most likely did not mean, each with
    the fix."""
    out = []
    index = [n for n in sources if n.startswith("__index_level_")]
    if index:
        out.append(f"{', '.join(index)} is pandas' index, served as a source: write the frame with "
                   "to_parquet(index=False), or with `fuelline import`")
    scalars = [n for n, spec in sources.items() if not spec["shape"] and n not in index and n != "sample_id"]
    if len(scalars) > SCALAR_SOURCES:
        out.append(f"{len(scalars)} sources of one number each ({', '.join(scalars[:3])}, …): a batch is as many "
                   "arrays; gather them into one with `fuelline import --group 'features=PATTERN'`")
    if not_served:
        out.append(f"{len(not_served)} column(s) not served ({', '.join(not_served)}): `fuelline import` makes lists "
                   "of one length into sources of that shape, and names what cannot be")
    if "sample_id" not in sources:
        out.append("no sample_id column: the trainer drops a split's wrap-padding by sample_id, and `fuelline "
                   "stream` counts by it; `fuelline import` makes one")
    if "train" in splits and "val" not in splits:
        out.append("no val split: the trainer evaluates on val; `fuelline import --val-fraction` makes one")
    for split, s in splits.items():
        if s["max_row_group_bytes"] > 256 << 20:
            out.append(f"{split}: row groups of up to {s['max_row_group_bytes'] / 1e6:.0f} MB decoded; a reader holds "
                       "3 × --shuffle-block of them: rewrite with smaller row groups (`fuelline import`)")
        elif s["row_groups"] < 8 and s["rows"] >= 8 * 256:
            out.append(f"{split}: {s['row_groups']} row group(s); a server reads, shuffles and spreads work over "
                       "row groups: 8 or more shuffle better (`fuelline import`)")
    return out


def _dtype(spec: dict[str, Any]) -> str:
    import numpy as np

    shape = spec["shape"]
    return f"{np.dtype(spec['dtype']).name} [{', '.join(map(str, shape))}]" if shape else f"{np.dtype(spec['dtype']).name}"


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
            if "class_counts" in s:
                print(f"    {s['label']} per class: " + ", ".join(f"{c} {n}" for c, n in s["class_counts"].items()))
        for name, spec in report["sources"].items():
            print(f"  source {name}: {_dtype(spec)}")
        for why in report["not_served"].values():
            print(f"  not served: {why}")
        for line in report["advice"]:
            print(f"  advice: {line}")


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
