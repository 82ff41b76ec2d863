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

import difflib
import fnmatch
import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fuelline.protocol import DataError, OptionError
from fuelline.protocol.common.atomic import atomic_directory
from fuelline.server.sources.parquet import TABLE_METADATA_KEY

__all__ = ["write_dataset", "read_input", "TableSummary", "ROW_GROUP_BYTES", "parse_group"]

ROW_GROUP_BYTES = 2 << 20  # decoded bytes of a row group: a block of 8 is 16 MB a client
MIN_GROUP_ROWS, MAX_GROUP_ROWS = 256, 1 << 17
MIN_GROUPS = 8
FILE_ROW_GROUPS = 64  # row groups per file
COMPRESSION = "lz4"  # decoded once an epoch: reading speed counts more than size
PANDAS_INDEX = re.compile(r"__index_level_\d+__")
SPLIT_NAMES = {"validation": "val", "valid": "val", "dev": "val"}
INPUT_SUFFIXES = (".parquet", ".csv", ".arrow", ".feather", ".ipc")


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


# -- reading what users have ---------------------------------------------------------------------


def _is_dataframe(data: Any) -> bool:
    return type(data).__name__ == "DataFrame" and hasattr(data, "to_numpy") and hasattr(data, "columns")


def _is_hf_dataset(data: Any) -> bool:
    return hasattr(data, "data") and hasattr(data, "features") and hasattr(data, "with_format")


def _from_dataframe(frame: Any) -> pa.Table:
    try:
        return pa.Table.from_pandas(frame, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DataError(f"DataFrame: {exc}") from None


def _from_arrays(data: Mapping[str, Any], where: str) -> pa.Table:
    columns: dict[str, pa.Array] = {}
    rows = None
    for name, values in data.items():
        arr = np.asarray(values)
        if arr.dtype == object:
            raise DataError(f"{where}: array {name!r} holds Python objects (ragged lists?); "
                            "give arrays of one shape per row")
        if arr.ndim == 0:
            raise DataError(f"{where}: {name!r} is a scalar, not one value per row")
        if rows is not None and len(arr) != rows:
            raise DataError(f"{where}: {name!r} has {len(arr)} rows, the arrays before it {rows}")
        rows = len(arr)
        columns[str(name)] = _fixed_list(arr)
    return pa.table(columns)


def _fixed_list(arr: np.ndarray) -> pa.Array:
    """An array of shape (rows, *shape) as nested fixed-size lists of its dtype."""
    flat = pa.array(np.ascontiguousarray(arr).reshape(-1))
    for size in reversed(arr.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    return flat


def _read_file(path: str) -> pa.Table:
    try:
        if path.endswith(".parquet"):
            return pq.read_table(path)
        if path.endswith(".csv"):
            from pyarrow import csv

            return csv.read_csv(path)
        with pa.memory_map(path) as source:  # Arrow IPC: a file (Feather 2) or a stream (datasets)
            try:
                return pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: cannot be read as {os.path.splitext(path)[1][1:] or 'Arrow'}: {exc}") from None


def _read_files(paths: Sequence[str], where: str) -> pa.Table:
    tables = [_read_file(p) for p in paths]
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DataError(f"{where}: its files do not hold the same columns: {exc}") from None


def _files_in(folder: str) -> list[str]:
    found = sorted(p for p in glob.glob(os.path.join(folder, "*")) if p.endswith(INPUT_SUFFIXES))
    hidden = {p for p in found if os.path.basename(p).startswith((".", "_"))}
    return [p for p in found if p not in hidden and os.path.isfile(p)]


def _read_path(path: str) -> dict[str, pa.Table] | pa.Table:
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or folder")
    if os.path.isfile(path):
        if not path.endswith(INPUT_SUFFIXES):
            raise DataError(f"{path}: not a file to import (one of {', '.join(INPUT_SUFFIXES)})")
        return _read_file(path)
    files = _files_in(path)
    subfolders = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)) and not d.startswith("."))
    if files:
        return _read_files(files, path)
    splits = {d: _files_in(os.path.join(path, d)) for d in subfolders}
    splits = {d: f for d, f in splits.items() if f}
    if not splits:
        raise DataError(f"{path}: no {', '.join(INPUT_SUFFIXES)} files in it or in its subfolders")
    return {d: _read_files(f, os.path.join(path, d)) for d, f in splits.items()}


