"""``fuelline synth``, ``fuelline convert`` and ``fuelline upgrade``: the ingest writers on the command line."""

from __future__ import annotations

import argparse
import math
import os
import time

from fuelline.protocol import DataError, OptionError
from fuelline.protocol.common.argtypes import checked, fraction, positive_int
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.server.multimodal.manifest import Manifest

__all__ = ["register", "register_synth", "register_convert", "register_upgrade", "run_synth", "run_convert", "run_upgrade", "summary", "part_of"]


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``synth``, ``convert`` and ``upgrade``; each sets ``func`` (args -> exit status) as its default."""
    register_synth(sub)
    register_convert(sub)
    register_upgrade(sub)


def register_upgrade(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``fuelline upgrade DATASET``."""
    p = sub.add_parser(
        "upgrade", help="bring a dataset converted by an earlier version to the current format, in place",
        description="Bring a dataset converted by an earlier version to the current format, in place: add the "
                    "master grids servers cut windows from, beside the Parquet shards, which stay as they are. "
                    "The new manifest replaces the old one by an atomic rename, the only moment the dataset "
                    "changes; an upgrade that fails leaves the dataset as it was.",
    )
    p.add_argument("dataset", metavar="DATASET", help="a local converted dataset (the folder with manifest.json)")
    p.set_defaults(func=run_upgrade)


def run_upgrade(args: argparse.Namespace) -> int:
    from fuelline.server.ingest.upgrade import upgrade

    start = time.perf_counter()
    manifest, was = upgrade(args.dataset)
    if was == manifest.format:
        print(f"{args.dataset} is already {manifest.format}; nothing to do")
    else:
        print(f"upgraded {args.dataset} from {was} to {manifest.format} in {time.perf_counter() - start:.1f}s: "
              f"{len(manifest.recordings)} recordings, {manifest.dataset_bytes / 1e6:.1f} MB")
    return 0


