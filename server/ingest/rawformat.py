"""Reading and validating the raw TSV recordings that ``fuelline convert`` takes as input.

The format is described in ``RAW_FORMAT.md``: ``recordings.tsv`` and ``clocks.tsv`` at the root,
and one folder per recording holding ``eeg.tsv``, ``ecg.tsv``, ``gsr.tsv`` and ``video.tsv``.

Every file is parsed by ``pyarrow.csv`` with explicit column types, so the happy path never
loops over samples in Python. Arrow's parse errors do not say on which line they happened,
and a user with a 300 MB file needs that line; so only when Arrow refuses a file is it scanned
again in Python to find the first offending line. Every refusal is a ``DataError`` that starts
with ``<path>, line <N>:`` (the header is line 1), or with the path alone where no line applies.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from fuelline.protocol import DataError
from fuelline.server.multimodal.manifest import EEG_CHANNELS, EMOTIONS, MODALITIES

__all__ = [
    "RECORDINGS_FILE",
    "CLOCKS_FILE",
    "CHANNELS",
    "RawRecording",
    "Clock",
    "RawSignal",
    "RawDataset",
    "read_signal",
    "check_same_channels",
]

RECORDINGS_FILE = "recordings.tsv"
CLOCKS_FILE = "clocks.tsv"
# Channel names of the fixed-width devices; video has D columns f000 … f{D-1}, D found in the data.
CHANNELS: Mapping[str, tuple[str, ...]] = {"eeg": EEG_CHANNELS, "ecg": ("ECG_R", "ECG_L"), "gsr": ("GSR",)}
_RECORDINGS_COLUMNS = {
    "recording_id": pa.string(), "participant": pa.int64(), "video": pa.int64(),
    "emotion": pa.string(), "arousal": pa.float64(), "valence": pa.float64(),
}
_CLOCKS_COLUMNS = {"recording_id": pa.string(), "device": pa.string(), "offset_s": pa.float64(), "drift_ppm": pa.float64()}
_ID_PATTERN = "^[A-Za-z0-9_-]+$"
_INT_TEXT = re.compile(r"^\s*-?\d+\s*$")
_SELF_ASSESSMENT = (1.0, 9.0)


@dataclass(frozen=True)
class RawRecording:
    """One row of recordings.tsv; ``line`` is kept so later errors can point back at it."""

    id: str
    participant: int
    video: int
    emotion: str
    arousal: float
    valence: float
    line: int


@dataclass(frozen=True)
class Clock:
    """How one device's clock maps to the master clock (a device with no row: identity)."""

    offset_s: float = 0.0
    drift_ppm: float = 0.0

    def to_master(self, t_dev: np.ndarray) -> np.ndarray:
        return (t_dev - self.offset_s) / (1.0 + self.drift_ppm * 1e-6)


@dataclass(frozen=True)
class RawSignal:
    """One recording's samples of one device: master-clock times and an (n, C) float32 matrix."""

    t: np.ndarray
    x: np.ndarray
    channels: tuple[str, ...]
    path: str  # the TSV it came from
    nbytes: int  # its size


# -- parsing one file --------------------------------------------------------------------------


def _where(path: str, line: int) -> str:
    return f"{path}, line {line}"


def _read_header(path: str) -> list[str]:
    """The header's column names; read by hand so a wrong header is reported as such, on line 1."""
    try:
        with open(path, "rb") as f:
            first = f.readline()
    except FileNotFoundError:
        raise DataError(f"{path}: file is missing") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror})") from None
    if not first:
        raise DataError(f"{_where(path, 1)}: the file is empty, expected a header line")
    try:
        text = first.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(f"{_where(path, 1)}: the header is not valid UTF-8") from None
    return text.rstrip("\r\n").split("\t")


def _check_header(path: str, got: Sequence[str], expected: Sequence[str]) -> None:
    if list(got) == list(expected):
        return
    missing = [c for c in expected if c not in got]
    unexpected = [c for c in got if c not in expected]
    if missing:
        detail = f"missing column {missing[0]!r}"
    elif unexpected:
        detail = f"unexpected column {unexpected[0]!r}"
    else:
        detail = "columns out of order"
    raise DataError(f"{_where(path, 1)}: bad header ({detail}); expected: {' '.join(expected)}")


def _field_problem(value: str, kind: pa.DataType) -> str | None:
    """Why Arrow would refuse ``value`` as a ``kind``, or None; mirrors Arrow's parsers closely enough
    to find the line it stopped at."""
    if pa.types.is_floating(kind):
        try:
            float(value)
        except ValueError:
            return "is not a number"
        return "is not a number" if "_" in value else None
    if pa.types.is_integer(kind):
        return None if _INT_TEXT.match(value) else "is not an integer"
    return None


