"""``fuelline inspect DATASET [--json]``: what a dataset holds and what a server would serve.

For a converted multimodal dataset: recordings per split and emotion, valid windows per class and
dropped windows per reason (for the given --window/--hop/--max-gap), bytes on disk and the
compression ratio against the raw TSV. For a plain Parquet dataset: splits, rows, files, row
groups, the columns served and those that are not.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

__all__ = ["register", "describe"]


def _disk_bytes(root: str) -> int:
    if os.path.isfile(root):
        return os.path.getsize(root)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def describe(path: str, window: float = 2.0, hop: float = 1.0, max_gap: int = 2) -> dict[str, Any]:
    """Everything ``inspect`` prints, as plain data."""
    from fuelline.server.ingest.manifest import is_converted_dataset

    disk = _disk_bytes(path) if os.path.exists(path) else 0
    if is_converted_dataset(path):
        from fuelline.server.windows.source import WindowSource

        src = WindowSource(path, window=window, hop=hop, max_gap=max_gap, normalize="none")
        m = src.manifest
        return {
            "dataset": path,
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
            "compression_ratio": round(m.source_bytes / disk, 2) if disk else None,
        }
    from fuelline.server.parquet_source import ParquetSource

    src = ParquetSource(path)
    return {
        "dataset": path,
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
        print(f"  raw TSV {report['source_bytes'] / 1e6:.1f} MB, compression {ratio}:1" if ratio else "")
    else:
        for split, s in report["splits"].items():
            print(f"  {split}: {s['rows']} rows in {s['files']} files, {s['row_groups']} row groups")
        for name, spec in report["sources"].items():
            print(f"  source {name}: {spec['dtype']} {tuple(spec['shape'])}")
        for name, why in report["not_served"].items():
            print(f"  not served: {why}")


def run(args: argparse.Namespace) -> int:
    report = describe(args.dataset, args.window, args.hop, args.max_gap)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    return 0


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("inspect", help="what a dataset holds and what a server would serve")
    p.add_argument("dataset")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--window", type=float, default=2.0, help="window length in seconds (multimodal)")
    p.add_argument("--hop", type=float, default=1.0, help="seconds between window starts (multimodal)")
    p.add_argument("--max-gap", type=int, default=2, help="most missing samples in a row (multimodal)")
    p.set_defaults(func=run)
