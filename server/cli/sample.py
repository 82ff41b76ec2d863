"""``fuelline sample OUT``: write the built-in sample Parquet dataset."""

from __future__ import annotations

import argparse

from fuelline.protocol.common.argtypes import positive_int

__all__ = ["register", "run"]


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    sample = sub.add_parser("sample", help="write the built-in sample Parquet dataset")
    sample.add_argument("out", help="folder to write (train/ and val/ Parquet files)")
    sample.add_argument("--rows", type=positive_int, default=10_000, help="rows in all, four fifths of them train")
    sample.add_argument("--dim", type=positive_int, default=16, help="length of the features vector")
    sample.add_argument("--files", type=positive_int, default=4, help="Parquet files per split")
    sample.add_argument("--row-group-rows", type=positive_int, default=1_000, help="rows per row group")
    sample.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fuelline.server.sources.sample import write_sample_dataset

    counts = write_sample_dataset(args.out, rows=args.rows, dim=args.dim, files=args.files, row_group_rows=args.row_group_rows)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v} rows" for k, v in counts.items()))
    return 0
