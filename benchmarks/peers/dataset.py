"""The flat table every peer reads: ``rows`` rows of 64 float32 features (one fixed-size list
column, which ``fuelline serve`` serves as one [B, 64] array), an int64 label and an int64 row id,
in row groups of ``rows_per_group`` rows, written in row-id order (so row id // rows_per_group is
the row group a row came from).

It is generated once into ``<data dir>/peers-flat-…/parquet/`` and reused; each peer's copy in its
own format (MDS, LitData chunks, fixed-length records) is written beside it, once, by that peer's
reader in its own environment.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["Table", "FULL", "QUICK", "ensure"]

DIM = 64
CLASSES = 10
FORMAT = 1  # bump when what is written changes, so that an old copy is not reused
ROW_BYTES = 4 * DIM + 8 + 8


@dataclass(frozen=True)
class Table:
    rows: int
    rows_per_group: int
    files: int

    @property
    def name(self) -> str:
        return f"peers-flat-v{FORMAT}-{self.rows}rows-{DIM}dim-{self.rows_per_group}rg-{self.files}files"

    @property
    def groups(self) -> int:
        return self.rows // self.rows_per_group


FULL = Table(400_000, 5_000, 8)  # 80 row groups, 10 a file, 109 MB of numbers
QUICK = Table(20_000, 500, 4)  # 40 row groups, 10 a file


def ensure(data_dir: Path, table: Table, seed: int = 0) -> tuple[Path, dict[str, object]]:
    """The table's folder (``parquet/`` inside), generated on first use; it appears by an atomic
    rename, so a folder that exists is complete."""
    if table.rows % (table.rows_per_group * table.files):
        raise ValueError(f"{table.rows} rows do not split into {table.files} files of whole row groups")
    root = data_dir / table.name
    meta_path = root / "table.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        return root, {**meta, "reused": True}
    tmp = data_dir / f".{table.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "parquet").mkdir(parents=True)
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    per_file = table.rows // table.files
    for f in range(table.files):
        ids = np.arange(f * per_file, (f + 1) * per_file, dtype=np.int64)
        features = rng.standard_normal((per_file, DIM), dtype=np.float32)
        label = (ids * 7919 % CLASSES).astype(np.int64)
        columns = {
            "features": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), DIM),
            "label": pa.array(label),
            "row_id": pa.array(ids),
        }
        pq.write_table(pa.table(columns), tmp / "parquet" / f"part-{f:03d}.parquet", row_group_size=table.rows_per_group)
    meta = {"rows": table.rows, "rows_per_group": table.rows_per_group, "files": table.files, "dim": DIM,
            "row_bytes": ROW_BYTES, "columns": f"features fixed_size_list<float32>[{DIM}], label int64, row_id int64",
            "generation_s": round(time.perf_counter() - started, 2), "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (tmp / "table.json").write_text(json.dumps(meta, indent=2) + "\n")
    try:
        os.rename(tmp, root)
    except OSError:  # another run made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return root, {**meta, "reused": False}
