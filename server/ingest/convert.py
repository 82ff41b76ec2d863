"""``fuelline convert RAW DATASET``: raw TSV recordings to a Parquet dataset with a manifest.

The layout written is the one ``fuelline.server.multimodal.manifest`` describes: per modality, one
Parquet file per shard of ``recordings_per_shard`` recordings, one row group per recording, so a
server can read any one recording's samples of any one device with a single row-group read.

Conversion is atomic: everything is written into a hidden folder beside DATASET and renamed onto
DATASET at the very end, and any failure (bad input, a full disk, Ctrl-C) removes that folder.
Servers and deploy scripts can therefore take "DATASET exists" to mean "DATASET is complete".
"""

from __future__ import annotations

import os
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Generator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from fuelline.protocol import DataError, OptionError
from fuelline.protocol.common.atomic import atomic_directory
from fuelline.protocol.common.diskspace import folder_bytes
from fuelline.protocol.common.threadnames import name_this_thread
from fuelline.server.ingest.rawformat import RawDataset, RawRecording, RawSignal, check_same_channels
from fuelline.server.multimodal.align import Signal
from fuelline.server.multimodal.grid import GridWriter, grid_file, recording_grids, write_zscored, zgrid_file
from fuelline.server.multimodal.manifest import (
    EMOTIONS,
    MANIFEST_NAME,
    MODALITIES,
    NEAREST,
    Manifest,
    Modality,
    Placement,
    Recording,
)
from fuelline.server.sources.fingerprint import CONTENT_KEY, ContentDigest

__all__ = ["convert", "assign_splits"]

# LZ4 decompresses several times faster than zstd; with byte stream split (the n-th bytes of
# all samples together, channel by channel) the files are as small as zstd made them from
# interleaved floats. A server decodes every row group once per epoch, so reading is what counts.
COMPRESSION = "lz4"
ENCODING = {"t": "BYTE_STREAM_SPLIT", "x": "BYTE_STREAM_SPLIT"}
READ_THREADS = 4
# A dataset takes about this many times the bytes of its raw folder (measured: 1.34-1.39 on synth
# output): LZ4 shards are smaller than the TSV, and the master grids, raw and z-scored, add more.
SIZE_OVER_RAW = 1.4


# -- splits and statistics ---------------------------------------------------------------------


def assign_splits(recordings: Sequence[RawRecording], val_fraction: float, seed: int) -> dict[str, str]:
    """Recording id -> "train" or "val", whole recordings, stratified by emotion.

    Windows of one recording are strongly correlated, so splitting below the recording would
    leak the validation set into training. Per emotion (in ``EMOTIONS`` order, recordings in
    file order), a generator seeded by ``seed`` shuffles that emotion's recordings and the first
    ``round(n * val_fraction)`` go to "val".
    """
    rng = np.random.default_rng(seed)
    splits = {r.id: "train" for r in recordings}
    for emotion in EMOTIONS:
        ids = [r.id for r in recordings if r.emotion == emotion]
        for i in rng.permutation(len(ids))[: round(len(ids) * val_fraction)]:
            splits[ids[i]] = "val"
    return splits