def register_synth(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``fuelline synth OUT --recordings N --seconds S --seed K [...]``."""
    p = sub.add_parser("synth", help="write synthetic AMIGOS-like raw recordings",
                       description="Write synthetic AMIGOS-like raw recordings (the input of `fuelline convert`).")
    p.add_argument("out", help="folder to create; must not exist")
    p.add_argument("--recordings", required=True, type=checked(int, lambda v: v >= 1, ">= 1"),
                   help="recordings to write (participants × videos)")
    p.add_argument("--seconds", required=True, type=checked(float, lambda v: 0 < v < math.inf, "> 0 and finite"),
                   help="length of each recording")
    p.add_argument("--seed", required=True, type=int, help="the same seed writes the same files")
    p.add_argument("--video-dim", type=checked(int, lambda v: v >= 1, ">= 1"), default=136,
                   help="video features per frame")
    p.add_argument("--drop", type=checked(float, lambda v: 0 <= v < 0.5, "in [0, 0.5)"), default=0.002,
                   help="probability of a dropped sample (a run of 3-20 starts 20 times less often)")
    p.add_argument("--jitter-ms", type=checked(float, lambda v: 0 <= v < math.inf, ">= 0 and finite"),
                   default=0.3, help="timestamp jitter, standard deviation in ms")
    p.add_argument("--probe", action="store_true", help="channel 0 of every modality holds the true master time")
    p.set_defaults(func=run_synth)


def run_synth(args: argparse.Namespace) -> int:
    summary = synthesize(args.out, args.recordings, args.seconds, args.seed, video_dim=args.video_dim,
                         drop=args.drop, jitter_ms=args.jitter_ms, probe=args.probe)
    emotions = ", ".join(f"{e} {c}" for e, c in summary["emotions"].items())
    rows = ", ".join(f"{m} {r}" for m, r in summary["rows"].items())
    print(f"wrote {args.out}: {summary['recordings']} recordings ({emotions}); rows {rows}; "
          f"{summary['bytes'] / 1e6:.1f} MB", flush=True)
    return 0


def register_convert(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = sub.add_parser(
        "convert", help="convert raw TSV recordings to a Parquet dataset",
        description="Convert raw TSV recordings (RAW_FORMAT.md) to a Parquet dataset with a manifest. "
                    "Atomic: nothing is left at DATASET unless the conversion succeeded.",
    )
    parser.add_argument("raw", metavar="RAW", help="folder with recordings.tsv, clocks.tsv and one folder per recording")
    parser.add_argument("dataset", metavar="DATASET", help="folder to create; must not exist")
    parser.add_argument("--val-fraction", type=fraction, default=0.2,
                        help="share of each emotion's recordings in the val split")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    parser.add_argument("--recordings-per-shard", type=positive_int, default=16,
                        help="recordings per Parquet file")
    # Converting in parts, on many hosts sharing a file system (fuelline.server.ingest.parts).
    steps = parser.add_mutually_exclusive_group()
    steps.add_argument("--part", type=part_of, metavar="I/N",
                       help="convert only part I of N (0 <= I < N, split on shard boundaries) into DATASET.parts; "
                            "run every part with the same options, then --finish N")
    steps.add_argument("--zscore-part", type=part_of, metavar="I/N",
                       help="optional, once every part is there: write part I's z-scored grids, so that --finish "
                            "does not write them all on one host")
    steps.add_argument("--finish", type=positive_int, metavar="N",
                       help="check the N parts in DATASET.parts and make DATASET of them (atomic), then remove "
                            "DATASET.parts")
    parser.set_defaults(func=run_convert)


def part_of(text: str) -> tuple[int, int]:
    """``I/N``: part I of N, 0 <= I < N."""
    index, slash, count = text.partition("/")
    if not (slash and index.strip().isdigit() and count.strip().isdigit()):
        raise argparse.ArgumentTypeError(f"must be I/N (part I of N), got {text!r}")
    part, parts = int(index), int(count)
    if not 0 <= part < parts:
        raise argparse.ArgumentTypeError(f"must be I/N with 0 <= I < N, got {text}")
    return part, parts


def summary(manifest: Manifest, dataset: str, seconds: float, parts: int | None = None) -> str:
    """What ``fuelline convert`` prints: counts, sizes, speed and the compression ratio; with
    ``parts``, what ``--finish`` prints (its seconds are the finish's, which reads no TSV)."""
    per_split = ", ".join(f"{s} {len(manifest.split(s))}" for s in manifest.splits)
    rows = ", ".join(
        f"{m} {sum(r.modalities[m].rows for r in manifest.recordings)}" for m in manifest.modalities
    )
    source_mb, dataset_mb = manifest.source_bytes / 1e6, manifest.dataset_bytes / 1e6
    rate = source_mb / seconds if seconds > 0 else float("inf")
    places = [p for r in manifest.recordings for p in r.modalities.values()]
    shards = sum(os.path.getsize(os.path.join(dataset, f)) for f in sorted({p.file for p in places}))
    grids = sum(os.path.getsize(os.path.join(dataset, f)) for f in sorted({f for p in places for f in (p.grid_file, p.zgrid_file)}))
    read = (f"read {source_mb:.1f} MB of TSV in {seconds:.2f}s ({rate:.1f} MB/s)" if parts is None else
            f"made of {parts} parts of {source_mb:.1f} MB of TSV in {seconds:.2f}s")
    return (
        f"wrote {dataset}: {len(manifest.recordings)} recordings ({per_split})\n"
        f"rows: {rows}\n"
        f"{read}, "
        f"wrote {dataset_mb:.1f} MB: Parquet shards {shards / 1e6:.1f} MB (compression {manifest.source_bytes / shards:.1f}:1) "
        f"and master grids, raw and z-scored, {grids / 1e6:.1f} MB"
    )


def run_convert(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    options = {"val_fraction": args.val_fraction, "seed": args.seed, "recordings_per_shard": args.recordings_per_shard}
    try:
        if getattr(args, "part", None) is not None:
            print(_converted_part(args, options))
            return 0
        if getattr(args, "zscore_part", None) is not None:
            print(_zscored_part(args, options))
            return 0
        if getattr(args, "finish", None) is not None:
            from fuelline.server.ingest.parts import finish

            manifest = finish(args.raw, args.dataset, args.finish, **options)
            print(summary(manifest, args.dataset, time.perf_counter() - start, parts=args.finish))
            return 0
        manifest = convert(args.raw, args.dataset, **options)
    except OptionError as exc:  # (the library names the argument; here the flag)
        raise DataError(f"--{exc.option.replace('_', '-')} {exc.rule}") from None
    print(summary(manifest, args.dataset, time.perf_counter() - start))
    return 0


def _converted_part(args: argparse.Namespace, options: dict) -> str:
    from fuelline.server.ingest.parts import convert_part, part_folder

    part, parts = args.part
    record = convert_part(args.raw, args.dataset, part, parts, **options)
    where = part_folder(args.dataset, part, parts)
    if record["skipped"]:
        return f"part {part}/{parts} of {args.dataset} is already in {where}, made from the same recordings and options"
    (first, stop), (shard, shard_stop) = record["recordings"], record["shards"]
    mb, seconds = record["signal_bytes"] / 1e6, record["seconds"]
    rate = mb / seconds if seconds > 0 else float("inf")
    return (f"wrote part {part}/{parts} of {args.dataset} in {where}: recordings {first}..{stop - 1} "
            f"(shards {shard}..{shard_stop - 1}); read {mb:.1f} MB of TSV in {seconds:.2f}s ({rate:.1f} MB/s)"
            if stop > first else
            f"wrote part {part}/{parts} of {args.dataset} in {where}: no recordings (fewer shards than parts)")


def _zscored_part(args: argparse.Namespace, options: dict) -> str:
    from fuelline.server.ingest.parts import part_folder, zscore_part

    part, parts = args.zscore_part
    record = zscore_part(args.raw, args.dataset, part, parts, **options)
    where = part_folder(args.dataset, part, parts)
    if record["skipped"]:
        return f"the z-scored grids of part {part}/{parts} are already in {where}"
    return (f"wrote the z-scored grids of part {part}/{parts} in {where}: {len(record['files'])} files, "
            f"{sum(record['files'].values()) / 1e6:.1f} MB in {record['seconds']:.2f}s")
