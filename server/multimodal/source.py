"""Serve the aligned windows of a converted multimodal dataset (``fuelline convert``'s output).

Units are recordings: a recording's valid windows are known at start-up (from its timestamps
alone), so the epoch plan, sharding and batch counts are those of every other unit source. A
recording's windows are computed when its block is read (ahead of need, off the serving thread).

Sources per batch of B windows of ``w`` seconds: ``eeg`` float32 [B,14,128·w], ``ecg`` [B,2,256·w],
``gsr`` [B,1,4·w], ``video`` [B,30·w,D], ``label`` int64 [B], ``sample_id`` int64 [B] (recording
index × 1 000 000 + window index: the same in every epoch and after any restart) and ``t_start``
float64 [B] (window start, master clock), plus whatever the user's stages add.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fuelline.protocol import DataError, OptionError
from fuelline.server.multimodal.align import Signal, Validity, WindowSpec, resample, validity
from fuelline.server.multimodal.grid import cut_windows, grid_arrays, points_per_hop, shaped
from fuelline.server.multimodal.manifest import MODALITIES, NEAREST, Manifest, Recording
from fuelline.server.multimodal.stages import Cast, Normalize, Pipeline, Stage
from fuelline.server.sources.block_reader import ROWS
from fuelline.server.sources.blocks import UnitSource
from fuelline.server.sources.fingerprint import (
    callable_name,
    content_part,
    digest,
    files_part,
    grid_footers_part,
    open_for_footer,
    read_parquet_footer,
    skipped_summary,
    stage_code_part,
    text_part,
    unit_parts,
)
from fuelline.server.sources.options import SourceOptions
from fuelline.server.sources.stage_pool import StagePool
from fuelline.server.sources.storage import Store, storage_info

__all__ = ["WindowSource", "SAMPLE_ID_STRIDE", "stored_samples"]

log = logging.getLogger("fuelline.server")

SAMPLE_ID_STRIDE = 1_000_000  # windows per recording that sample ids leave room for
REMOTE_GRID_FILES = 64  # a remote dataset's grid files kept mapped (a block's recordings need at most 8 × 4)


def stored_samples(column: Any, channels: int, where: str) -> np.ndarray:
    """A row group's ``x`` column as (samples, channels) float32: fixed-size binary rows of
    little-endian float32 (format 2) are viewed where they lie; fixed-size lists (format 1) are
    flattened."""
    x = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if pa.types.is_fixed_size_binary(x.type) and x.type.byte_width == 4 * channels:
        return np.frombuffer(x.buffers()[1], dtype="<f4", count=len(x) * channels,
                             offset=x.offset * x.type.byte_width).reshape(len(x), channels)
    if pa.types.is_fixed_size_list(x.type) and x.type.list_size == channels and pa.types.is_float32(x.type.value_type):
        return x.flatten().to_numpy().reshape(len(x), channels)
    raise DataError(f"{where}: column x is {x.type}, the manifest says {channels} float32 channels")


@dataclass(frozen=True)
class WindowColumn:
    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_schema(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape)}


@dataclass
class _WindowSplit:
    recordings: list[tuple[int, Recording]]  # (index in the manifest, recording)
    windows: list[Validity]
    unit_rows: np.ndarray


class WindowSource(UnitSource):
    """Aligned, windowed, normalised batches of a converted dataset, deterministically ordered.

    Args:
        path: the dataset root (holding manifest.json): a local path or a URI such as
            ``s3://bucket/prefix`` (see ``fuelline.server.sources.storage``).
        window, hop, max_gap: see ``fuelline.server.multimodal.align``.
        normalize: "zscore" (per channel, train-split statistics) or "none".
        stages: user stages run on every batch after normalisation (see ``stages``).
        options, **overrides: the options of every unit source (``SourceOptions``).
        workers, prefetch, decoded_cache_mb, worker_timeout: as for every unit source
            (``fuelline.server.sources.blocks.UnitSource``).
        cache_dir, cache_mb: the disk cache of a remote dataset (``fuelline.server.cache.disk``).
    """

    # The per-batch stages run here, never in worker processes; mapped files are not copied there.
    _serving_only = ("pipeline", "_grid_files", "_grid_lock")

    def __init__(
        self,
        path: str,
        *,
        window: float = 2.0,
        hop: float = 1.0,
        max_gap: int = 2,
        normalize: str = "zscore",
        stages: Sequence[Stage] = (),
        options: SourceOptions | None = None,
        **overrides: Any,
    ) -> None:
        options = SourceOptions.of(options, **overrides)
        super().__init__(options)
        if normalize not in ("zscore", "none"):
            raise OptionError("normalize", f"must be zscore or none, got {normalize!r}")
        self.spec = WindowSpec(window, hop, max_gap)
        self.root = path
        self.store = Store(path, cache_dir=options.cache_dir, cache_mb=options.cache_mb, counters=self.counters)
        self._footers: dict[str, Any] = {}
        self._footer_digests: dict[str, str] = {}  # per shard: the xxh3 of its footer, for the fingerprint
        self.manifest = Manifest.load(self.store)
        self.normalize = normalize
        self.modalities = [m for m in MODALITIES if m in self.manifest.modalities]
        missing = sorted(set(MODALITIES) - set(self.modalities))
        if missing:
            raise DataError(f"{self.store.where()}: the manifest lacks modalities {missing}")
        # Windows are cut from each modality's master grid where the hop is a whole number of its
        # periods (``fuelline.server.multimodal.grid``), else resampled one by one.
        self.steps = {m: points_per_hop(self.spec, self.manifest.modalities[m].rate) for m in self.modalities}
        # Normalisation works sample by sample: windows cut from grids come z-scored from the
        # dataset (``zgrid`` files, by the same operations), freshly resampled ones are normalised
        # in place where they are made. Then, per batch, the user's stages and the cast.
        self.per_recording = Pipeline([Normalize(self.manifest.stats, in_place=True)] if normalize == "zscore" else [])
        self.pipeline = Pipeline([*stages, Cast()])
        self._grid_files: OrderedDict[str, Any] = OrderedDict()  # grid files, mapped once
        self._grid_lock = threading.Lock()
        self.stage_names = [callable_name(s) for s in stages]  # as --stage names them, for the fingerprint
        self.stage_code = stage_code_part(stages)  # and what they compute
        self.user_stages = tuple(self.stage_names)  # (a serving loop has them run on its stage pool)
        self._base = self._base_columns()
        self._splits = {name: self._scan(name) for name in self.manifest.splits}
        if not self._splits:
            raise DataError(f"{self.store.where()}: the manifest lists no recordings")
        self._columns = self._probe_columns()
        self._fingerprints = {name: self._fingerprint(name) for name in self._splits}

    # -- start-up --------------------------------------------------------------------------------
    def _base_columns(self) -> list[WindowColumn]:
        cols = []
        for m in self.modalities:
            mod = self.manifest.modalities[m]
            n, c = self.spec.points(mod.rate), len(mod.channels)
            cols.append(WindowColumn(m, "<f4", (n, c) if m in NEAREST else (c, n)))
        cols += [WindowColumn("label", "<i8", ()), WindowColumn("sample_id", "<i8", ()), WindowColumn("t_start", "<f8", ())]
        return cols

    def _read(self, rec: Recording, modality: str, columns: list[str], ranged: bool = False) -> Any:
        """One row group's columns. A remote file is read from its disk-cache copy, or, with
        ``ranged`` (the start-up scan, which needs only ``t``), by range from the remote store."""
        p = rec.modalities[modality]
        path = self.store.where(p.file)
        try:
            # The footer parsed once per file, and a plain memory map: reads share nothing else,
            # so the read-ahead threads need no lock.
            meta = self._footers.get(path)
            if meta is None:
                with open_for_footer(self.store, p.file) as handle:  # the footer alone, by range where remote
                    meta, footer = read_parquet_footer(handle)
                self._footer_digests.setdefault(path, footer)
                meta = self._footers.setdefault(path, meta)
            if not self.store.remote:
                source = pa.memory_map(path)
            else:
                source = self.store.open(p.file) if ranged else self.store.open_local(p.file)
            with pq.ParquetFile(source, metadata=meta) as pf:
                return pf.read_row_group(p.row_group, columns=columns)
        except Exception as exc:
            raise DataError(f"shard {path}, row group {p.row_group} (recording {rec.id}, {modality}): {exc}") from None

    def _grid(self, rec: Recording, modality: str) -> np.ndarray:
        """A recording's master grid of one modality, as stored: (channels, points), or (points,
        features) for video; a read-only view of the mapped file."""
        p = rec.modalities[modality]
        channels = len(self.manifest.modalities[modality].channels)
        shape = (p.grid_points, channels) if modality in NEAREST else (channels, p.grid_points)
        file = p.zgrid_file if self.normalize == "zscore" else p.grid_file
        where = f"grid {self.store.where(file)}"
        if self._grid_files is None:  # (a worker process's copy)
            self._grid_files, self._grid_lock = OrderedDict(), threading.Lock()
        # A file is mapped once, not per recording: a fresh map faults in every page a window
        # touches, which cost a remote dataset 0.07 ms a window. A local dataset's files stay
        # mapped; a remote one's disk-cache copies, the REMOTE_GRID_FILES used last (a copy the
        # cache evicts meanwhile keeps its disk space until it is let go here).
        with self._grid_lock:
            grids = self._grid_files.get(file)
            if grids is not None:
                self._grid_files.move_to_end(file)
        if grids is None:
            try:
                grids = grid_arrays(self.store.open_local(file), where)
            except OSError as exc:
                raise DataError(f"{where}: {exc}") from None
            with self._grid_lock:
                grids = self._grid_files.setdefault(file, grids)
                while self.store.remote and len(self._grid_files) > REMOTE_GRID_FILES:
                    self._grid_files.popitem(last=False)
        return shaped(grids, p.row_group, shape, f"{where} (recording {rec.id}, {modality})")

    def _signals(self, rec: Recording, with_samples: bool, only: Sequence[str] | None = None) -> dict[str, Signal]:
        out = {}
        for m in self.modalities if only is None else only:
            table = self._read(rec, m, ["t", "x"] if with_samples else ["t"], ranged=not with_samples)
            t = table.column("t").to_numpy()
            if with_samples:
                p = rec.modalities[m]
                x = stored_samples(table.column("x"), len(self.manifest.modalities[m].channels),
                             f"shard {self.store.where(p.file)}, row group {p.row_group} (recording {rec.id}, {m})")
            else:
                x = np.empty((len(t), 0), dtype=np.float32)
            out[m] = Signal(t, x, float(self.manifest.modalities[m].rate), nearest=m in NEAREST)
        return out

    def _scan(self, split: str) -> _WindowSplit:
        recs, windows = [], []
        for i, r in enumerate(self.manifest.recordings):
            if r.split != split:
                continue
            try:
                v = validity(self._signals(r, with_samples=False), self.spec)
            except DataError as exc:
                if self.on_bad_shard != "skip":
                    raise
                log.warning("leaving out recording %s: %s (--on-bad-shard skip)", r.id, exc)
                self.skipped.append({"split": split, "recording": r.id, "reason": str(exc)})
                continue
            recs.append((i, r))
            windows.append(v)
        rows = np.array([int(v.valid.sum()) for v in windows], dtype=np.int64)
        return _WindowSplit(recs, windows, rows)

    def _probe_columns(self) -> dict[str, WindowColumn]:
        """What the pipeline serves: run it once on two windows of the first recording that has any."""
        for split in self._splits.values():
            for u, rows in enumerate(split.unit_rows):
                if rows:
                    out = self.pipeline(self._windows(split, u, limit=2))
                    return {
                        k: WindowColumn(k, np.asarray(v).dtype.str, tuple(np.asarray(v).shape[1:])) for k, v in out.items()
                    }
        raise DataError(f"{self.store.where()}: no valid window in any recording with --window {self.spec.length} --hop {self.spec.hop}")

    # -- windows ---------------------------------------------------------------------------------
    def _windows(self, split: _WindowSplit, u: int, limit: int | None = None) -> dict[str, np.ndarray]:
        """A recording's valid windows, every source. Where they come in several runs (a device
        dropped out in between) and ``limit`` is None, the arrays hold every window from the
        first valid to the last, views of the grids rather than copies, and ``ROWS`` says which
        rows are served."""
        index, rec = split.recordings[u]
        v = split.windows[u]
        k = np.flatnonzero(v.valid)[:limit]
        gaps = limit is None and len(k) > 0 and int(k[-1] - k[0]) + 1 > len(k)
        held = np.arange(k[0], k[-1] + 1) if gaps else k  # the windows the arrays hold
        resampled = [m for m in self.modalities if self.steps[m] is None]
        signals = self._signals(rec, with_samples=True, only=resampled) if resampled else {}
        # video (windows, points, features), the others (windows, channels, points)
        made = {m: resample(sig, v.starts[k], self.spec, channels_first=m not in NEAREST) for m, sig in signals.items()}
        made = self.per_recording(made)
        out: dict[str, np.ndarray] = {}
        for m in self.modalities:
            step = self.steps[m]
            if step is not None:
                out[m] = cut_windows(self._grid(rec, m), held, step, self.spec.points(self.manifest.modalities[m].rate), m in NEAREST)
            elif gaps:  # (the rows of invalid windows are never served)
                out[m] = np.zeros((len(held), *made[m].shape[1:]), dtype=made[m].dtype)
                out[m][k - k[0]] = made[m]
            else:
                out[m] = made[m]
        out["label"] = np.full(len(held), self.manifest.label(rec), dtype=np.int64)
        out["sample_id"] = index * SAMPLE_ID_STRIDE + held.astype(np.int64)
        out["t_start"] = v.starts[held]
        if gaps:
            out[ROWS] = (k - k[0]).astype(np.int64)
        for arr in out.values():
            # Decoded windows are shared (by the batches cut from them, by every client through
            # the decoded units): read-only, so that nothing shared is ever written.
            arr.setflags(write=False)
        return out

    def windows(self, split: str, u: int) -> dict[str, np.ndarray]:
        """Recording ``u``'s valid windows, every source, one row per window, as the server
        decodes them (aligned and normalised, before the per-batch stages): for code that builds
        its own batches from them."""
        out = self._windows(self._splits[split], u)
        served = out.pop(ROWS, None)
        return out if served is None else {k: a[served] for k, a in out.items()}

    def recording(self, split: str, u: int) -> tuple[dict[str, Signal], np.ndarray]:
        """Recording ``u`` of a split as stored (every modality's master times and samples) and
        the starts of its valid windows: what any other implementation of alignment needs to
        compute the same windows."""
        s = self._splits[split]
        v = s.windows[u]
        return self._signals(s.recordings[u][1], with_samples=True), v.starts[v.valid]

    # -- UnitSource ------------------------------------------------------------------------------
    def unit_rows(self, split: str) -> np.ndarray:
        return self._splits[split].unit_rows

    def column_specs(self, sources: tuple[str, ...]) -> Sequence[WindowColumn]:
        return self._base  # stages may need any of them, whatever the client asked for

    def describe_unit(self, split: str, u: int) -> str:
        _, rec = self._splits[split].recordings[u]
        return f"recording {rec.id}"

    def decode_unit(self, split: str, u: int, columns: Sequence[Any]) -> dict[str, np.ndarray]:
        return self._windows(self._splits[split], u)

    def prefetch_units(self, split: str, units: Sequence[int]) -> None:
        """Fetch the files of these recordings into the disk cache in the background (remote only)."""
        if self.store.remote:
            recordings = self._splits[split].recordings
            files = (
                p.file if self.steps[m] is None else (p.zgrid_file if self.normalize == "zscore" else p.grid_file)
                for u in units for m, p in recordings[int(u)][1].modalities.items() if m in self.steps
            )
            self.store.prefetch(dict.fromkeys(files))


    def _stages_made(self, pool: StagePool) -> None:
        self.pipeline.observer = pool  # (the time each stage takes, and which one a batch is in)

    def finish_batch(self, split: str, batch: dict[str, np.ndarray], sources: tuple[str, ...]) -> dict[str, np.ndarray]:
        out = self.pipeline(batch)
        return {k: out[k] for k in sources}

    # -- BatchSource -----------------------------------------------------------------------------
    def dropped(self, split: str) -> dict[str, int]:
        """Invalid windows of a split, by reason."""
        counts: Counter[str] = Counter()
        for v in self._splits[split].windows:
            counts.update(r for r in v.reason if r)
        return dict(sorted(counts.items()))

    def windows_per_class(self, split: str) -> dict[str, int]:
        s = self._splits[split]
        counts = {e: 0 for e in self.manifest.emotions}
        for (_, rec), rows in zip(s.recordings, s.unit_rows):
            counts[rec.emotion] += int(rows)
        return counts

    def info(self, split: str) -> Mapping[str, Any]:
        s = self._splits[split]
        return {
            "kind": "multimodal-windows",
            "split": split,
            "splits": {name: int(sp.unit_rows.sum()) for name, sp in self._splits.items()},
            "rows": int(s.unit_rows.sum()),
            "recordings": len(s.recordings),
            "emotions": list(self.manifest.emotions),
            "class_counts": self.windows_per_class(split),
            "dropped": self.dropped(split),
            **skipped_summary(self.skipped, split, "skipped_recordings"),
            "window": self.spec.length,
            "hop": self.spec.hop,
            "max_gap": self.spec.max_gap,
            "normalize": self.normalize,
            "stages": self.per_recording.names + self.pipeline.names,
            "rates": {m: self.manifest.modalities[m].rate for m in self.modalities},
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "order": self.order_version,
            "storage": storage_info(self.store),
        }

    def fingerprint(self, split: str) -> dict[str, str]:
        """What decides the sequence of a split (see ``fuelline.server.sources.fingerprint``): the
        manifest's content and format, the split's shards (relative names, sizes, footers), the
        footers of the grid files its windows are cut from, its recordings, the windowing,
        normalisation and stages (names and code), seed, batch size and shuffle."""
        return dict(self._fingerprints[split])

    def _fingerprint(self, split: str) -> dict[str, str]:
        recordings = [rec for _, rec in self._splits[split].recordings]
        shards = sorted({rec.modalities[m].file for rec in recordings for m in self.modalities})
        grids = sorted({p.zgrid_file if self.normalize == "zscore" else p.grid_file  # (the ones windows are cut from)
                        for rec in recordings for m, p in rec.modalities.items() if self.steps.get(m) is not None})
        return {
            "kind": "multimodal-windows",
            "split": split,
            "format": self.manifest.format,
            # The manifest as parsed, in a canonical form: how its file is laid out orders nothing.
            "manifest": "#" + digest([self.manifest.to_json()]),
            "shards": files_part([self.store.stat(f) for f in shards]),
            # What the shards and grids hold, from their footers: those of the shards were read by
            # the scan, those of the grids are read here (their ends, never their grids).
            "footers": content_part([self._footer_digests[self.store.where(f)] for f in shards]),
            "grids": grid_footers_part(self.store, grids),
            "recordings": f"{len(recordings)} #{digest(rec.id for rec in recordings)}",
            "window": repr(float(self.spec.length)),
            "hop": repr(float(self.spec.hop)),
            "max_gap": str(self.spec.max_gap),
            "normalize": self.normalize,
            "stages": text_part(",".join(self.stage_names)),
            "stage_code": self.stage_code,
            **unit_parts(self.batch_size, self.seed, self.shuffle, self.shuffle_block, self.order_version),
        }

    def memory_per_client(self, split: str) -> int:
        """Bytes of windows one client's reader holds at most: three blocks of the largest recordings."""
        row = sum(int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize for c in self._base)
        top = np.sort(self._splits[split].unit_rows)[::-1][: 3 * self.shuffle_block]
        return int(top.sum()) * row
