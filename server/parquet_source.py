"""Serve a directory of Parquet files.

Layout of a dataset directory: either Parquet files directly inside it (one split, ``train``), or
one subdirectory per split (``train/``, ``val/``...) holding Parquet files. Numeric and
fixed-size-list columns become sources (see ``fuelline.server.columns``). A unit of reading is one
row group; the order of an epoch is ``fuelline.server.ordering.epoch_order``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np
import pyarrow.parquet as pq

from fuelline.protocol import DataError
from fuelline.server.columns import ColumnSpec, column_spec, to_numpy
from fuelline.server.ordering import EpochPlan, batches_per_rank, epoch_plan, rank_rows

__all__ = ["ParquetSource", "find_splits"]

log = logging.getLogger("fuelline.server")

DEFAULT_SPLIT = "train"


def _parquet_files(folder: str) -> list[str]:
    return sorted(
        os.path.join(folder, name)
        for name in os.listdir(folder)
        if name.endswith(".parquet") and os.path.isfile(os.path.join(folder, name))
    )


def find_splits(path: str) -> dict[str, list[str]]:
    """Map split name to its Parquet files, per the layout in this module's docstring."""
    if not os.path.exists(path):
        raise DataError(f"dataset {path!r} does not exist")
    if os.path.isfile(path):
        if not path.endswith(".parquet"):
            raise DataError(f"dataset {path!r} is a file but not a .parquet file")
        return {DEFAULT_SPLIT: [path]}
    top = _parquet_files(path)
    subdirs = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    nested = {d: _parquet_files(os.path.join(path, d)) for d in subdirs}
    nested = {d: files for d, files in nested.items() if files}
    if top and nested:
        raise DataError(
            f"dataset {path!r} holds Parquet files both at its top and in split folders "
            f"{sorted(nested)}; put every file in a split folder"
        )
    if top:
        return {DEFAULT_SPLIT: top}
    if not nested:
        raise DataError(f"dataset {path!r} holds no .parquet files (neither directly nor in split folders)")
    return nested


@dataclass
class _Split:
    name: str
    files: list[str]
    unit_file: np.ndarray  # per unit: index into files
    unit_group: np.ndarray  # per unit: row group index within its file
    unit_rows: np.ndarray
    unit_start: np.ndarray  # per unit: global row id of its first row
    rows: int
    disk_bytes: int
    max_unit_bytes: int  # uncompressed bytes of the largest row group
    metadata: list  # per file: its parsed footer, so opening it again parses nothing