class RunningStats:
    """Per-channel mean and population standard deviation, accumulated recording by recording.

    Sums are float64 and taken around a shift (the first recording's mean), so that the sum of
    squares keeps its precision when a channel's mean is large against its spread.
    """

    def __init__(self) -> None:
        self.count = 0
        self._shift: np.ndarray | None = None
        self._sum: np.ndarray | None = None
        self._sum_sq: np.ndarray | None = None

    def add(self, x: np.ndarray) -> None:
        if self._shift is None:
            self.start(x.mean(axis=0, dtype=np.float64))
        self.add_sums(*self.sums(x))

    @property
    def shift(self) -> np.ndarray | None:
        return self._shift

    def start(self, shift: np.ndarray) -> None:
        """Take sums around ``shift`` from now on (``add`` takes the first recording's mean)."""
        self._shift = shift
        self._sum = np.zeros_like(shift)
        self._sum_sq = np.zeros_like(shift)

    def _started(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shift and the sums around it so far."""
        if self._shift is None or self._sum is None or self._sum_sq is None:
            raise RuntimeError("RunningStats: no shift to take sums around yet (start, or add, comes first)")
        return self._shift, self._sum, self._sum_sq

    def sums(self, x: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """One recording's samples, their sum and sum of squares around the shift: what ``add``
        adds, kept apart so that a conversion in parts can add them later in the same order."""
        shift, _, _ = self._started()
        d = x.astype(np.float64) - shift
        return len(x), d.sum(axis=0), np.einsum("ij,ij->j", d, d)

    def add_sums(self, count: int, total: np.ndarray, total_sq: np.ndarray) -> None:
        _, sum_so_far, sum_sq_so_far = self._started()
        sum_so_far += total  # (in place: the running sums themselves)
        sum_sq_so_far += total_sq
        self.count += count

    def result(self) -> dict[str, list[float]]:
        if not self.count:
            raise DataError("no samples to compute statistics from")
        shift, total, total_sq = self._started()
        mean_d = total / self.count
        var = np.maximum(total_sq / self.count - mean_d * mean_d, 0.0)
        return {"mean": (shift + mean_d).tolist(), "std": np.sqrt(var).tolist()}


# -- writing shards ----------------------------------------------------------------------------


def _schema(channels: int) -> pa.Schema:
    # ``x``: a sample's channels as little-endian float32 in one fixed-size value. A Parquet list
    # would say "float" in the schema, but decoding its repetition levels costs more than the
    # samples themselves; the field's metadata says what the bytes hold.
    x = pa.field("x", pa.binary(4 * channels), nullable=False,
                 metadata={"fuelline.dtype": "<f4", "fuelline.channels": str(channels)})
    return pa.schema([pa.field("t", pa.float64(), nullable=False), x])


def _table(t: np.ndarray, samples: np.ndarray) -> pa.Table:
    n, c = samples.shape
    x = pa.FixedSizeBinaryArray.from_buffers(pa.binary(4 * c), n, [None, pa.py_buffer(samples)])
    return pa.Table.from_arrays([pa.array(t, pa.float64()), x], schema=_schema(c))


def _stored(signals: Mapping[str, RawSignal]) -> dict[str, Signal]:
    """The signals as a server reads them back: float64 times, little-endian float32 samples."""
    return {
        m: Signal(np.asarray(s.t, dtype=np.float64), np.ascontiguousarray(s.x, dtype="<f4"), float(MODALITIES[m]),
                  nearest=m in NEAREST)
        for m, s in signals.items()
    }


class _Shard:
    """One shard's files, two per modality; each appended recording becomes one row group of its
    Parquet file and one record batch of its grid file (``fuelline.server.multimodal.grid``).
    Each Parquet file's key-value metadata holds the xxh3 of the samples written into it
    (``CONTENT_KEY``), so that its footer, which a server hashes into the sequence fingerprint,
    changes whenever they do.

    Writers open lazily because video's channel count is known only once a recording is read.
    """

    def __init__(self, root: str, number: int) -> None:
        self.root = root
        self.files = {m: f"{m}/part-{number:05d}.parquet" for m in MODALITIES}
        self.row_groups = 0
        self._writers: dict[str, pq.ParquetWriter] = {}
        self._digests = {m: ContentDigest() for m in MODALITIES}
        self._grids = {m: GridWriter(os.path.join(root, grid_file(f))) for m, f in self.files.items()}

    def _writer(self, modality: str, channels: int) -> pq.ParquetWriter:
        if modality not in self._writers:
            self._writers[modality] = pq.ParquetWriter(
                os.path.join(self.root, self.files[modality]), _schema(channels),
                compression=COMPRESSION, use_dictionary=False, column_encoding=ENCODING,
            )
        return self._writers[modality]

    def append(self, signals: Mapping[str, RawSignal]) -> dict[str, Placement]:
        placements = {}
        stored = _stored(signals)
        grids = recording_grids(stored)
        for modality, signal in stored.items():
            table = _table(signal.t, signal.x)
            # One call, one row group: a recording is never split across row groups.
            self._writer(modality, signal.x.shape[1]).write_table(table, row_group_size=table.num_rows)
            self._digests[modality].update(signal.t, signal.x)
            self._grids[modality].append(grids[modality])
            placements[modality] = Placement(
                file=self.files[modality], row_group=self.row_groups, rows=table.num_rows,
                t_first=float(signal.t[0]), t_last=float(signal.t[-1]),
                grid_file=grid_file(self.files[modality]), grid_points=grids[modality].shape[0 if signal.nearest else 1],
                zgrid_file=zgrid_file(self.files[modality]),
            )
        self.row_groups += 1
        return placements

    def close(self) -> None:
        for modality, writer in self._writers.items():
            writer.add_key_value_metadata({CONTENT_KEY: self._digests[modality].hexdigest()})
        for writer in (*self._writers.values(), *self._grids.values()):
            writer.close()


def _recording(raw: RawRecording, split: str, placements: Mapping[str, Placement]) -> Recording:
    return Recording(
        id=raw.id, participant=raw.participant, video=raw.video, emotion=raw.emotion,
        arousal=raw.arousal, valence=raw.valence, split=split, modalities=dict(placements),
    )


def _read_ahead(source: RawDataset, recordings: Sequence[RawRecording],
                workers: int) -> Generator[tuple[RawRecording, dict[str, RawSignal]], None, None]:
    """Each recording with its signals, in order, parsed by a few threads ahead of the writer.

    Parsing the TSV is most of the work and Arrow does it without the GIL, so reading the next
    recordings while this one is compressed and written keeps several cores busy. At most
    ``workers + 1`` recordings are held in memory.
    """
    pool = ThreadPoolExecutor(workers, thread_name_prefix="fuelline-convert", initializer=name_this_thread,
                              initargs=("fl-convert",))
    pending: deque = deque()
    try:
        for raw in recordings:
            pending.append((raw, pool.submit(source.read, raw)))
            if len(pending) > workers:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class _Conversion:
    """The state of one conversion while its shards are written into ``root``."""

    def __init__(self, source: RawDataset, root: str, splits: Mapping[str, str]) -> None:
        self.source = source
        self.root = root
        self.splits = splits
        self.recordings: list[Recording] = []
        self.channels: dict[str, tuple[str, ...]] = {}
        self.stats = {m: RunningStats() for m in MODALITIES}
        self.source_bytes = source.index_bytes

    def write_shards(self, recordings_per_shard: int, workers: int, bar: tqdm,
                     recordings: Sequence[RawRecording] | None = None, first: int = 0) -> None:
        """Shards of ``recordings`` (all by default), the first being recording ``first`` of the
        raw folder, which starts a shard: shards are numbered as a whole conversion numbers them."""
        if first % recordings_per_shard:
            raise ValueError(f"recording {first} does not start a shard of {recordings_per_shard} recordings")
        recordings = self.source.recordings if recordings is None else recordings
        shard: _Shard | None = None
        try:
            with closing(_read_ahead(self.source, recordings, workers)) as signals_in_order:
                for i, (raw, signals) in enumerate(signals_in_order, start=first):
                    if shard is None or i % recordings_per_shard == 0:  # (``first`` starts a shard)
                        if shard is not None:
                            shard.close()
                        shard = _Shard(self.root, i // recordings_per_shard)
                    self._check_channels(signals)
                    self._account(raw, signals, shard.append(signals))
                    bar.update()
        finally:
            if shard is not None:
                shard.close()

    def _check_channels(self, signals: Mapping[str, RawSignal]) -> None:
        for modality, signal in signals.items():
            if modality in self.channels:
                check_same_channels(signal, self.channels[modality])
            else:
                self.channels[modality] = signal.channels

    def _account(self, raw: RawRecording, signals: Mapping[str, RawSignal], placements: Mapping[str, Placement]) -> None:
        split = self.splits[raw.id]
        self.recordings.append(_recording(raw, split, placements))
        for modality, signal in signals.items():
            self.source_bytes += signal.nbytes
            if split == "train":
                self.stats[modality].add(signal.x)

    def zscore_grids(self) -> None:
        """The z-scored twin of every grid file, now that the train split's statistics are known."""
        stats = {m: s.result() for m, s in self.stats.items()}
        files = {(p.grid_file, p.zgrid_file, m) for r in self.recordings for m, p in r.modalities.items()}
        for grid, zgrid, m in sorted(files):
            write_zscored(os.path.join(self.root, grid), os.path.join(self.root, zgrid), stats[m], m in NEAREST)

    def manifest(self, seed: int, val_fraction: float, extra: Mapping[str, object]) -> Manifest:
        """Save manifest.json; ``dataset_bytes`` counts the manifest itself, hence the fixed point."""
        parquet_bytes = sum(
            os.path.getsize(os.path.join(folder, name))
            for folder, _, names in os.walk(self.root) for name in names
        )
        manifest_bytes = 0
        while True:
            manifest = Manifest(
                modalities={m: Modality(m, MODALITIES[m], self.channels[m]) for m in MODALITIES},
                recordings=tuple(self.recordings),
                stats={m: s.result() for m, s in self.stats.items()},
                source_bytes=self.source_bytes, dataset_bytes=parquet_bytes + manifest_bytes,
                seed=seed, val_fraction=val_fraction, extra=dict(extra),
            )
            manifest.save(self.root)
            written = os.path.getsize(os.path.join(self.root, MANIFEST_NAME))
            if written == manifest_bytes:
                return manifest
            manifest_bytes = written


# -- the atomic conversion ---------------------------------------------------------------------


def _check_options(val_fraction: float, recordings_per_shard: int) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise OptionError("val_fraction", f"must be in [0, 1), got {val_fraction}")
    if recordings_per_shard < 1:
        raise OptionError("recordings_per_shard", f"must be >= 1, got {recordings_per_shard}")


def _show_progress(progress: bool | None) -> bool:
    if progress is None:
        return sys.stderr.isatty()
    return progress


def convert(raw: str, dataset: str, *, val_fraction: float = 0.2, seed: int = 0,
            recordings_per_shard: int = 16, progress: bool | None = None) -> Manifest:
    """Convert the raw recordings at ``raw`` (RAW_FORMAT.md) into a Parquet dataset at ``dataset``.

    Args:
        val_fraction: share of each emotion's recordings put in the "val" split (0: none).
        seed: seeds the split; the same seed gives the same split.
        recordings_per_shard: recordings per Parquet file.
        progress: show a progress bar on stderr; None shows one when stderr is a terminal.

    Returns:
        The manifest, as saved in ``dataset/manifest.json``.

    Raises:
        DataError: bad input, naming the file and line, or a disk that filled up, naming
            ``dataset``, the space it needs and the space free; nothing is left at ``dataset``.
        FileExistsError: ``dataset`` exists already; it is left untouched.
    """
    _check_options(val_fraction, recordings_per_shard)
    if os.path.lexists(dataset):
        raise FileExistsError(f"{dataset} already exists; convert never overwrites a dataset")
    source = RawDataset(raw)
    splits = assign_splits(source.recordings, val_fraction, seed)
    if "train" not in splits.values():
        raise OptionError("val_fraction", f"{val_fraction} leaves no recording in the train split")
    parent = os.path.dirname(os.path.abspath(dataset))
    if not os.path.isdir(parent):
        raise DataError(f"{parent}: no such folder to write {os.path.basename(dataset)} into")
    with atomic_directory(dataset, "dataset", needed=lambda: round(SIZE_OVER_RAW * folder_bytes(raw))) as temporary:
        manifest = _write(source, temporary, splits, seed, val_fraction, recordings_per_shard, progress)
    return manifest


def _write(source: RawDataset, root: str, splits: Mapping[str, str], seed: int, val_fraction: float,
           recordings_per_shard: int, progress: bool | None) -> Manifest:
    for modality in MODALITIES:
        os.mkdir(os.path.join(root, modality))
    conversion = _Conversion(source, root, splits)
    with tqdm(total=len(source.recordings), unit="recording", disable=not _show_progress(progress),
              file=sys.stderr, desc="convert") as bar:
        conversion.write_shards(recordings_per_shard, min(READ_THREADS, os.cpu_count() or 1), bar)
    conversion.zscore_grids()
    return conversion.manifest(seed, val_fraction, _extra(recordings_per_shard))


def _extra(recordings_per_shard: int) -> dict[str, object]:
    """The manifest's ``extra``: how the dataset was written."""
    return {"recordings_per_shard": recordings_per_shard, "compression": COMPRESSION}


# -- command line ------------------------------------------------------------------------------