def _find_bad_line(path: str, columns: Mapping[str, pa.DataType]) -> str | None:
    """The first line Arrow cannot have parsed, as an error message; the error path only."""
    names = list(columns)
    with open(path, "rb") as f:
        f.readline()
        for line, raw in enumerate(f, start=2):
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                return f"{_where(path, line)}: not valid UTF-8"
            if not text:
                return f"{_where(path, line)}: empty line, expected {len(names)} fields"
            fields = text.split("\t")
            if len(fields) != len(names):
                return f"{_where(path, line)}: {len(fields)} fields, expected {len(names)}"
            for name, value in zip(names, fields):
                problem = _field_problem(value, columns[name])
                if problem:
                    return f"{_where(path, line)}: field {name!r} {problem}: {value!r}"
    return None


def _read_table(path: str, columns: Mapping[str, pa.DataType]) -> pa.Table:
    """Parse a TSV whose header was already checked; data row i is on line i + 2."""
    read = pcsv.ReadOptions(skip_rows=1, column_names=list(columns))
    # Strict parsing keeps row numbers equal to line numbers: no quoting, no skipped blank
    # lines, and no "NA"-style nulls that would hide a missing value.
    parse = pcsv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False)
    convert = pcsv.ConvertOptions(column_types=dict(columns), null_values=[], strings_can_be_null=False)
    try:
        return pcsv.read_csv(path, read_options=read, parse_options=parse, convert_options=convert)
    except pa.ArrowException as exc:
        message = _find_bad_line(path, columns)
        raise DataError(message or f"{path}: cannot be parsed ({exc})") from None


def _first_bad_row(bad: np.ndarray) -> int | None:
    rows = np.flatnonzero(bad)
    return int(rows[0]) if len(rows) else None


def _check_finite(path: str, name: str, values: np.ndarray) -> None:
    row = _first_bad_row(~np.isfinite(values))
    if row is not None:
        raise DataError(f"{_where(path, row + 2)}: field {name!r} is not a finite number: {float(values[row])!r}")


# -- one modality file -------------------------------------------------------------------------


def _expected_channels(path: str, modality: str, header: Sequence[str]) -> tuple[str, ...]:
    if modality in CHANNELS:
        return CHANNELS[modality]
    # video: any number D >= 1 of feature columns, named by position.
    dim = len(header) - 1
    if dim < 1:
        raise DataError(f"{_where(path, 1)}: bad header; expected timestamp and at least one feature f000")
    return tuple(f"f{i:03d}" for i in range(dim))


def _check_ascending(path: str, t_dev: np.ndarray) -> None:
    row = _first_bad_row(np.diff(t_dev) < 0)
    if row is not None:
        raise DataError(
            f"{_where(path, row + 3)}: timestamp {float(t_dev[row + 1])!r} goes backwards "
            f"(line {row + 2} has {float(t_dev[row])!r})"
        )


def _channel_matrix(path: str, table: pa.Table, channels: Sequence[str]) -> np.ndarray:
    x = np.empty((table.num_rows, len(channels)), dtype=np.float32)
    for j, name in enumerate(channels):
        column = table.column(name).to_numpy()
        _check_finite(path, name, column)
        x[:, j] = column
    return x


def read_signal(path: str, modality: str, clock: Clock = Clock(),
                channels: Sequence[str] | None = None) -> RawSignal:
    """Read one modality file, check it, and map its timestamps to the master clock.

    Args:
        channels: the channel names this file must have; None means the format's names (for
            video, whatever D the header says).
    """
    header = _read_header(path)
    expected = tuple(channels) if channels is not None else _expected_channels(path, modality, header)
    _check_header(path, header, ("timestamp", *expected))
    table = _read_table(path, {name: pa.float64() for name in ("timestamp", *expected)})
    if table.num_rows == 0:
        raise DataError(f"{_where(path, 2)}: no samples after the header")
    t_dev = table.column("timestamp").to_numpy()
    _check_finite(path, "timestamp", t_dev)
    _check_ascending(path, t_dev)
    x = _channel_matrix(path, table, expected)
    return RawSignal(t=clock.to_master(t_dev), x=x, channels=expected, path=path, nbytes=os.path.getsize(path))


# -- the index files ---------------------------------------------------------------------------


def _read_index_file(path: str, columns: Mapping[str, pa.DataType]) -> pa.Table:
    _check_header(path, _read_header(path), list(columns))
    return _read_table(path, columns)


def _check_values(path: str, table: pa.Table, name: str, bad: pa.Array | np.ndarray, why: str) -> None:
    row = _first_bad_row(np.asarray(bad, dtype=bool))
    if row is not None:
        value = table.column(name)[row].as_py()
        raise DataError(f"{_where(path, row + 2)}: {name} {value!r} {why}")


def _check_unique(path: str, keys: Sequence[object], what: str) -> None:
    seen: dict[object, int] = {}
    for row, key in enumerate(keys):
        if key in seen:
            raise DataError(f"{_where(path, row + 2)}: duplicate {what} {key!r} (first on line {seen[key] + 2})")
        seen[key] = row


