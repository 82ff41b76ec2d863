"""``fuelline import SOURCE DATASET``: a table users have (CSV, Parquet, Arrow, a folder of them,
a Hugging Face dataset saved with ``save_to_disk``) written as a dataset a server serves well
(``fuelline.server.ingest.tables``)."""

from __future__ import annotations

import argparse
import time

from fuelline.protocol.common.argtypes import checked, positive_int

__all__ = ["register", "run"]


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "import", help="write a table (CSV, Parquet, Arrow, a saved Hugging Face dataset) as a dataset to serve",
        description="Write a table as a dataset `fuelline serve` serves well: list columns of one shape become "
                    "sources of that shape, --group gathers scalar columns into one, float64 becomes float32, "
                    "a string label becomes class indices, a sample_id column is made when there is none, rows "
                    "are shuffled once and split into train and val (unless SOURCE has split folders). "
                    "Atomic: nothing is left at DATASET unless it succeeded.",
    )
    p.add_argument("source", metavar="SOURCE",
                   help="a .csv, .parquet, .arrow or .feather file, or a folder of them (split subfolders such as "
                        "train/ and val/ are kept; a folder saved by datasets' save_to_disk is one)")
    p.add_argument("dataset", metavar="DATASET", help="folder to create; must not exist")
    p.add_argument("--label", default=None, metavar="COLUMN",
                   help="the class label: counted per class, stratifies the val split, strings become indices")
    p.add_argument("--group", action="append", default=[], metavar="NAME=COLUMNS[:SHAPE]",
                   help="gather scalar columns into one source: --group 'features=pixel_*' or "
                        "--group 'image=pixel_*:8x8' (glob patterns, comma-separated); repeatable")
    p.add_argument("--drop", action="append", default=[], metavar="COLUMN", help="a column not to write; repeatable")
    p.add_argument("--sample-id", default="sample_id", metavar="COLUMN",
                   help="the column of unique integer row ids; made when SOURCE has none")
    p.add_argument("--val-fraction", type=checked(float, lambda v: 0 <= v < 1, "in [0, 1)"), default=0.2,
                   help="share of rows in the val split, per class with --label (when SOURCE has no splits)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle and the split")
    p.add_argument("--no-shuffle", action="store_true", help="keep the rows in SOURCE's order")
    p.add_argument("--float64", action="store_true", help="keep float64 columns (default: float32)")
    p.add_argument("--rows-per-group", type=positive_int, default=None,
                   help="rows per Parquet row group (default: about 2 MB of rows, at least 8 groups where there "
                        "are rows enough)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fuelline.protocol import DataError, OptionError
    from fuelline.server.ingest.tables import write_dataset

    start = time.perf_counter()
    try:
        summary = write_dataset(args.source, args.dataset, label=args.label, sample_id=args.sample_id,
                                group=args.group, drop=args.drop, val_fraction=args.val_fraction, seed=args.seed,
                                shuffle=not args.no_shuffle, float64=args.float64, rows_per_group=args.rows_per_group)
    except OptionError as exc:  # (the library names the argument; here the flag)
        raise DataError(f"--{exc.option.replace('_', '-')} {exc.rule}") from None
    lines = summary.lines()
    lines[0] += f" in {time.perf_counter() - start:.2f}s"
    print("\n".join(lines))
    print(f"serve it with: fuelline serve {args.dataset}")
    return 0
