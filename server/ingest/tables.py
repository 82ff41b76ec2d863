"""``write_dataset`` and ``fuelline import``: what users have, written as a dataset a server serves well.

From a pandas DataFrame, a dict of numpy arrays, a pyarrow Table, a Hugging Face ``datasets``
Dataset or DatasetDict, or files (CSV, Parquet, Arrow/Feather, a folder of them, a folder saved by
``Dataset.save_to_disk``), this writes a folder of Parquet files that ``fuelline serve`` serves
with every column a source of a fixed shape:

- list columns whose rows all hold the same number of values (nested lists: the same shape)
  become fixed-size lists, a ``[n]`` (or ``[n, m]``…) source; a list of another length in one row
  is an error naming the column and the row;
- ``group`` gathers scalar columns into one source (the 64 pixel columns of a digits frame into
  one ``features`` source of shape [64], or [8, 8]); the columns are cast to one dtype;
- float64 becomes float32 (what a model takes) unless ``float64=True``;
- the label column (``label=``), if it holds strings or categories, becomes int64 class indices,
  the class names in sorted order; its classes and counts go into each file's metadata, where the
  server reads them (``class_names``, ``class_counts`` in a split's info);
- a ``sample_id`` column (int64, unique) is made when there is none: the row's position in the
  input, before any shuffle; given, it is checked to be unique integers;
- pandas' index columns (``__index_level_0__``…) are dropped; any other column that is not numbers
  (strings, dates, structs) is an error naming it, unless ``drop`` names it;
- rows are shuffled once (seeded), so that a server's block shuffle, which mixes the rows of a few
  row groups at a time, mixes rows from the whole dataset even where the input is sorted (by
  class, by time); row groups are sized for the block reader (about ``ROW_GROUP_BYTES`` each);
- splits: a DatasetDict, a dict of such inputs or a folder of ``train/``, ``val/`` (``validation``
  is named ``val``) … keeps its splits; one input is split in two by ``val_fraction`` (seeded,
  stratified by label when there is one).

The whole input is read into memory once; the write is atomic (nothing at OUT unless it all
succeeded). Nothing here imports pandas or ``datasets``: they are recognised by what they offer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fuelline.protocol import DataError, OptionError
from fuelline.protocol.common.atomic import atomic_directory
from fuelline.server.ingest.columns import describe, grouped, matching, parse_group, servable
from fuelline.server.ingest.inputs import read_input
from fuelline.server.sources.parquet import TABLE_METADATA_KEY

__all__ = ["write_dataset", "TableSummary", "ROW_GROUP_BYTES"]

ROW_GROUP_BYTES = 2 << 20  # decoded bytes of a row group: a block of 8 is 16 MB a client
MIN_GROUP_ROWS, MAX_GROUP_ROWS = 256, 1 << 17
MIN_GROUPS = 8
FILE_ROW_GROUPS = 64  # row groups per file
COMPRESSION = "lz4"  # decoded once an epoch: reading speed counts more than size
SPLIT_NAMES = {"validation": "val", "valid": "val", "dev": "val"}


@dataclass
class TableSummary:
    """What ``write_dataset`` wrote: per split its rows, files and row groups, and the sources."""

    out: str
    splits: dict[str, dict[str, int]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # name -> "float32 [64]"
    classes: list[str] | None = None
    dropped: list[str] = field(default_factory=list)
    made_sample_id: bool = False

    def lines(self) -> list[str]:
        """What ``fuelline import`` prints."""
        out = [f"wrote {self.out}: " + ", ".join(f"{s} {v['rows']} rows" for s, v in self.splits.items())]
        out += [f"  source {name}: {what}" for name, what in self.sources.items()]
        if self.classes is not None:
            out.append(f"  label classes: {', '.join(self.classes)}")
        if self.made_sample_id:
            out.append("  sample_id: made (each row's position in the input)")
        if self.dropped:
            out.append(f"  not written: {', '.join(self.dropped)}")
        return out


# -- splits, order, files ---------------------------------------------------------------------------


def _split_rows(labels: np.ndarray | None, rows: int, val_fraction: float, seed: int) -> np.ndarray:
    """A boolean mask of the val rows: per class (or over all rows), a seeded shuffle's first
    ``round(n * val_fraction)``."""
    rng = np.random.default_rng(seed)
    val = np.zeros(rows, bool)
    groups = [np.arange(rows)] if labels is None else [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for idx in groups:
        val[idx[rng.permutation(len(idx))[: round(len(idx) * val_fraction)]]] = True
    return val


def _group_rows(table: pa.Table, rows_per_group: int | None) -> int:
    """About ``ROW_GROUP_BYTES`` of rows, and at least ``MIN_GROUPS`` groups where each still has
    ``MIN_GROUP_ROWS``: a server's shuffle block and its worker processes work in row groups."""
    if rows_per_group is not None:
        return rows_per_group
    per_row = max(1, table.nbytes // max(1, table.num_rows))
    rows = min(ROW_GROUP_BYTES // per_row, -(-table.num_rows // MIN_GROUPS))
    return int(min(MAX_GROUP_ROWS, max(MIN_GROUP_ROWS, rows)))


def _write_split(table: pa.Table, folder: str, rows_per_group: int, metadata: dict[str, Any]) -> dict[str, int]:
    os.makedirs(folder)
    rows_per_file = rows_per_group * FILE_ROW_GROUPS
    files = 0
    for start in range(0, max(1, table.num_rows), rows_per_file):
        part = table.slice(start, rows_per_file)
        meta = dict(metadata)
        if "label" in meta:
            values, counts = np.unique(part.column(meta["label"]).to_numpy(), return_counts=True)
            meta["counts"] = {str(int(v)): int(n) for v, n in zip(values, counts)}
        part = part.replace_schema_metadata({TABLE_METADATA_KEY: json.dumps(meta, sort_keys=True).encode()})
        pq.write_table(part, os.path.join(folder, f"part-{files:05d}.parquet"), row_group_size=rows_per_group,
                       compression=COMPRESSION, use_dictionary=False, write_statistics=False)
        files += 1
    return {"rows": table.num_rows, "files": files, "row_groups": -(-table.num_rows // rows_per_group)}


def write_dataset(
    data: Any,
    out: str | os.PathLike[str],
    *,
    label: str | None = None,
    sample_id: str = "sample_id",
    group: Mapping[str, str | Sequence[str] | tuple[str | Sequence[str], Sequence[int]]] | Iterable[str] | None = None,
    drop: Sequence[str] = (),
    val_fraction: float = 0.2,
    seed: int = 0,
    shuffle: bool = True,
    float64: bool = False,
    rows_per_group: int | None = None,
) -> TableSummary:
    """Write ``data`` at ``out`` as a dataset ``fuelline serve`` serves (see the module's docstring).

    Args:
        data: a pandas DataFrame, a dict of numpy arrays (one row per first index), a pyarrow
            Table, a ``datasets`` Dataset or DatasetDict, a path (CSV, Parquet, Arrow, or a folder
            of them, with or without split subfolders), or a dict of split name to any of those.
        out: the folder to create; must not exist.
        label: the class label column: strings become int64 indices (names sorted); used to
            stratify the val split and counted per class for the server.
        sample_id: the column of unique int64 row ids; made when missing.
        group: ``{"features": "pixel_*"}`` (glob patterns, comma-separated, or a list of names),
            ``{"image": ("pixel_*", (8, 8))}`` with a shape, or ``["features=pixel_*:8x8"]``:
            scalar columns gathered into one source, in column order.
        drop: columns not to write.
        val_fraction: share of rows in a ``val`` split when ``data`` has no splits (0: none).
        seed: of the shuffle and the split.
        shuffle: shuffle rows once before writing (recommended: see the module's docstring).
        float64: keep float64 columns (default: float32).
        rows_per_group: rows per Parquet row group (default: about 2 MB of decoded rows).

    Raises:
        DataError: a column that cannot be served (named, with its row where one is at fault).
        OptionError: an option that does not fit the data (names the option).
        FileExistsError: ``out`` exists.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise OptionError("val_fraction", f"must be in [0, 1), got {val_fraction!r}")
    if rows_per_group is not None and rows_per_group < 1:
        raise OptionError("rows_per_group", f"must be >= 1, got {rows_per_group!r}")
    out = os.fspath(out)
    if os.path.lexists(out):
        raise FileExistsError(f"dataset {out} already exists; remove it or choose another path")
    got = read_input(data)
    prepared = _prepare(got, _groups(group), label, drop, float64, sample_id)
    tables = prepared.tables
    if not isinstance(got, dict) and val_fraction > 0:
        tables = _split_off_val(tables.pop("train"), label, val_fraction, seed)
    order = {"train": 0, "val": 1}
    tables = dict(sorted(tables.items(), key=lambda kv: (order.get(kv[0], 2), kv[0])))
    rng = np.random.default_rng(seed + 1)
    metadata: dict[str, Any] = {"format": 1}
    if label is not None:
        metadata["label"] = label
        if prepared.classes is not None:
            metadata["classes"] = prepared.classes
    summary = TableSummary(out, classes=prepared.classes, dropped=prepared.dropped, made_sample_id=prepared.made_id)
    with atomic_directory(out, "dataset") as temporary:
        for split, table in tables.items():
            if shuffle:
                table = table.take(pa.array(rng.permutation(table.num_rows)))
            summary.splits[split] = _write_split(table, os.path.join(temporary, split),
                                                 _group_rows(table, rows_per_group), metadata)
    first = next(iter(tables.values()))
    summary.sources = {f.name: describe(f.type) for f in first.schema}
    return summary


@dataclass
class _Prepared:
    """Every split's table as it will be written, and what making them found."""

    tables: dict[str, pa.Table]
    classes: list[str] | None
    dropped: list[str]
    made_id: bool


def _prepare(got: dict[str, pa.Table] | pa.Table, groups: dict[str, tuple[str | Sequence[str], tuple[int, ...] | None]],
             label: str | None, drop: Sequence[str], float64: bool, sample_id: str) -> _Prepared:
    """Each split grouped, made servable and given sample ids (counting on across splits)."""
    given = got if isinstance(got, dict) else {"train": got}
    given = {SPLIT_NAMES.get(k, k): v for k, v in given.items()}
    prepared = _Prepared({}, None, [], False)
    offset = 0
    for split, table in given.items():
        where = f"split {split!r}" if isinstance(got, dict) else "input"
        for name, (pattern, shape) in groups.items():
            table = grouped(table, name, matching(table.column_names, pattern), shape)
        table, left_out, prepared.classes = servable(table, where, label, drop, float64, prepared.classes)
        prepared.dropped += [c for c in left_out if c not in prepared.dropped]
        if sample_id not in table.column_names:
            table = table.append_column(sample_id, pa.array(np.arange(offset, offset + table.num_rows, dtype=np.int64)))
            prepared.made_id = True
        offset += table.num_rows
        prepared.tables[split] = table
    _check_ids(prepared.tables, sample_id)
    return prepared


def _split_off_val(whole: pa.Table, label: str | None, val_fraction: float, seed: int) -> dict[str, pa.Table]:
    labels = whole.column(label).to_numpy() if label is not None else None
    val = _split_rows(labels, whole.num_rows, val_fraction, seed)
    return {"train": whole.filter(pa.array(~val)), "val": whole.filter(pa.array(val))}


def _groups(group: Any) -> dict[str, tuple[str | Sequence[str], tuple[int, ...] | None]]:
    if group is None:
        return {}
    if isinstance(group, Mapping):
        out: dict[str, tuple[str | Sequence[str], tuple[int, ...] | None]] = {}
        for name, spec in group.items():
            if isinstance(spec, tuple) and len(spec) == 2 and not isinstance(spec[1], str):
                out[str(name)] = (spec[0], tuple(int(d) for d in spec[1]))
            else:
                out[str(name)] = (spec, None)
        return out
    parsed = [parse_group(g) for g in group]
    return {name: (pattern, shape) for name, pattern, shape in parsed}


def _check_ids(tables: Mapping[str, pa.Table], sample_id: str) -> None:
    ids = []
    for split, table in tables.items():
        t = table.schema.field(sample_id).type
        if not pa.types.is_integer(t):
            raise DataError(f"split {split!r}: column {sample_id!r} has type {t}: sample ids are integers "
                            "(pass sample_id= another name to have one made)")
        ids.append(table.column(sample_id).to_numpy())
    every = np.concatenate(ids) if ids else np.empty(0, np.int64)
    unique, counts = np.unique(every, return_counts=True)
    if (counts > 1).any():
        raise DataError(f"column {sample_id!r}: id {int(unique[counts > 1][0])} is on {int(counts.max())} rows; "
                        "sample ids must be unique (pass sample_id= another name to have one made)")
