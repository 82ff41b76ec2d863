"""A small built-in Parquet dataset, so that a server can be tried (and tested) without data.

Columns: ``sample_id`` int64 (unique), ``features`` fixed_size_list<float32>[dim] whose value j is
``sample_id + j / 1000`` (so a reader can check every value it receives), ``label`` int64 and
``weight`` float32. Split folders ``train/`` and ``val/``, several files of several row groups;
each file's key-value metadata holds the xxh3 of its columns
(``fuelline.server.sources.fingerprint.CONTENT_KEY``), as every file fuelline writes does.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fuelline.protocol.common.atomic import atomic_directory
from fuelline.server.sources.fingerprint import CONTENT_KEY, ContentDigest

__all__ = ["write_sample_dataset", "expected_features"]


def expected_features(sample_id: np.ndarray, dim: int) -> np.ndarray:
    """What ``features`` holds for these sample ids."""
    return (np.asarray(sample_id, dtype=np.float64)[:, None] + np.arange(dim) / 1000.0).astype(np.float32)


def write_sample_dataset(
    out: str,
    rows: int = 10_000,
    dim: int = 16,
    files: int = 4,
    row_group_rows: int = 1_000,
    val_fraction: float = 0.2,
    classes: int = 6,
    seed: int = 0,
    plain: bool = False,
) -> dict[str, int]:
    """Write the sample dataset to ``out`` (atomically) and return rows per split.

    ``plain``: uncompressed, plain-encoded columns (no dictionary), so that files of as many rows
    have the same size whatever they hold, as regenerated fixed-width shards do."""
    if rows < 2 or files < 1 or dim < 1 or row_group_rows < 1:
        raise ValueError("rows >= 2, files >= 1, dim >= 1 and row_group_rows >= 1 are required")
    if os.path.exists(out):
        raise FileExistsError(f"{out} exists; remove it or choose another path")
    rng = np.random.default_rng(seed)
    n_val = max(1, int(rows * val_fraction))
    splits = {"train": np.arange(rows - n_val), "val": np.arange(rows - n_val, rows)}
    with atomic_directory(out, "dataset") as tmp:
        for split, ids in splits.items():
            os.makedirs(os.path.join(tmp, split))
            for i, part in enumerate(np.array_split(ids, files)):
                if not len(part):
                    continue
                columns = {
                    "sample_id": part.astype(np.int64),
                    "features": expected_features(part, dim),
                    "label": rng.integers(0, classes, len(part)).astype(np.int64),
                    "weight": rng.random(len(part)).astype(np.float32),
                }
                content = ContentDigest()
                content.update(*columns.values())
                table = pa.table(
                    {k: pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), dim) if v.ndim == 2 else pa.array(v)
                     for k, v in columns.items()}
                ).replace_schema_metadata({CONTENT_KEY: content.hexdigest()})
                encoding = {"compression": "none", "use_dictionary": False} if plain else {}
                pq.write_table(table, os.path.join(tmp, split, f"part-{i:05d}.parquet"), row_group_size=row_group_rows,
                               **encoding)
    return {k: len(v) for k, v in splits.items()}