class ParquetSource:
    """Batches of a Parquet dataset, deterministically ordered, sharded per rank.

    Args:
        path: the dataset directory (or one .parquet file).
        batch_size: rows per batch; the last batch of an epoch may be shorter.
        seed: seeds every epoch's order together with the epoch number.
        shuffle: False serves rows in storage order.
        block_units: row groups whose rows are mixed together (bounds memory per client to
            ``2 × block_units + 1`` decoded row groups).

    Raises:
        DataError: the path holds no Parquet, files disagree on a column's type, a split is empty.
    """

    def __init__(
        self, path: str, *, batch_size: int = 64, seed: int = 0, shuffle: bool = True, block_units: int = 8
    ) -> None:
        if batch_size < 1:
            raise DataError(f"--batch-size must be >= 1, got {batch_size}")
        if block_units < 1:
            raise DataError(f"--shuffle-block must be >= 1, got {block_units}")
        self.path = path
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.block_units = block_units
        self._columns: dict[str, ColumnSpec] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.unservable: dict[str, str] = {}
        self._splits = {name: self._scan(name, files) for name, files in find_splits(path).items()}
        if not self._columns:
            raise DataError(
                f"dataset {path!r} has no servable columns: " + "; ".join(self.unservable.values())
            )
        for reason in self.unservable.values():
            log.warning("not serving %s", reason)

    # -- scanning ----------------------------------------------------------------------------
    def _scan(self, split: str, files: list[str]) -> _Split:
        unit_file, unit_group, unit_rows, unit_bytes, metadata = [], [], [], [], []
        disk = 0
        for i, f in enumerate(files):
            try:
                meta = pq.read_metadata(f)
                schema = meta.schema.to_arrow_schema()
            except Exception as exc:
                raise DataError(f"shard {f}: not a readable Parquet file ({exc})") from None
            self._check_schema(f, schema)
            metadata.append(meta)
            disk += os.path.getsize(f)
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                if rg.num_rows:
                    unit_file.append(i)
                    unit_group.append(g)
                    unit_rows.append(rg.num_rows)
                    unit_bytes.append(rg.total_byte_size)
        rows = np.asarray(unit_rows, dtype=np.int64)
        if not rows.sum():
            raise DataError(f"split {split!r} of dataset {self.path!r} holds no rows")
        return _Split(
            name=split,
            files=files,
            unit_file=np.asarray(unit_file, dtype=np.int64),
            unit_group=np.asarray(unit_group, dtype=np.int64),
            unit_rows=rows,
            unit_start=np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64),
            rows=int(rows.sum()),
            disk_bytes=disk,
            max_unit_bytes=max(unit_bytes),
            metadata=metadata,
        )

    def _check_schema(self, file: str, schema: Any) -> None:
        first = not self._columns and not self.unservable
        names = set()
        for field in schema:
            names.add(field.name)
            spec = column_spec(field)
            if first:
                if isinstance(spec, ColumnSpec):
                    self._columns[field.name] = spec
                else:
                    self.unservable[field.name] = spec
                continue
            known = self._columns.get(field.name)
            if known is not None and (not isinstance(spec, ColumnSpec) or spec != known):
                raise DataError(
                    f"shard {file}: column {field.name!r} has type {field.type}, "
                    f"but earlier shards have {known.arrow_type}"
                )
        missing = sorted(set(self._columns) - names)
        if missing:
            raise DataError(f"shard {file}: lacks column(s) {missing} that earlier shards have")

    # -- BatchSource -------------------------------------------------------------------------
    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(self._columns)

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self._splits)

    def schema(self) -> Mapping[str, Mapping[str, Any]]:
        return {name: spec.to_schema() for name, spec in self._columns.items()}

    def why_not_servable(self, name: str) -> str | None:
        return self.unservable.get(name)

    def info(self, split: str) -> Mapping[str, Any]:
        s = self._splits[split]
        return {
            "kind": "parquet",
            "split": split,
            "splits": {name: sp.rows for name, sp in self._splits.items()},
            "rows": s.rows,
            "files": len(s.files),
            "row_groups": len(s.unit_rows),
            "disk_bytes": s.disk_bytes,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_block": self.block_units,
        }

    def batches_per_epoch(self, split: str, rank: int, world_size: int) -> int:
        return batches_per_rank(self._splits[split].rows, world_size, self.batch_size)

    def memory_per_client(self, split: str) -> int:
        """Upper bound of decoded row-group bytes one client's reader holds: two blocks in use,
        one being read ahead, and a row group being copied into it."""
        return (3 * self.block_units + 1) * self._splits[split].max_unit_bytes

    def _readahead_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="fuelline-read")
            return self._pool

    @functools.lru_cache(maxsize=8)
    def _plan(self, split: str, epoch: int) -> EpochPlan:
        s = self._splits[split]
        plan = epoch_plan(s.unit_rows, self.seed, epoch, self.shuffle, self.block_units)
        plan.order.setflags(write=False)
        return plan

    def iter_batches(
        self, split: str, epoch: int, rank: int, world_size: int, start: int, sources: tuple[str, ...]
    ) -> Iterator[dict[str, np.ndarray]]:
        s = self._splits[split]
        plan = self._plan(split, epoch)
        rows = rank_rows(plan.order, rank, world_size)
        reader = _BlockReader(s, [self._columns[n] for n in sources], plan, self._readahead_pool())
        try:
            for b in range(start, self.batches_per_epoch(split, rank, world_size)):
                yield reader.gather(rows[b * self.batch_size : (b + 1) * self.batch_size])
        finally:
            reader.close()

    def close(self) -> None:
        self._plan.cache_clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class _BlockReader:
    """One client's reader. It holds the block a batch draws from (and the next one, for a
    batch that straddles two) as one table per column, so a shuffled batch is one gather per
    column and each row group is decoded once per epoch. While a block is served, the next one
    is decoded on the source's read-ahead threads, so decoding overlaps sending."""

    BLOCKS_HELD = 2

    def __init__(self, split: _Split, columns: list[ColumnSpec], plan: EpochPlan, pool: ThreadPoolExecutor) -> None:
        self.split = split
        self.columns = columns
        self.plan = plan
        self.pool = pool
        k = plan.block_units
        perm = plan.unit_perm
        self.n_blocks = -(-len(perm) // k)
        self.block_of_unit = np.empty(len(perm), dtype=np.int64)
        self.block_of_unit[perm] = np.arange(len(perm)) // k
        # Where each unit's first row sits in its block's table.
        lengths = split.unit_rows[perm]
        within = np.cumsum(lengths) - lengths
        block_start = within[(np.arange(len(perm)) // k) * k]
        self.unit_pos = np.empty(len(perm), dtype=np.int64)
        self.unit_pos[perm] = within - block_start
        self.blocks: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self.pending: dict[int, Future] = {}

    def _decode(self, u: int) -> dict[str, np.ndarray]:
        f, g = int(self.split.unit_file[u]), int(self.split.unit_group[u])
        path = self.split.files[f]
        where = f"shard {path}, row group {g}"
        try:
            # A handle per read: read-ahead threads share nothing, and the cached footer makes
            # opening cheap.
            with pq.ParquetFile(path, metadata=self.split.metadata[f], memory_map=True) as pf:
                table = pf.read_row_group(g, columns=[c.name for c in self.columns])
        except Exception as exc:
            raise DataError(f"{where}: {exc}") from None
        return {c.name: to_numpy(table.column(c.name), c, where) for c in self.columns}

    def _build(self, b: int) -> dict[str, np.ndarray]:
        k = self.plan.block_units
        units = self.plan.unit_perm[b * k : (b + 1) * k]
        if len(units) == 1:
            return self._decode(int(units[0]))  # nothing to mix: the decoded arrays as they are
        rows = int(self.split.unit_rows[units].sum())
        data = {c.name: np.empty((rows, *c.shape), dtype=c.dtype) for c in self.columns}
        for u in units:
            lo = int(self.unit_pos[u])
            for name, values in self._decode(int(u)).items():
                data[name][lo : lo + len(values)] = values
        return data

    def block(self, b: int) -> dict[str, np.ndarray]:
        data = self.blocks.pop(b, None)
        if data is None:
            future = self.pending.pop(b, None)
            data = future.result() if future is not None else self._build(b)
            if len(self.blocks) >= self.BLOCKS_HELD:
                self.blocks.popitem(last=False)
        self.blocks[b] = data
        ahead = b + 1
        if ahead < self.n_blocks and ahead not in self.blocks and ahead not in self.pending:
            self.pending[ahead] = self.pool.submit(self._build, ahead)
        return data

    def gather(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        units = np.searchsorted(self.split.unit_start, rows, side="right") - 1
        pos = self.unit_pos[units] + (rows - self.split.unit_start[units])
        blocks = self.block_of_unit[units]
        first = int(blocks[0])
        if (blocks == first).all():
            table = self.block(first)
            lo = int(pos[0])
            if pos[-1] - lo == len(pos) - 1 and (np.diff(pos) == 1).all():
                # A run in storage order: views, no copy. Safe to send zero-copy, since block
                # tables are never written to once built.
                return {c.name: table[c.name][lo : lo + len(pos)] for c in self.columns}
            return {c.name: table[c.name].take(pos, axis=0) for c in self.columns}
        out = {c.name: np.empty((len(rows), *c.shape), dtype=c.dtype) for c in self.columns}
        # In order of first appearance, so the block held longest is the one released first.
        _, firsts = np.unique(blocks, return_index=True)
        for b in blocks[np.sort(firsts)]:
            mask = blocks == b
            table = self.block(int(b))
            for c in self.columns:
                out[c.name][mask] = table[c.name][pos[mask]]
        return out

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
        self.blocks.clear()
