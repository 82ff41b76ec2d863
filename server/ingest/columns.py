"""The columns a server serves, for ``write_dataset``: every column numbers of a fixed shape (or an
error naming it), scalar columns gathered into one source (``group``), list columns of one length
as fixed-size lists, float64 narrowed to float32, and the label as int64 class indices."""

from __future__ import annotations

import difflib
import fnmatch
import json
import re
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fuelline.protocol import DataError, OptionError

__all__ = ["describe", "fixed_list", "grouped", "matching", "parse_group", "servable"]

PANDAS_INDEX = re.compile(r"__index_level_\d+__")


def fixed_list(arr: np.ndarray) -> pa.Array:
    """An array of shape (rows, *shape) as nested fixed-size lists of its dtype."""
    flat = pa.array(np.ascontiguousarray(arr).reshape(-1))
    for size in reversed(arr.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    return flat


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


def matching(names: Sequence[str], pattern: str | Sequence[str]) -> list[str]:
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


def grouped(table: pa.Table, name: str, columns: list[str], shape: tuple[int, ...] | None) -> pa.Table:
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
    return rest.append_column(name, fixed_list(stacked.reshape(len(table), *want)))


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


def servable(table: pa.Table, where: str, label: str | None, drop: Sequence[str], float64: bool,
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


def describe(t: pa.DataType) -> str:
    shape = []
    while pa.types.is_fixed_size_list(t):
        shape.append(t.list_size)
        t = t.value_type
    dtype = np.dtype(t.to_pandas_dtype()).name
    return f"{dtype} [{', '.join(map(str, shape))}]" if shape else f"{dtype} (one per row)"
