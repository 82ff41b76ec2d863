"""``fuelline convert RAW DATASET --part I/N`` on many hosts, then ``--finish N``: one conversion in parts.

Layout::

    DATASET.parts/part-I-of-N/       one part, written into a hidden folder and renamed, like a dataset
      <modality>/part-NNNNN.parquet  its shards, numbered as a one-part conversion numbers them
      <modality>/grid-NNNNN.arrow    and their master grids
      stats.npz                      per train recording and modality: samples, sum, sum of squares
      part.json                      what the part holds and what it was made from (written last)
      zscored.json                   after ``--zscore-part I/N``: its z-scored grids are there too

Parts split the dataset on shard boundaries: of S shards, part I converts shards ``I·S // N`` up
to ``(I+1)·S // N``, so every shard file is the very file a one-part conversion writes (a part may
be empty when N > S). What needs every part waits for the finish:

- The statistics. A one-part conversion sums each train recording around a shift, the first
  train recording's mean (``RunningStats``); every part takes the same shift (reading that one
  recording again where it lies in an earlier part) and keeps its recordings' sums apart, and
  the finish adds them in recording order: the statistics come out bit for bit the same.
- The z-scored grids, which need the statistics. The finish writes them: 11 % of a one-part
  conversion's time, measured (benchmarks/results/convert-parts.md), and the whole finish took
  0.5 s beside 1.3 s for the conversion, most of it the process's start. ``--zscore-part I/N``,
  run for every part once all are done, writes part I's into it beforehand (the finish takes
  those made with the same statistics): it cost more than it saved on one host, four more
  processes each reading every part's statistics, but spares a finish that would otherwise read
  and write every grid of a large dataset alone over a shared file system.

The finish checks that every part is there, complete (every file it lists, at its size) and made
from the same raw folder (recordings.tsv, clocks.tsv, every recording file's size) with the same
options, and names the part at fault otherwise. It links the parts' files into a hidden folder
beside DATASET (copies where links fail), writes the manifest and renames the folder onto
DATASET: nothing is at DATASET unless it all succeeded. Then it removes DATASET.parts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from fuelline.protocol import DataError, OptionError
from fuelline.protocol.common.atomic import atomic_directory
from fuelline.server.ingest.convert import (
    READ_THREADS,
    RunningStats,
    _check_options,
    _Conversion,
    _extra,
    _show_progress,
    assign_splits,
)
from fuelline.server.ingest.rawformat import CLOCKS_FILE, RECORDINGS_FILE, RawDataset, RawRecording, RawSignal
from fuelline.server.multimodal.grid import write_zscored
from fuelline.server.multimodal.manifest import MODALITIES, NEAREST, Manifest, Placement, Recording

__all__ = ["PART_FORMAT", "parts_folder", "part_folder", "part_shards", "convert_part", "zscore_part", "finish"]

PART_FORMAT = "fuelline-convert-part/1"
PART_RECORD = "part.json"
STATS_FILE = "stats.npz"
ZSCORED_RECORD = "zscored.json"
ZSCORE_THREADS = 4


def parts_folder(dataset: str) -> str:
    """Where the parts of ``dataset`` are written: ``DATASET.parts`` beside it."""
    return os.path.normpath(dataset) + ".parts"


def part_folder(dataset: str, part: int, parts: int) -> str:
    return os.path.join(parts_folder(dataset), f"part-{part}-of-{parts}")


def part_shards(recordings: int, recordings_per_shard: int, part: int, parts: int) -> tuple[int, int]:
    """The shards ``[first, stop)`` of part ``part`` of ``parts``."""
    shards = -(-recordings // recordings_per_shard)
    return part * shards // parts, (part + 1) * shards // parts


def _check_part(part: int, parts: int, option: str = "part") -> None:
    if parts < 1 or not 0 <= part < parts:
        raise OptionError(option, f"must be I/N with 0 <= I < N, got {part}/{parts}")


# -- what a part is made from ------------------------------------------------------------------


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _source_identity(source: RawDataset) -> dict[str, Any]:
    """What must be the same for parts to make one dataset: the index files' content and every
    recording file's size (reading every file would cost what converting it does)."""
    sizes = hashlib.sha256()
    for rec in source.recordings:
        for modality in MODALITIES:
            sizes.update(f"{rec.id}/{modality}.tsv {os.path.getsize(source.path(rec.id, modality))}\n".encode())
    return {RECORDINGS_FILE: _file_digest(os.path.join(source.root, RECORDINGS_FILE)),
            CLOCKS_FILE: _file_digest(os.path.join(source.root, CLOCKS_FILE)),
            "file sizes": sizes.hexdigest()}