def read_recordings(path: str) -> tuple[RawRecording, ...]:
    """recordings.tsv, checked: ids usable as folder names and unique, known emotions, scores in 1..9."""
    table = _read_index_file(path, _RECORDINGS_COLUMNS)
    if table.num_rows == 0:
        raise DataError(f"{_where(path, 2)}: no recordings after the header")
    ids = table.column("recording_id")
    _check_values(path, table, "recording_id", pc.invert(pc.match_substring_regex(ids, _ID_PATTERN)),
                  "must match [A-Za-z0-9_-]+ (it names the recording's folder)")
    _check_unique(path, ids.to_pylist(), "recording_id")
    _check_values(path, table, "emotion", pc.invert(pc.is_in(table.column("emotion"), pa.array(EMOTIONS))),
                  f"is not one of {' '.join(EMOTIONS)}")
    low, high = _SELF_ASSESSMENT
    for name in ("arousal", "valence"):
        values = table.column(name).to_numpy()
        _check_values(path, table, name, ~((values >= low) & (values <= high)), f"is not in {low:g}..{high:g}")
    rows = table.to_pylist()
    return tuple(
        RawRecording(id=r["recording_id"], participant=r["participant"], video=r["video"], emotion=r["emotion"],
                     arousal=r["arousal"], valence=r["valence"], line=i + 2)
        for i, r in enumerate(rows)
    )


def read_clocks(path: str, known: set[str]) -> dict[tuple[str, str], Clock]:
    """clocks.tsv, checked: known recordings and devices, one row per pair, an invertible mapping."""
    table = _read_index_file(path, _CLOCKS_COLUMNS)
    _check_values(path, table, "recording_id", pc.invert(pc.is_in(table.column("recording_id"), pa.array(sorted(known), pa.string()))),
                  f"is not in {RECORDINGS_FILE}")
    _check_values(path, table, "device", pc.invert(pc.is_in(table.column("device"), pa.array(list(MODALITIES)))),
                  f"is not one of {' '.join(MODALITIES)}")
    pairs = list(zip(table.column("recording_id").to_pylist(), table.column("device").to_pylist()))
    _check_unique(path, pairs, "(recording_id, device)")
    offsets = table.column("offset_s").to_numpy()
    drifts = table.column("drift_ppm").to_numpy()
    _check_values(path, table, "offset_s", ~np.isfinite(offsets), "is not a finite number")
    # 1 + drift·1e-6 must stay positive, or master time would run backwards.
    _check_values(path, table, "drift_ppm", ~(np.abs(drifts) < 1e6), "is not in (-1e6, 1e6)")
    return {pair: Clock(float(o), float(d)) for pair, o, d in zip(pairs, offsets, drifts)}


class RawDataset:
    """A raw folder whose index files were read and checked, and whose files all exist.

    Opening checks everything that is cheap (the index files, every folder and file), so a
    missing file fails before hours of conversion; the samples are read per recording by
    :meth:`read`, which checks them as it goes.
    """

    def __init__(self, root: str) -> None:
        if not os.path.isdir(root):
            raise DataError(f"{root}: no such folder")
        self.root = root
        recordings_path = os.path.join(root, RECORDINGS_FILE)
        clocks_path = os.path.join(root, CLOCKS_FILE)
        self.recordings = read_recordings(recordings_path)
        self.clocks = read_clocks(clocks_path, {r.id for r in self.recordings})
        self.index_bytes = os.path.getsize(recordings_path) + os.path.getsize(clocks_path)
        self._check_files(recordings_path)

    def path(self, recording_id: str, modality: str) -> str:
        return os.path.join(self.root, recording_id, f"{modality}.tsv")

    def _check_files(self, recordings_path: str) -> None:
        for rec in self.recordings:
            folder = os.path.join(self.root, rec.id)
            if not os.path.isdir(folder):
                raise DataError(
                    f"{folder}: folder of recording {rec.id!r} is missing "
                    f"(listed in {_where(recordings_path, rec.line)})"
                )
            for modality in MODALITIES:
                path = self.path(rec.id, modality)
                if not os.path.isfile(path):
                    raise DataError(f"{path}: file is missing")

    def clock(self, recording_id: str, modality: str) -> Clock:
        return self.clocks.get((recording_id, modality), Clock())

    def read(self, rec: RawRecording) -> dict[str, RawSignal]:
        """Every modality of one recording, on the master clock, in ``MODALITIES`` order.

        Safe to call from several threads at once. That video has the same D in every recording
        is for the caller to check, in recording order, with :func:`check_same_channels`.
        """
        return {m: read_signal(self.path(rec.id, m), m, self.clock(rec.id, m)) for m in MODALITIES}


def check_same_channels(signal: RawSignal, channels: Sequence[str]) -> None:
    """Refuse a file whose channels differ from those of the recordings before it (video's D)."""
    if tuple(signal.channels) != tuple(channels):
        raise DataError(
            f"{_where(signal.path, 1)}: {len(signal.channels)} channels, expected {len(channels)} "
            f"as in the recordings before it"
        )