def _from_hf(data: Any) -> pa.Table:
    """A ``datasets`` Dataset's Arrow table; a selected or shuffled view: its rows, in its order."""
    table = data.data  # (a datasets table wrapper: the Arrow table is .table)
    table = getattr(table, "table", table)
    indices = getattr(data, "_indices", None)
    if indices is not None:
        table = table.take(getattr(indices, "table", indices).column(0))
    return table


def _from_mapping(data: Mapping[str, Any], where: str) -> dict[str, pa.Table] | pa.Table:
    """A dict of arrays (one table), or of split name to any input (one table each)."""
    values = list(data.values())
    if all(isinstance(v, (np.ndarray, list, tuple)) for v in values):
        return _from_arrays(data, where)
    splits: dict[str, pa.Table] = {}
    for name, value in data.items():
        got = read_input(value, f"split {name!r}")
        if isinstance(got, dict):
            raise DataError(f"split {name!r}: holds splits of its own")
        splits[str(name)] = got
    return splits


def read_input(data: Any, where: str = "input") -> dict[str, pa.Table] | pa.Table:
    """What ``write_dataset`` takes, as one Arrow table or a mapping of split name to table."""
    if isinstance(data, (str, os.PathLike)):
        return _read_path(os.fspath(data))
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if _is_dataframe(data):
        return _from_dataframe(data)
    if _is_hf_dataset(data):
        return _from_hf(data)
    if isinstance(data, Mapping) and data:
        return _from_mapping(data, where)
    raise DataError(f"{where}: a {type(data).__name__} is not something to import: give a pandas DataFrame, a dict "
                    "of numpy arrays, a pyarrow Table, a datasets Dataset or DatasetDict, or a file or folder")


# -- columns a server serves ---------------------------------------------------------------------


def parse_group(text: str) -> tuple[str, str, tuple[int, ...] | None]:
    """``NAME=PATTERN[:SHAPE]`` (``features=pixel_*:8x8``) as (name, pattern, shape)."""
    name, eq, rest = text.partition("=")
    if not eq or not name or not rest:
        raise OptionError("group", f"{text!r} is not NAME=COLUMNS[:SHAPE] (e.g. features=pixel_*:8x8)")
    pattern, colon, shape_text = rest.partition(":")
    shape = None
    if colon:
        try:
            shape = tuple(int(d) for d in shape_text.lower().split("x"))
        except ValueError:
            raise OptionError("group", f"{text!r}: shape {shape_text!r} is not sizes joined by x (8x8)") from None
        if not shape or min(shape) < 1:
            raise OptionError("group", f"{text!r}: shape {shape_text!r} has a size below 1")
    return name, pattern, shape


def _columns_hint(names: Sequence[str], wanted: str) -> str:
    """``did you mean 'target'?`` where a column is close to ``wanted``, else the first columns."""
    close = difflib.get_close_matches(wanted, names, n=3)
    if close:
        return "did you mean " + " or ".join(repr(c) for c in close) + "?"
    return f"columns: {', '.join(names[:12])}{', …' if len(names) > 12 else ''}"


def _matching(names: Sequence[str], pattern: str | Sequence[str]) -> list[str]:
    if not isinstance(pattern, str):
        missing = [p for p in pattern if p not in names]
        if missing:
            raise OptionError("group", f"no column {missing[0]!r} ({_columns_hint(names, missing[0])})")
        return list(pattern)
    parts = [p for p in pattern.split(",") if p]
    found = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in parts)]
    if not found:
        raise OptionError("group", f"{pattern!r} matches no column ({_columns_hint(names, pattern)})")
    return found