def _options(val_fraction: float, seed: int, recordings_per_shard: int) -> dict[str, Any]:
    return {"val_fraction": val_fraction, "seed": seed, "recordings_per_shard": recordings_per_shard}


@dataclass(frozen=True)
class _Plan:
    """A conversion in parts, from one raw folder and options."""

    source: RawDataset
    dataset: str
    splits: Mapping[str, str]
    options: Mapping[str, Any]
    parts: int

    def folder(self, part: int) -> str:
        return part_folder(self.dataset, part, self.parts)

    @property
    def recordings_per_shard(self) -> int:
        return int(self.options["recordings_per_shard"])

    def recordings(self, part: int) -> tuple[int, int]:
        """The recordings ``[first, stop)`` of a part."""
        first, stop = part_shards(len(self.source.recordings), self.recordings_per_shard, part, self.parts)
        total = len(self.source.recordings)
        return min(first * self.recordings_per_shard, total), min(stop * self.recordings_per_shard, total)

    def first_train(self) -> int:
        return next(i for i, r in enumerate(self.source.recordings) if self.splits[r.id] == "train")


def _plan(raw: str, dataset: str, parts: int, val_fraction: float, seed: int, recordings_per_shard: int) -> _Plan:
    _check_options(val_fraction, recordings_per_shard)
    source = RawDataset(raw)
    splits = assign_splits(source.recordings, val_fraction, seed)
    if "train" not in splits.values():
        raise OptionError("val_fraction", f"{val_fraction} leaves no recording in the train split")
    return _Plan(source, dataset, splits, _options(val_fraction, seed, recordings_per_shard), parts)


# -- one part ----------------------------------------------------------------------------------


class _PartConversion(_Conversion):
    """A conversion of some of the recordings that keeps each train recording's sums apart."""

    def __init__(self, source: RawDataset, root: str, splits: Mapping[str, str],
                 shift: Mapping[str, np.ndarray] | None) -> None:
        super().__init__(source, root, splits)
        self.source_bytes = 0  # (the index files are counted once, by the finish)
        if shift is not None:
            for modality, stats in self.stats.items():
                stats.start(shift[modality])
        self.sums: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {m: [] for m in MODALITIES}

    def _account(self, raw: RawRecording, signals: Mapping[str, RawSignal], placements: Mapping[str, Placement]) -> None:
        super()._account(raw, signals, placements)
        if self.splits[raw.id] == "train":
            for modality, signal in signals.items():
                stats = self.stats[modality]
                self.sums[modality].append(stats.sums(signal.x))

    def save_stats(self) -> None:
        arrays: dict[str, np.ndarray] = {}
        for modality, rows in self.sums.items():
            shift = self.stats[modality].shift
            if shift is None:
                continue
            arrays[f"{modality}.shift"] = shift
            arrays[f"{modality}.count"] = np.array([n for n, _, _ in rows], dtype=np.int64)
            arrays[f"{modality}.sum"] = np.stack([s for _, s, _ in rows])
            arrays[f"{modality}.sum_sq"] = np.stack([q for _, _, q in rows])
        np.savez(os.path.join(self.root, STATS_FILE), allow_pickle=False, **arrays)


