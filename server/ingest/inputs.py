"""Reading what users have, for ``write_dataset``: a pandas DataFrame, a dict of numpy arrays, a
pyarrow Table or RecordBatch, a Hugging Face ``datasets`` Dataset, or files (CSV, Parquet,
Arrow/Feather, a folder of them, or of one folder per split), as one Arrow table or a mapping of
split name to table. Nothing here imports pandas or ``datasets``: they are recognised by what they
offer."""

from __future__ import annotations

import glob
import os
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fuelline.protocol import DataError
from fuelline.server.ingest.columns import fixed_list

__all__ = ["INPUT_SUFFIXES", "read_input"]

INPUT_SUFFIXES = (".parquet", ".csv", ".arrow", ".feather", ".ipc")


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
        columns[str(name)] = fixed_list(arr)
    return pa.table(columns)



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