def _group(table: pa.Table, name: str, columns: list[str], shape: tuple[int, ...] | None) -> pa.Table:
    for c in columns:
        t = table.schema.field(c).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
            raise OptionError("group", f"{name}: column {c!r} has type {t}; a group gathers columns of one number each")
    want = shape or (len(columns),)
    if int(np.prod(want)) != len(columns):
        raise OptionError("group", f"{name}: {len(columns)} columns do not make shape {'x'.join(map(str, want))}")
    stacked = np.column_stack([table.column(c).to_numpy(zero_copy_only=False) for c in columns])
    rest = table.drop_columns(columns)
    if name in rest.column_names:
        raise OptionError("group", f"{name}: a column of that name exists and is not in the group")
    return rest.append_column(name, _fixed_list(stacked.reshape(len(table), *want)))


def _fixed_shape(column: pa.ChunkedArray, name: str, where: str) -> pa.Array:
    """A list column whose rows all have one shape, as nested fixed-size lists."""
    arr = column.combine_chunks()
    if arr.null_count:
        row = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{where}: column {name!r} is empty (null) in row {row}; fill it or drop the row")
    sizes: list[int] = []
    level = arr
    while pa.types.is_list(level.type) or pa.types.is_large_list(level.type) or pa.types.is_fixed_size_list(level.type):
        if pa.types.is_fixed_size_list(level.type):
            sizes.append(level.type.list_size)
            level = level.flatten()
            continue
        lengths = pc.list_value_length(level).to_numpy(zero_copy_only=False)
        if len(lengths) == 0:
            raise DataError(f"{where}: column {name!r} has no rows to take a shape from")
        if (lengths != lengths[0]).any():
            at = int(np.flatnonzero(lengths != lengths[0])[0])
            which = f"row {at} has {int(lengths[at])}, row 0 {int(lengths[0])}" if not sizes else f"at depth {len(sizes) + 1}"
            raise DataError(f"{where}: column {name!r} holds lists of {int(lengths.min())} to {int(lengths.max())} "
                            f"values ({which}): a source has one shape per row; pad or cut them to one length")
        sizes.append(int(lengths[0]))
        level = level.flatten()
    if level.null_count:
        raise DataError(f"{where}: column {name!r} has {level.null_count} null values inside its lists")
    t = level.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise DataError(f"{where}: column {name!r} holds lists of {t}, not of numbers")
    out: pa.Array = level
    for size in reversed(sizes):
        out = pa.FixedSizeListArray.from_arrays(out, size)
    return out


def _parse_json_lists(column: pa.ChunkedArray) -> pa.Array | None:
    """A string column of JSON lists of numbers (``[0.5, 1.0]``, as pandas writes list cells to
    CSV), as a list column; None if it is not one."""
    values = column.to_pylist()
    first = next((v for v in values if v is not None), None)
    if not isinstance(first, str) or not first.lstrip().startswith("["):
        return None
    try:
        parsed = [None if v is None else json.loads(v) for v in values]
    except (TypeError, ValueError):
        return None
    try:
        return pa.array(parsed)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None


def _leaf_type(t: pa.DataType) -> pa.DataType:
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    return t