def _shift(plan: _Plan, first: int, stop: int) -> dict[str, np.ndarray] | None:
    """The shift of a one-part conversion's sums, where this part does not start them itself."""
    recordings = plan.source.recordings[first:stop]
    if not any(plan.splits[r.id] == "train" for r in recordings):
        return None
    first_train = plan.first_train()
    if first_train >= first:  # this part holds it, and meets it first
        return None
    signals = plan.source.read(plan.source.recordings[first_train])
    return {m: s.x.mean(axis=0, dtype=np.float64) for m, s in signals.items()}


def _files(root: str) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(folder, name), root).replace("\\", "/"): os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(root) for name in names
    }


def _recording_json(recording: Recording) -> dict[str, Any]:
    # (the manifest's own layout of a recording)
    manifest = Manifest(modalities={}, recordings=(recording,), stats={}, source_bytes=0, dataset_bytes=0,
                        seed=0, val_fraction=0.0)
    return manifest.to_json()["recordings"][0]


def _write_record(path: str, record: Mapping[str, Any]) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(temporary, path)


def convert_part(raw: str, dataset: str, part: int, parts: int, *, val_fraction: float = 0.2, seed: int = 0,
                 recordings_per_shard: int = 16, progress: bool | None = None) -> dict[str, Any]:
    """Convert part ``part`` of ``parts`` of the raw recordings at ``raw`` into ``DATASET.parts``.

    The options are those of :func:`fuelline.server.ingest.convert.convert`, and must be the same
    for every part and for :func:`finish`. A part already there, complete and made from the same
    raw folder and options, is left as it is (a retried part is then a no-op).

    Returns:
        The part's record (``part.json``), with ``"seconds"`` it took and ``"skipped"``.

    Raises:
        OptionError: ``part`` out of range, or options out of theirs.
        DataError: bad input, naming the file and line, or a part of the same number already
            there but made from other raw recordings or options; nothing new is left behind.
        FileExistsError: ``dataset`` exists already.
    """
    _check_part(part, parts)
    start = time.perf_counter()
    plan = _plan(raw, dataset, parts, val_fraction, seed, recordings_per_shard)
    if os.path.lexists(dataset):
        raise FileExistsError(f"{dataset} already exists; convert never overwrites a dataset")
    identity = _source_identity(plan.source)
    out = plan.folder(part)
    if os.path.lexists(out):
        record = _load_part(plan, identity, part)
        return {**record, "seconds": time.perf_counter() - start, "skipped": True}
    os.makedirs(parts_folder(dataset), exist_ok=True)
    try:
        record = _write_part(plan, identity, part, progress)
    except FileExistsError:
        if not os.path.lexists(out):
            raise
        # The same part, run twice at once (a retried pod whose first try still ran): one wins.
        record = _load_part(plan, identity, part)
        return {**record, "seconds": time.perf_counter() - start, "skipped": True}
    return {**record, "seconds": time.perf_counter() - start, "skipped": False}


def _write_part(plan: _Plan, identity: Mapping[str, Any], part: int, progress: bool | None) -> dict[str, Any]:
    parts, recordings_per_shard = plan.parts, plan.recordings_per_shard
    first, stop = plan.recordings(part)
    with atomic_directory(plan.folder(part), f"part {part}/{parts}") as temporary:
        for modality in MODALITIES:
            os.mkdir(os.path.join(temporary, modality))
        conversion = _PartConversion(plan.source, temporary, plan.splits, _shift(plan, first, stop))
        with tqdm(total=stop - first, unit="recording", disable=not _show_progress(progress), file=sys.stderr,
                  desc=f"convert part {part}/{parts}") as bar:
            conversion.write_shards(recordings_per_shard, min(READ_THREADS, os.cpu_count() or 1), bar,
                                    plan.source.recordings[first:stop], first)
        conversion.save_stats()
        record = {
            "format": PART_FORMAT, "part": part, "parts": parts, "raw": os.path.abspath(plan.source.root),
            "source": identity, "options": dict(plan.options),
            "recordings": [first, stop], "shards": list(part_shards(len(plan.source.recordings),
                                                                      recordings_per_shard, part, parts)),
            "channels": {m: list(c) for m, c in conversion.channels.items()},
            "signal_bytes": conversion.source_bytes,
            "entries": [_recording_json(r) for r in conversion.recordings],
            "files": _files(temporary),
        }
        _write_record(os.path.join(temporary, PART_RECORD), record)
    return record


