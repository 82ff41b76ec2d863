"""A decoded row group's columns as numpy: the values pyarrow gives, without pyarrow's pandas
shim (importing pandas on a server's first decode made its first client wait 0.13 s)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fuelline.server.sources.columns import column_spec, to_numpy

NUMERIC = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(),
           pa.float16(), pa.float32(), pa.float64()]


@pytest.mark.parametrize("arrow_type", NUMERIC, ids=str)
def test_every_numeric_type_comes_out_as_pyarrow_gives_it_also_sliced_and_in_lists(arrow_type: pa.DataType) -> None:
    values = np.arange(60) % 50
    flat = pa.array(values.astype(arrow_type.to_pandas_dtype()), type=arrow_type)
    lists = pa.FixedSizeListArray.from_arrays(flat, 3)
    cases = {
        "whole": (flat, ()),
        "sliced": (flat.slice(7, 30), ()),
        "list": (lists, (3,)),
        "sliced list": (lists.slice(3, 11), (3,)),
        "chunked": (pa.chunked_array([flat.slice(0, 10), flat.slice(10, 5)]), ()),
    }
    for name, (column, shape) in cases.items():
        spec = column_spec(pa.field("x", column.type))
        assert not isinstance(spec, str)
        got = to_numpy(column, spec, "here")
        flat_values = (column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column)
        while pa.types.is_fixed_size_list(flat_values.type):
            flat_values = flat_values.flatten()
        want = flat_values.to_numpy(zero_copy_only=False).reshape((len(column), *shape))
        assert got.dtype == np.dtype(spec.dtype) and got.shape == want.shape, name
        assert np.array_equal(got, want), name


def test_booleans_and_nulls_still_take_pyarrows_way() -> None:
    spec = column_spec(pa.field("b", pa.bool_()))
    assert not isinstance(spec, str)
    assert to_numpy(pa.array([True, False, True]), spec, "here").tolist() == [True, False, True]
    spec = column_spec(pa.field("i", pa.int32()))
    assert not isinstance(spec, str)
    with pytest.raises(Exception, match="null"):
        to_numpy(pa.array([1, None], type=pa.int32()), spec, "file.parquet, row group 0")


@pytest.mark.skipif(importlib.util.find_spec("pandas") is None, reason="what it checks happens only where pandas is installed")
def test_a_servers_first_batch_of_parquet_does_not_import_pandas(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(4000, dtype=np.float32)), 4),
                      "y": pa.array(np.arange(1000))})
    pq.write_table(table, tmp_path / "train" / "part-0.parquet", row_group_size=250)
    code = (
        "import sys\n"
        "from fuelline.server.sources.parquet import ParquetSource\n"
        f"src = ParquetSource({str(tmp_path)!r}, batch_size=64, seed=0)\n"
        "batch = next(src.iter_batches('train', 0, 0, 1, 0, ('x', 'y')))\n"
        "assert batch['x'].shape == (64, 4), batch['x'].shape\n"
        "src.close()\n"
        "print('pandas' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "serving a Parquet batch imported pandas"
