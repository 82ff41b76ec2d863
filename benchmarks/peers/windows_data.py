"""The windows workload's data: ``fuelline synth`` recordings converted once with ``fuelline
convert`` (``benchmarks.pipeline.ensure_dataset``: made on first use under the data directory and
reused), which ``fuelline serve`` serves as it is, aligning windows as it goes; and, for the peers,
which cannot align, every window of its train split materialised once, untimed.

The materialised copy is read through fuelline's own pipeline in this process: each recording's
windows as the server decodes them (``WindowSource.windows``: read, aligned, cut and z-scored),
finished as the server finishes a batch (``finish_batch``: the cast to the dtypes served), the same
sources, window length and dtypes. They are written, in recording order, as a Parquet table
(``<data dir>/peers-windows-…/parquet/``), a row group per recording: an array source as a
fixed-size list of its flattened values, a scalar as a plain column; ``columns.json`` beside it
names each column's dtype and shape, and the id column (``sample_id``, whose value // 1,000,000 is
the recording: ``SAMPLE_ID_STRIDE``). Each peer's copy in its own format (MDS, LitData chunks,
fixed-length records) is written from that table, once, by its reader in its own environment, as
for the flat table.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import progress
from benchmarks.pipeline import ensure_dataset
from fuelline.server.multimodal.source import SAMPLE_ID_STRIDE, WindowSource

__all__ = ["Windows", "FULL", "QUICK", "ensure", "folder_bytes", "SPLIT", "ID", "SAMPLE_ID_STRIDE"]

SPLIT = "train"
ID = "sample_id"
FORMAT = 1  # bump when what is written changes, so that an old copy is not reused


@dataclass(frozen=True)
class Windows:
    recordings: int  # synthesised, every split
    seconds: float  # per recording
    files: int  # Parquet files of the materialised copy (recordings dealt out in order)


FULL = Windows(160, 120.0, 8)
QUICK = Windows(10, 40.0, 2)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def ensure(data_dir: Path, size: Windows) -> tuple[Path, Path, dict[str, Any]]:
    """(the converted dataset, the folder of its materialised windows, what describes them); both
    made on first use and reused after (each appears by an atomic rename)."""
    started = time.perf_counter()
    dataset = ensure_dataset(data_dir, size.recordings, size.seconds)
    prepared_s = time.perf_counter() - started
    root = data_dir / f"peers-windows-v{FORMAT}-{dataset.name}-{size.files}files"
    meta_path = root / "windows.json"
    if meta_path.exists():
        return dataset, root, {**json.loads(meta_path.read_text()), "reused": True}
    tmp = data_dir / f".{root.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "parquet").mkdir(parents=True)
    progress(f"materialising the windows of {dataset} ...")
    started = time.perf_counter()
    src = WindowSource(str(dataset), decoded_cache_mb=0)
    try:
        rows = src.unit_rows(SPLIT)
        units = [int(u) for u in np.flatnonzero(rows)]
        per_file = -(-len(units) // size.files)
        columns: list[dict[str, Any]] = []
        counts: list[int] = []
        for f in range(size.files):
            part = units[f * per_file:(f + 1) * per_file]
            if not part:
                continue
            writer: pq.ParquetWriter | None = None
            for u in part:
                windows = src.finish_batch(SPLIT, src.windows(SPLIT, u), src.sources)
                if not columns:
                    columns = [{"name": k, "dtype": v.dtype.str, "shape": list(v.shape[1:])} for k, v in windows.items()]
                table = pa.table({k: _arrow(v) for k, v in windows.items()})
                if writer is None:
                    writer = pq.ParquetWriter(tmp / "parquet" / f"part-{f:03d}.parquet", table.schema)
                writer.write_table(table, row_group_size=len(table))
                counts.append(len(table))
            assert writer is not None
            writer.close()
        sources = list(src.sources)
    finally:
        src.close()
    materialise_s = time.perf_counter() - started
    (tmp / "columns.json").write_text(json.dumps({"id": ID, "columns": columns}, indent=2) + "\n")
    window_bytes = sum(int(np.prod(c["shape"], dtype=np.int64)) * np.dtype(c["dtype"]).itemsize for c in columns)
    meta = {
        "dataset": str(dataset), "split": SPLIT, "sources": sources, "recordings": len(counts), "windows": sum(counts),
        "windows_per_recording": counts, "window_bytes": window_bytes, "files": size.files,
        "dataset_found_or_made_s": round(prepared_s, 2), "materialise_s": round(materialise_s, 2),
        "parquet_bytes": folder_bytes(tmp / "parquet"), "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (tmp / "windows.json").write_text(json.dumps(meta, indent=2) + "\n")
    try:
        os.rename(tmp, root)
    except OSError:  # another run made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return dataset, root, {**meta, "reused": False}


def _arrow(values: np.ndarray) -> pa.Array:
    """A column: a fixed-size list of each row's flattened values, or the scalars themselves."""
    if values.ndim == 1:
        return pa.array(values)
    per_row = int(np.prod(values.shape[1:], dtype=np.int64))
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(values).reshape(-1)), per_row)