# -- checking the parts ------------------------------------------------------------------------


def _name(part: int, parts: int, folder: str) -> str:
    return f"part {part}/{parts} ({folder})"


def _other_parts(area: str, parts: int) -> str:
    found = sorted({name.rsplit("-of-", 1)[-1] for name in os.listdir(area)
                    if name.startswith("part-") and "-of-" in name}) if os.path.isdir(area) else []
    others = [n for n in found if n != str(parts)]
    return f"; {area} holds parts of {' and of '.join(others)}" if others else ""


def _load_part(plan: _Plan, identity: Mapping[str, Any], part: int) -> dict[str, Any]:
    """A part's record, once the part is checked complete and made like the others."""
    parts = plan.parts
    folder = plan.folder(part)
    name = _name(part, parts, folder)
    if not os.path.isdir(folder):
        raise DataError(f"{name} is missing: run fuelline convert with --part {part}/{parts}"
                        f"{_other_parts(os.path.dirname(folder), parts)}")
    path = os.path.join(folder, PART_RECORD)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{name} is incomplete: it has no {PART_RECORD}; remove it and run --part {part}/{parts} again") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot be read ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != PART_FORMAT:
        raise DataError(f"{path}: not a part of this version's conversion ({PART_FORMAT})")
    try:
        _check_record(plan, identity, part, folder, record)
    except DataError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise DataError(f"{path}: malformed part record ({type(exc).__name__}: {exc})") from None
    return record


def _check_record(plan: _Plan, identity: Mapping[str, Any], part: int, folder: str, record: dict[str, Any]) -> None:
    parts, path, name = plan.parts, os.path.join(folder, PART_RECORD), _name(part, plan.parts, folder)
    if (record.get("part"), record.get("parts")) != (part, parts):
        raise DataError(f"{path}: holds part {record.get('part')}/{record.get('parts')}, not {part}/{parts}")
    for key, value in identity.items():
        if record["source"].get(key) != value:
            raise DataError(f"{name} was made from other raw recordings: its {key} differs from those of "
                            f"{plan.source.root}")
    for option, value in plan.options.items():
        if record["options"].get(option) != value:
            flag = "--" + option.replace("_", "-")
            raise DataError(f"{name} was made with {flag} {record['options'].get(option)}, not {value}")
    expected = list(plan.recordings(part))
    if record["recordings"] != expected:
        raise DataError(f"{name} holds recordings {record['recordings']}, not {expected}")
    for file, size in record["files"].items():
        try:
            found = os.path.getsize(os.path.join(folder, file))
        except OSError:
            raise DataError(f"{name} is incomplete: {file} is missing; remove it and run --part {part}/{parts} again") from None
        if found != size:
            raise DataError(f"{name} is incomplete: {file} has {found} bytes, not {size}; "
                            f"remove it and run --part {part}/{parts} again")


def _recording(entry: Mapping[str, Any]) -> Recording:
    return Recording(
        id=entry["id"], participant=entry["participant"], video=entry["video"], emotion=entry["emotion"],
        arousal=entry["arousal"], valence=entry["valence"], split=entry["split"],
        modalities={m: Placement(**p) for m, p in entry["modalities"].items()},
    )


@dataclass
class _Merged:
    """Every part, checked, and what the dataset takes from all of them."""

    records: list[dict[str, Any]]
    recordings: list[Recording]
    channels: dict[str, tuple[str, ...]]
    stats: dict[str, RunningStats]
    signal_bytes: int

    def stats_json(self) -> dict[str, dict[str, list[float]]]:
        return {m: s.result() for m, s in self.stats.items()}


