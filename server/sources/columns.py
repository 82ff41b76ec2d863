"""Which Parquet columns can be served, and how a column becomes a numpy array.

Servable: integer, unsigned, floating and boolean columns (one value per row) and fixed-size
lists of those, nested to any depth (a fixed shape per row), plus Arrow's fixed_shape_tensor
extension type. Anything else (strings, variable-length lists, structs, timestamps) is not a
batch of numbers, and is reported by name and type rather than guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from fuelline.protocol import DataError

__all__ = ["ColumnSpec", "column_spec", "to_numpy"]


@dataclass(frozen=True)
class ColumnSpec:
    """A servable column: numpy dtype and the shape of one row's value."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    arrow_type: str

    def to_schema(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape)}


def _leaf(t: pa.DataType) -> tuple[pa.DataType, tuple[int, ...]]:
    shape: list[int] = []
    if isinstance(t, pa.ExtensionType) and getattr(t, "extension_name", "") == "arrow.fixed_shape_tensor":
        return t.value_type, tuple(t.shape)
    while pa.types.is_fixed_size_list(t):
        shape.append(t.list_size)
        t = t.value_type
    return t, tuple(shape)


def column_spec(field: pa.Field) -> ColumnSpec | str:
    """The spec of a servable column, or a sentence saying why it cannot be served."""
    leaf, shape = _leaf(field.type)
    if not (pa.types.is_integer(leaf) or pa.types.is_floating(leaf) or pa.types.is_boolean(leaf)):
        return f"column {field.name!r} has type {field.type}, which is not numbers of a fixed shape"
    dtype = np.dtype(leaf.to_pandas_dtype()).newbyteorder("<").str
    return ColumnSpec(field.name, dtype, shape, str(field.type))


def to_numpy(column: pa.ChunkedArray | pa.Array, spec: ColumnSpec, where: str) -> np.ndarray:
    """A column of a decoded row group as an array of shape (rows, *spec.shape).

    Raises:
        DataError: the column holds nulls, which a batch of numbers cannot represent.
    """
    if isinstance(column, pa.ChunkedArray):
        # combine_chunks copies even a single chunk; take that chunk as it is.
        arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    else:
        arr = column
    if isinstance(arr, pa.ExtensionArray):
        arr = arr.storage
    rows = len(arr)
    while pa.types.is_fixed_size_list(arr.type):
        if arr.null_count:
            raise DataError(f"{where}: column {spec.name!r} has {arr.null_count} null rows")
        arr = arr.flatten()
    if arr.null_count:
        raise DataError(f"{where}: column {spec.name!r} has {arr.null_count} null values")
    values = _numbers(arr)
    if values is None:
        values = arr.to_numpy(zero_copy_only=False)
    return values.reshape((rows, *spec.shape)).astype(spec.dtype, copy=False)


def _numbers(arr: pa.Array) -> np.ndarray | None:
    """A numeric array without nulls as the numpy view of its values buffer; None for any other.
    (pyarrow's ``to_numpy`` imports pandas, where it is installed, on its first call: 0.13 s that
    a server's first client waited for.)"""
    t = arr.type
    if pa.types.is_floating(t):
        kind = "f"
    elif pa.types.is_signed_integer(t):
        kind = "i"
    elif pa.types.is_unsigned_integer(t):
        kind = "u"
    else:
        return None
    dtype = np.dtype(f"{kind}{t.bit_width // 8}")  # (Arrow keeps numbers in the host's byte order)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)
