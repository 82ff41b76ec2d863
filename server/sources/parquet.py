"""Serve a directory of Parquet files.

Layout of a dataset directory: either Parquet files directly inside it (one split, ``train``), or
one subdirectory per split (``train/``, ``val/``...) holding Parquet files. Numeric and
fixed-size-list columns become sources (see ``fuelline.server.sources.columns``). A unit of reading is one
row group; the order of an epoch is ``fuelline.server.sources.ordering.epoch_order``.

With ``stages`` (``fuelline serve DATASET --stage mod:fn``), every batch goes through the user's
preprocessing stages (``fuelline.server.multimodal.stages``: ``f(batch) -> batch``, in order) on
the stage pool, never on the serving loop: they get every servable column, and what they return
is what is served. What that is (names, dtypes, shapes) is learnt at start-up from the stages run
once on two rows; a later batch whose arrays differ in name or shape is an error that names the
stages, and one whose dtypes differ is cast to the learnt ones.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow.parquet as pq

from fuelline.protocol import DataError
from fuelline.server.sources.block_reader import BlockReader
from fuelline.server.sources.blocks import UnitSource
from fuelline.server.sources.columns import ColumnSpec, column_spec, to_numpy
from fuelline.server.sources.fingerprint import (
    callable_name,
    content_part,
    files_part,
    open_for_footer,
    read_parquet_footer,
    skipped_summary,
    stage_code_part,
    text_part,
    unit_parts,
)
from fuelline.server.sources.options import SourceOptions
from fuelline.server.sources.storage import FileStat, Store, storage_info

__all__ = ["ParquetSource", "find_splits", "TABLE_METADATA_KEY", "label_classes"]

log = logging.getLogger("fuelline.server")

DEFAULT_SPLIT = "train"
# A file's key-value metadata written by ``fuelline import`` (``fuelline.server.ingest.tables``):
# JSON with the label column's name, its class names where they were strings, and its counts.
TABLE_METADATA_KEY = b"fuelline.table"


# Class facts are left out of a split's info beyond this many bytes of JSON: a client's Welcome
# header (at most 64 KiB) must hold them with the rest, and a label of so many classes is most
# likely an id.
MAX_CLASS_FACTS_BYTES = 16 * 1024


def _table_facts(meta: Any) -> dict[str, Any] | None:
    """What ``fuelline import`` wrote into one file's footer, or None where there is nothing of
    that shape (a file is bad input: its facts are left out, never a reason to refuse it)."""
    raw = (meta.metadata or {}).get(TABLE_METADATA_KEY)
    try:
        said = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(said, dict) or not isinstance(said.get("label"), str):
        return None
    classes, counts = said.get("classes"), said.get("counts", {})
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        return None
    counts_ok = isinstance(counts, dict) and all(
        isinstance(k, str) and k.isdigit() and type(n) is int and n >= 0 for k, n in counts.items())
    return said if counts_ok else None


def _summed_counts(described: list[dict[str, Any]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for d in described:
        for key, n in d.get("counts", {}).items():
            counts[int(key)] = counts.get(int(key), 0) + n
    return counts


def label_classes(metadata: Sequence[Any]) -> dict[str, Any]:
    """The label facts of a split from its files' footers (``pq.FileMetaData``): ``label`` (the
    column), ``class_counts`` ({class name: rows}) and ``class_names`` (in class index order,
    where the classes are 0..C-1); empty unless every file says the same label."""
    said = [_table_facts(meta) for meta in metadata]
    described = [d for d in said if d is not None]
    if not said or len(described) < len(said):
        return {}
    first = described[0]
    if len({(d["label"], json.dumps(d.get("classes"))) for d in described}) > 1:
        return {}
    counts = _summed_counts(described)
    names = first.get("classes")
    if names is None and counts and max(counts) == len(counts) - 1:  # (distinct keys >= 0: exactly 0..C-1)
        names = [str(c) for c in range(len(counts))]
    if names is None:
        facts = {"label": first["label"], "class_counts": {str(c): n for c, n in sorted(counts.items())}}
    else:
        facts = {"label": first["label"], "class_names": list(names),
                 "class_counts": {name: counts.get(i, 0) for i, name in enumerate(names)}}
    return facts if len(json.dumps(facts)) <= MAX_CLASS_FACTS_BYTES else {"label": first["label"]}


def _parquet_files(store: Store, folder: str) -> list[str]:
    return [f.rel for f in store.list(folder)[0] if f.rel.endswith(".parquet")]


def find_splits(path: str | Store) -> dict[str, list[str]]:
    """Map split name to its Parquet files, per the layout in this module's docstring. With a path,
    the files are paths; with a ``Store``, paths relative to its root ("" for a single-file dataset)."""
    if isinstance(path, Store):
        return _find_splits(path)
    store = Store(path)
    return {k: [store.where(rel) for rel in v] for k, v in _find_splits(store).items()}


def _find_splits(store: Store) -> dict[str, list[str]]:
    where = store.where()
    kind = store.kind()
    if kind is None:
        raise DataError(store.missing())
    if kind == "file":
        if not where.endswith(".parquet"):
            raise DataError(f"dataset {where!r} is a file but not a .parquet file")
        return {DEFAULT_SPLIT: [""]}
    files, subdirs = store.list()
    top = [f.rel for f in files if f.rel.endswith(".parquet")]
    nested = {d: _parquet_files(store, d) for d in subdirs}
    nested = {d: files for d, files in nested.items() if files}
    if top and nested:
        raise DataError(
            f"dataset {where!r} holds Parquet files both at its top and in split folders "
            f"{sorted(nested)}; put every file in a split folder"
        )
    if top:
        return {DEFAULT_SPLIT: top}
    if not nested:
        raise DataError(f"dataset {where!r} holds no .parquet files (neither directly nor in split folders)")
    return nested


@dataclass
class _ParquetSplit:
    name: str
    files: list[str]  # per file: how messages name it (its path, or its URI)
    rels: list[str]  # per file: its path relative to the dataset root, for the store
    unit_file: np.ndarray  # per unit: index into files
    unit_group: np.ndarray  # per unit: row group index within its file
    unit_rows: np.ndarray
    unit_start: np.ndarray  # per unit: global row id of its first row
    rows: int
    disk_bytes: int
    max_unit_bytes: int  # uncompressed bytes of the largest row group
    metadata: list  # per file: its parsed footer, so opening it again parses nothing
    footers: list[str]  # per file: the xxh3 of its footer as stored, for the fingerprint
    sizes: list[FileStat]  # per file: its size when its footer was read


class ParquetSource(UnitSource):
    """Batches of a Parquet dataset, deterministically ordered, sharded per rank.

    Args:
        path: the dataset directory (or one .parquet file): a local path or a URI such as
            ``s3://bucket/prefix`` (see ``fuelline.server.sources.storage``).
        options: the options of every unit source (``SourceOptions``: batch size, seed, shuffle,
            shuffle block, workers, caches...); the last batch of an epoch may be shorter, and
            ``shuffle_block`` row groups are mixed together (bounding memory per client to
            ``3 × shuffle_block`` decoded row groups and a few batches: ``memory_per_client``).
        stages: the user's preprocessing stages, ``f(batch) -> batch`` each, run in order on every
            batch (see this module's docstring); they may replace, add or drop arrays.
        **overrides: any of those options by name (``ParquetSource(path, batch_size=32)``).

    Raises:
        OptionError: an option out of range, naming it.
        TypeError: an override that is not an option.
        DataError: the path holds no Parquet, files disagree on a column's type, a split is empty,
            or the stages fail (or return what cannot be served) on the first rows.
    """

    # The stages run in the serving process only: worker processes decode row groups.
    _serving_only = ("pipeline",)

    def __init__(self, path: str, options: SourceOptions | None = None, *,
                 stages: Sequence[Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]] = (),
                 **overrides: Any) -> None:
        options = SourceOptions.of(options, **overrides)
        super().__init__(options)
        self.path = path
        self.store = Store(path, cache_dir=options.cache_dir, cache_mb=options.cache_mb, counters=self.counters)
        self._columns: dict[str, ColumnSpec] = {}
        self.unservable: dict[str, str] = {}
        self._splits = {name: self._scan(name, files) for name, files in find_splits(self.store).items()}
        self._labels = {name: label_classes(sp.metadata) for name, sp in self._splits.items()}
        if not self._columns:
            raise DataError(
                f"dataset {self.store.where()!r} has no servable columns: " + "; ".join(self.unservable.values())
            )
        for reason in self.unservable.values():
            log.warning("not serving %s", reason)
        self._read = dict(self._columns)  # what is decoded from the files
        self.stage_names = [callable_name(s) for s in stages]  # as --stage names them, for the fingerprint
        self.stage_code = stage_code_part(stages)  # and what they compute
        self.user_stages = tuple(self.stage_names)  # (a serving loop has them run on its stage pool)
        self.pipeline = None
        if stages:
            from fuelline.server.multimodal.stages import Pipeline

            self.pipeline = Pipeline(stages)
            self._columns = self._probe()
        # Taken from the files as scanned: what this server's positions mean from now on.
        self._fingerprints = {name: self._fingerprint(sp) for name, sp in self._splits.items()}

    # -- scanning ----------------------------------------------------------------------------
    def _scan(self, split: str, rels: list[str]) -> _ParquetSplit:
        unit_file, unit_group, unit_rows, unit_bytes, metadata, footers = [], [], [], [], [], []
        sizes: list[FileStat] = []
        disk = 0
        kept: list[str] = []
        kept_rels: list[str] = []
        for rel in rels:
            f = self.store.where(rel)
            try:
                try:
                    with open_for_footer(self.store, rel) as handle:  # the footer alone, by range where remote
                        meta, footer = read_parquet_footer(handle)
                        size = handle.size()
                    schema = meta.schema.to_arrow_schema()
                except Exception as exc:
                    raise DataError(f"shard {f}: not a readable Parquet file ({exc})") from None
                self._check_schema(f, schema)
            except DataError as exc:
                if self.on_bad_shard != "skip":
                    raise
                log.warning("leaving out %s (--on-bad-shard skip)", exc)
                self.skipped.append({"split": split, "file": f, "reason": str(exc)})
                continue
            i = len(kept)
            kept.append(f)
            kept_rels.append(rel)
            metadata.append(meta)
            footers.append(footer)
            sizes.append(FileStat(rel, size, None))
            disk += size
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                if rg.num_rows:
                    unit_file.append(i)
                    unit_group.append(g)
                    unit_rows.append(rg.num_rows)
                    unit_bytes.append(rg.total_byte_size)
        rows = np.asarray(unit_rows, dtype=np.int64)
        if not rows.sum():
            raise DataError(f"split {split!r} of dataset {self.store.where()!r} holds no rows")
        return _ParquetSplit(
            name=split,
            files=kept,
            rels=kept_rels,
            unit_file=np.asarray(unit_file, dtype=np.int64),
            unit_group=np.asarray(unit_group, dtype=np.int64),
            unit_rows=rows,
            unit_start=np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64),
            rows=int(rows.sum()),
            disk_bytes=disk,
            max_unit_bytes=max(unit_bytes),
            metadata=metadata,
            footers=footers,
            sizes=sizes,
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

    # -- stages ------------------------------------------------------------------------------
    def _probe(self) -> dict[str, ColumnSpec]:
        """What the stages serve: run them once on the first two rows of the first row group."""
        assert self.pipeline is not None
        sp = next(sp for sp in self._splits.values() if sp.rows)
        u = int(np.flatnonzero(sp.unit_rows)[0])
        rows = {k: v[:2] for k, v in self.decode_unit(sp.name, u, list(self._read.values())).items()}
        out = self.pipeline(rows)
        specs = {}
        for name, value in out.items():
            arr = np.asarray(value)
            if arr.ndim == 0 or len(arr) != 2 or arr.dtype.hasobject or arr.dtype.kind not in "biuf":
                raise DataError(f"stages {', '.join(self.stage_names)}: {name!r} of the first two rows of "
                                f"{self.describe_unit(sp.name, u)} is {arr.dtype} of shape {arr.shape}, not one "
                                f"number or fixed-shape array per row")
            specs[name] = ColumnSpec(name, arr.dtype.str, tuple(arr.shape[1:]), "stage output")
        if not specs:
            raise DataError(f"stages {', '.join(self.stage_names)} returned no arrays")
        return specs

    def _stages_made(self, pool: Any) -> None:
        if self.pipeline is not None:
            self.pipeline.observer = pool  # (the time each stage takes, and which one a batch is in)

    def finish_batch(self, split: str, batch: dict[str, np.ndarray], sources: tuple[str, ...]) -> dict[str, np.ndarray]:
        if self.pipeline is None:
            return batch
        rows = len(next(iter(batch.values())))
        out = self.pipeline(batch)
        served = {}
        for name in sources:
            spec = self._columns[name]
            arr = np.asarray(out[name]) if name in out else None
            if arr is None or arr.shape != (rows, *spec.shape):
                what = "no such array" if arr is None else f"shape {arr.shape}"
                raise DataError(f"stages {', '.join(self.stage_names)} returned {name!r} with {what} for a batch "
                                f"of {rows} rows of split {split!r}; they served {(rows, *spec.shape)} at start-up")
            served[name] = arr.astype(spec.dtype, copy=False)
        return served

    # -- BatchSource -------------------------------------------------------------------------
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
            "max_row_group_bytes": s.max_unit_bytes,
            "disk_bytes": s.disk_bytes,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_block": self.shuffle_block,
            "order": self.order_version,
            **self._labels[split],
            **({"stages": list(self.stage_names)} if self.stage_names else {}),
            **skipped_summary(self.skipped, split, "skipped_shards"),
            "storage": storage_info(self.store),
        }

    def fingerprint(self, split: str) -> dict[str, str]:
        """What decides the sequence of a split (see ``fuelline.server.sources.fingerprint``): its files
        (relative names and sizes) and their footers, the stages (names and code), seed, batch
        size and shuffle."""
        return dict(self._fingerprints[split])

    def _fingerprint(self, sp: _ParquetSplit) -> dict[str, str]:
        return {
            "kind": "parquet",
            "split": sp.name,
            "files": files_part(sp.sizes),
            # What they hold, from the footers read at start-up: no second read of any file.
            "footers": content_part(sp.footers),
            "stages": text_part(",".join(self.stage_names)),
            "stage_code": self.stage_code,
            **unit_parts(self.batch_size, self.seed, self.shuffle, self.shuffle_block, self.order_version),
        }

    def memory_per_client(self, split: str) -> int:
        """Upper bound of the bytes one client's reader holds: the decoded row groups of two
        blocks in use (where a batch straddles them) and of one being read ahead, and the
        batches gathered at once from them (``BlockReader.batches_at_once``)."""
        columns = self.column_specs(self.sources)
        row_bytes = sum(int(np.prod(c.shape, dtype=np.int64)) * np.dtype(c.dtype).itemsize for c in columns)
        gathered = BlockReader.batches_at_once(columns, self.batch_size) * self.batch_size * row_bytes
        return 3 * self.shuffle_block * self._splits[split].max_unit_bytes + gathered

    # -- UnitSource ---------------------------------------------------------------------------
    def unit_rows(self, split: str) -> np.ndarray:
        return self._splits[split].unit_rows

    def column_specs(self, sources: tuple[str, ...]) -> list[ColumnSpec]:
        if self.pipeline is not None:
            return list(self._read.values())  # stages may need any of them, whatever the client asked for
        return [self._columns[n] for n in sources]

    def describe_unit(self, split: str, u: int) -> str:
        sp = self._splits[split]
        return f"shard {sp.files[int(sp.unit_file[u])]}, row group {int(sp.unit_group[u])}"

    def decode_unit(self, split: str, u: int, columns: Sequence[Any]) -> dict[str, np.ndarray]:
        sp = self._splits[split]
        f, g = int(sp.unit_file[u]), int(sp.unit_group[u])
        path = sp.files[f]
        where = f"shard {path}, row group {g}"
        try:
            # A handle per read: read-ahead threads share nothing, and the cached footer makes
            # opening cheap. A remote file is read from its disk-cache copy, fetched if need be.
            source = self.store.open_local(sp.rels[f]) if self.store.remote else path
            with pq.ParquetFile(source, metadata=sp.metadata[f], memory_map=True) as pf:
                table = pf.read_row_group(g, columns=[c.name for c in columns])
        except Exception as exc:
            raise DataError(f"{where}: {exc}") from None
        return {c.name: to_numpy(table.column(c.name), c, where) for c in columns}

    def prefetch_units(self, split: str, units: Sequence[int]) -> None:
        """Fetch the files of these units into the disk cache in the background (remote only)."""
        if self.store.remote:
            sp = self._splits[split]
            self.store.prefetch(dict.fromkeys(sp.rels[int(sp.unit_file[u])] for u in units))