def _merge(plan: _Plan, identity: Mapping[str, Any]) -> _Merged:
    records = [_load_part(plan, identity, part) for part in range(plan.parts)]
    merged = _Merged(records, [], {}, {m: RunningStats() for m in MODALITIES}, 0)
    for part, record in enumerate(records):
        folder = plan.folder(part)
        first, stop = record["recordings"]
        if len(record["entries"]) != stop - first:
            raise DataError(f"{os.path.join(folder, PART_RECORD)}: lists {len(record['entries'])} recordings, "
                            f"not {stop - first}")
        for modality, names in record["channels"].items():
            expected = merged.channels.setdefault(modality, tuple(names))
            if tuple(names) != expected:  # (as a one-part conversion says it, at this part's first recording)
                path = plan.source.path(plan.source.recordings[first].id, modality)
                raise DataError(f"{path}, line 1: {len(names)} channels, expected {len(expected)} "
                                f"as in the recordings before it")
        try:
            merged.recordings.extend(_recording(entry) for entry in record["entries"])
            merged.signal_bytes += int(record["signal_bytes"])
        except DataError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise DataError(f"{os.path.join(folder, PART_RECORD)}: malformed part record "
                            f"({type(exc).__name__}: {exc})") from None
        _add_sums(merged.stats, os.path.join(folder, STATS_FILE), _name(part, plan.parts, folder))
    return merged


def _add_sums(stats: Mapping[str, RunningStats], path: str, name: str) -> None:
    """A part's sums, added in recording order after those of the parts before it: the very
    additions a one-part conversion makes."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            found = {key: arrays[key] for key in arrays.files}
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot be read ({exc})") from None
    for modality, running in stats.items():
        if f"{modality}.shift" not in found:
            continue
        shift = found[f"{modality}.shift"]
        if running.shift is None:
            running.start(shift)
        elif not np.array_equal(running.shift, shift):
            raise DataError(f"{name}: its {modality} sums are taken around another first train recording's "
                            f"mean than the parts before it: the raw recordings changed between parts")
        for count, total, total_sq in zip(found[f"{modality}.count"], found[f"{modality}.sum"],
                                          found[f"{modality}.sum_sq"]):
            running.add_sums(int(count), total, total_sq)


def _stats_digest(stats: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(stats, sort_keys=True).encode()).hexdigest()


def _grids(entries: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """(grid file, z-scored grid file, modality) of a part's recordings."""
    return sorted({(p["grid_file"], p["zgrid_file"], m) for e in entries for m, p in e["modalities"].items()})


def _zscore(source: str, target: str, grids: Sequence[tuple[str, str, str]],
            stats: Mapping[str, Mapping[str, Sequence[float]]]) -> None:
    """The z-scored twins of ``grids``; one file per thread (each is written on its own, so the
    bytes do not depend on the order)."""
    def one(grid: tuple[str, str, str]) -> None:
        file, zfile, modality = grid
        write_zscored(os.path.join(source, file), os.path.join(target, zfile), stats[modality], modality in NEAREST)

    with ThreadPoolExecutor(max(1, min(ZSCORE_THREADS, os.cpu_count() or 1)), thread_name_prefix="fl-zscore") as pool:
        for _ in pool.map(one, grids):
            pass