def _with_leaf(t: pa.DataType, leaf: pa.DataType) -> pa.DataType:
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_with_leaf(t.value_type, leaf), t.list_size)
    return leaf


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _plain(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """An extension column as its storage, a dictionary column as its values."""
    t = column.type
    if isinstance(t, pa.ExtensionType):
        column = pa.chunked_array([c.storage for c in column.chunks], t.storage_type)
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    return column


def _text_label(column: pa.ChunkedArray, name: str, where: str,
                classes: list[str] | None) -> tuple[pa.Array, list[str]]:
    """A string label as int64 indices into ``classes`` (made sorted from it when None)."""
    if column.null_count:
        raise DataError(f"{where}: label column {name!r} has {column.null_count} empty values")
    if classes is None:
        classes = sorted(pc.unique(column).to_pylist())
    codes = pc.index_in(column, value_set=pa.array(classes, column.type))
    if codes.null_count:
        missing = pc.filter(column, pc.is_null(codes)).to_pylist()[0]
        raise DataError(f"{where}: label {missing!r} is not a class of the other splits ({', '.join(classes)})")
    return codes.cast(pa.int64()), classes


def _number_label(column: pa.ChunkedArray, name: str, where: str) -> pa.ChunkedArray:
    """An integer label as int64; a float one only where every value is whole."""
    t = column.type
    if pa.types.is_integer(t):
        return column.cast(pa.int64())
    values = column.to_numpy(zero_copy_only=False) if pa.types.is_floating(t) else None
    if values is None or not np.all(np.mod(values, 1) == 0):
        raise DataError(f"{where}: label column {name!r} has type {t}: class labels are integers or strings")
    return pa.chunked_array([pa.array(values.astype(np.int64))])


def _numbers(column: pa.ChunkedArray, name: str, where: str) -> pa.ChunkedArray | pa.Array:
    """A feature column as numbers of one shape per row: JSON-list text parsed, lists fixed."""
    if _is_text(column.type):
        parsed = _parse_json_lists(column)
        if parsed is not None:
            column = pa.chunked_array([parsed])
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
        return _fixed_shape(column, name, where)
    if not _is_number(column.type):
        raise DataError(f"{where}: column {name!r} has type {column.type}, which is not numbers: encode it as "
                        f"numbers, or leave it out (drop=[{name!r}], or --drop {name})")
    if column.null_count:
        raise DataError(f"{where}: column {name!r} has {column.null_count} empty (null) values; fill them or drop "
                        "those rows first")
    return column


def _narrowed(column: pa.ChunkedArray | pa.Array, float64: bool) -> pa.ChunkedArray | pa.Array:
    """float16, and float64 unless kept, as float32 (the leaf of a list type too)."""
    leaf = _leaf_type(column.type)
    if pa.types.is_float16(leaf) or (pa.types.is_float64(leaf) and not float64):
        return column.cast(_with_leaf(column.type, pa.float32()))
    return column


def _servable(table: pa.Table, where: str, label: str | None, drop: Sequence[str], float64: bool,
              classes: list[str] | None) -> tuple[pa.Table, list[str], list[str] | None]:
    """Every column as numbers of a fixed shape (or an error naming it); the label as int64.
    Returns the table, the columns left out, and the label's class names (strings only)."""
    dropped: list[str] = []
    columns: dict[str, pa.Array | pa.ChunkedArray] = {}
    for name in table.column_names:
        if PANDAS_INDEX.fullmatch(name) or name in drop:
            dropped.append(name)
            continue
        column = _plain(table.column(name))
        if name == label and _is_text(column.type):
            columns[name], classes = _text_label(column, name, where, classes)
        elif name == label:
            columns[name] = _number_label(_numbers(column, name, where), name, where)
        else:
            columns[name] = _narrowed(_numbers(column, name, where), float64)
    if label is not None and label not in columns:
        raise OptionError("label", f"{where} has no column {label!r} ({_columns_hint(table.column_names, label)})")
    return pa.table(columns), dropped, classes


def _describe(t: pa.DataType) -> str:
    shape = []
    while pa.types.is_fixed_size_list(t):
        shape.append(t.list_size)
        t = t.value_type
    dtype = np.dtype(t.to_pandas_dtype()).name
    return f"{dtype} [{', '.join(map(str, shape))}]" if shape else f"{dtype} (one per row)"


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
    summary.sources = {f.name: _describe(f.type) for f in first.schema}
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
            table = _group(table, name, _matching(table.column_names, pattern), shape)
        table, left_out, prepared.classes = _servable(table, where, label, drop, float64, prepared.classes)
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