def _place(source: str, target: str) -> None:
    """``source`` at ``target`` too: a hard link (no copy, and the part keeps its file should the
    finish fail), or a copy where the file system has none."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _zscored(folder: str, digest: str) -> list[str] | None:
    """The z-scored grids ``--zscore-part`` wrote into a part with these statistics, if all there."""
    try:
        with open(os.path.join(folder, ZSCORED_RECORD)) as f:
            record = json.load(f)
        if record.get("stats") != digest:
            return None
        if any(os.path.getsize(os.path.join(folder, file)) != size for file, size in record["files"].items()):
            return None
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    return list(record["files"])


# -- the z-scored grids of one part, and the finish ---------------------------------------------


def zscore_part(raw: str, dataset: str, part: int, parts: int, *, val_fraction: float = 0.2, seed: int = 0,
                recordings_per_shard: int = 16) -> dict[str, Any]:
    """Write part ``part``'s z-scored grids into it, once every part is there; optional, so that
    :func:`finish`, which writes those a part lacks, does not write them all on one host.

    Returns:
        ``{"files": {zgrid file: bytes}, "stats": digest, "seconds": ..., "skipped": bool}``.

    Raises:
        OptionError, DataError: as :func:`finish`, naming the part missing or made otherwise.
    """
    _check_part(part, parts, "zscore_part")
    start = time.perf_counter()
    plan = _plan(raw, dataset, parts, val_fraction, seed, recordings_per_shard)
    merged = _merge(plan, _source_identity(plan.source))
    stats = merged.stats_json()
    digest = _stats_digest(stats)
    folder = plan.folder(part)
    if _zscored(folder, digest) is not None:
        with open(os.path.join(folder, ZSCORED_RECORD)) as f:
            return {**json.load(f), "seconds": time.perf_counter() - start, "skipped": True}
    grids = _grids(merged.records[part]["entries"])
    _zscore(folder, folder, grids, stats)
    record = {"stats": digest, "files": {zfile: os.path.getsize(os.path.join(folder, zfile)) for _, zfile, _ in grids}}
    _write_record(os.path.join(folder, ZSCORED_RECORD), record)
    return {**record, "seconds": time.perf_counter() - start, "skipped": False}


def finish(raw: str, dataset: str, parts: int, *, val_fraction: float = 0.2, seed: int = 0,
           recordings_per_shard: int = 16, keep_parts: bool = False) -> Manifest:
    """Make ``dataset`` from its ``parts`` parts in ``DATASET.parts``: the dataset a one-part
    :func:`fuelline.server.ingest.convert.convert` with the same options writes, file for file.

    Args:
        keep_parts: leave ``DATASET.parts`` in place (by default it is removed once the dataset is).

    Returns:
        The manifest, as saved in ``dataset/manifest.json``.

    Raises:
        OptionError: ``parts`` < 1, or options out of their ranges.
        DataError: a part missing, incomplete, or made from other raw recordings or options
            (naming it), or a disk that filled up; nothing is left at ``dataset``.
        FileExistsError: ``dataset`` exists already; it is left untouched.
    """
    if parts < 1:
        raise OptionError("parts", f"must be >= 1, got {parts}")
    plan = _plan(raw, dataset, parts, val_fraction, seed, recordings_per_shard)
    if os.path.lexists(dataset):
        raise FileExistsError(f"{dataset} already exists; convert never overwrites a dataset")
    merged = _merge(plan, _source_identity(plan.source))
    stats = merged.stats_json()
    digest = _stats_digest(stats)
    grid_bytes = sum(size for r in merged.records for file, size in r["files"].items() if "/grid-" in file)
    with atomic_directory(dataset, "dataset", needed=lambda: grid_bytes) as temporary:
        for modality in MODALITIES:
            os.mkdir(os.path.join(temporary, modality))
        missing: list[tuple[str, str, str]] = []
        for part, record in enumerate(merged.records):
            folder = plan.folder(part)
            for file in record["files"]:
                if file != STATS_FILE:
                    _place(os.path.join(folder, file), os.path.join(temporary, file))
            zscored = _zscored(folder, digest)
            if zscored is None:
                missing += _grids(record["entries"])
            else:
                for file in zscored:
                    _place(os.path.join(folder, file), os.path.join(temporary, file))
        _zscore(temporary, temporary, missing, stats)
        conversion = _Conversion(plan.source, temporary, plan.splits)
        conversion.recordings = merged.recordings
        conversion.channels = merged.channels
        conversion.stats = merged.stats
        conversion.source_bytes = plan.source.index_bytes + merged.signal_bytes
        manifest = conversion.manifest(seed, val_fraction, _extra(recordings_per_shard))
    if not keep_parts:
        shutil.rmtree(parts_folder(dataset), ignore_errors=True)
    return manifest
