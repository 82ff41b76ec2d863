"""The manifest of a converted multimodal dataset (``manifest.json`` at the dataset's root).

Layout of a converted dataset::

    DATASET/
      manifest.json
      <modality>/part-NNNNN.parquet   one file per shard and modality; one row group per recording,
                                      columns ``t`` (float64, master-clock seconds, ascending) and
                                      ``x``: one sample per row, its channels as little-endian
                                      float32, in a fixed_size_binary[4 * channels] column
                                      (format 1 held a fixed_size_list<float32>[channels])
      <modality>/grid-NNNNN.arrow     the same recordings resampled onto their master grids, one
                                      record batch per row group (format 3,
                                      ``fuelline.server.multimodal.grid``)
      <modality>/zgrid-NNNNN.arrow    the same grids z-scored with the train split's statistics

The manifest says everything a server needs before reading a sample: the modalities (nominal
rate, channel names), the emotions, each recording (metadata, split, and per modality where its
samples are: file, row group, count, first and last master time), per-channel statistics of the
train split for normalisation, class counts, and the bytes read and written.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from fuelline.protocol import DataError

if TYPE_CHECKING:
    from fuelline.server.sources.storage import Store

__all__ = [
    "FORMAT",
    "READABLE_FORMATS",
    "UPGRADABLE_FORMATS",
    "MANIFEST_NAME",
    "EMOTIONS",
    "MODALITIES",
    "NEAREST",
    "EEG_CHANNELS",
    "Modality",
    "Placement",
    "Recording",
    "Manifest",
    "is_converted_dataset",
]

FORMAT = "fuelline-multimodal/3"
# Format 1 stored ``x`` as a Parquet list, whose repetition levels cost more to decode than the
# samples themselves. Formats 1 and 2 lack the master grids a server slices windows from: a server
# refuses them, naming ``fuelline upgrade``, which adds the grids in place.
READABLE_FORMATS = (FORMAT,)
UPGRADABLE_FORMATS = ("fuelline-multimodal/1", "fuelline-multimodal/2")
MANIFEST_NAME = "manifest.json"
EMOTIONS = ("neutral", "happiness", "sadness", "surprise", "anger", "fear")
EEG_CHANNELS = ("AF3", "F7", "F3", "FC5", "T7", "P7", "O1", "O2", "P8", "T8", "FC6", "F4", "F8", "AF4")
# Nominal rates in Hz, in the order modalities are served.
MODALITIES = {"eeg": 128, "ecg": 256, "gsr": 4, "video": 30}
NEAREST = frozenset({"video"})  # resampled by nearest frame, not interpolation; served (points, features)


@dataclass(frozen=True)
class Modality:
    """A device: its nominal rate and channel names."""

    name: str
    rate: int
    channels: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.rate <= 0 or not self.channels:
            raise ValueError(f"modality {self.name!r} needs a positive rate and channels")


@dataclass(frozen=True)
class Placement:
    """Where one recording's samples of one modality are stored."""

    file: str  # relative to the dataset root
    row_group: int
    rows: int
    t_first: float  # master-clock seconds of the first and last sample
    t_last: float
    grid_file: str = ""  # the recording on its master grid: record batch ``row_group`` of this file
    grid_points: int = 0  # (format 3; empty in the formats before)
    zgrid_file: str = ""  # the same grid z-scored (format 3)

    def __post_init__(self) -> None:
        # A manifest must not point a server at files outside its dataset.
        for name in (self.file, self.grid_file, self.zgrid_file):
            parts = name.replace("\\", "/").split("/")
            if os.path.isabs(name) or ".." in parts or (not name and name is self.file):
                raise ValueError(f"file {name!r} must be a path inside the dataset")
        if self.grid_points < 0 or not bool(self.grid_file) == bool(self.zgrid_file) == (self.grid_points > 0):
            raise ValueError(f"placement in {self.file!r} has grids {self.grid_file!r}, {self.zgrid_file!r} "
                             f"of {self.grid_points} points")
        if self.row_group < 0 or self.rows < 1 or not self.t_first <= self.t_last:
            raise ValueError(f"placement in {self.file!r} has row group {self.row_group}, {self.rows} rows, "
                             f"times {self.t_first}..{self.t_last}")


@dataclass(frozen=True)
class Recording:
    """One participant watching one stimulus, as recordings.tsv describes it, plus its split."""

    id: str
    participant: int
    video: int
    emotion: str
    arousal: float
    valence: float
    split: str
    modalities: Mapping[str, Placement]



@dataclass(frozen=True)
class Manifest:
    """Everything about a converted dataset but its samples."""

    modalities: Mapping[str, Modality]
    recordings: tuple[Recording, ...]
    stats: Mapping[str, Mapping[str, list[float]]]  # modality -> {"mean": [...], "std": [...]} (train split)
    source_bytes: int
    dataset_bytes: int
    seed: int
    val_fraction: float
    emotions: tuple[str, ...] = EMOTIONS
    format: str = FORMAT
    extra: Mapping[str, Any] = field(default_factory=dict)

    def label(self, recording: Recording) -> int:
        """The class index of a recording: its emotion's position in ``emotions``."""
        return self.emotions.index(recording.emotion)

    def split(self, name: str) -> tuple[Recording, ...]:
        return tuple(r for r in self.recordings if r.split == name)

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(sorted({r.split for r in self.recordings}, key=lambda s: (s != "train", s)))

    def class_counts(self, split: str) -> dict[str, int]:
        """Recordings per emotion in a split."""
        counts = {e: 0 for e in self.emotions}
        for r in self.split(split):
            counts[r.emotion] += 1
        return counts

    # -- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "emotions": list(self.emotions),
            "modalities": {k: {"rate": m.rate, "channels": list(m.channels)} for k, m in self.modalities.items()},
            "recordings": [
                {**{k: v for k, v in asdict(r).items() if k != "modalities"},
                 "modalities": {k: asdict(p) for k, p in r.modalities.items()}}
                for r in self.recordings
            ],
            "stats": {k: dict(v) for k, v in self.stats.items()},
            "class_counts": {s: self.class_counts(s) for s in self.splits},
            "source_bytes": self.source_bytes,
            "dataset_bytes": self.dataset_bytes,
            "seed": self.seed,
            "val_fraction": self.val_fraction,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = MANIFEST_NAME,
                  formats: tuple[str, ...] = READABLE_FORMATS) -> "Manifest":
        """The manifest of ``data`` (``where`` names it in errors), if its format is one of ``formats``."""
        try:
            found = data.get("format")
            if found in UPGRADABLE_FORMATS and found not in formats:
                dataset = os.path.dirname(where) or "."
                raise DataError(f"{where}: format {found!r} predates {FORMAT!r}, which this version serves; "
                                f"`fuelline upgrade {dataset}` adds what it lacks, in place")
            if found not in formats:
                raise DataError(f"{where}: format {found!r} is not one of {list(formats)}")
            modalities = {
                k: Modality(k, int(v["rate"]), tuple(v["channels"])) for k, v in data["modalities"].items()
            }
            recordings = tuple(
                Recording(
                    id=r["id"], participant=int(r["participant"]), video=int(r["video"]), emotion=r["emotion"],
                    arousal=float(r["arousal"]), valence=float(r["valence"]), split=r["split"],
                    modalities={k: Placement(**p) for k, p in r["modalities"].items()},
                )
                for r in data["recordings"]
            )
            if found == FORMAT:
                for r in recordings:
                    for k, p in r.modalities.items():
                        if not p.grid_file:
                            raise ValueError(f"recording {r.id!r}, {k}: no grids (format {FORMAT} has them per placement)")
            return cls(
                modalities=modalities, recordings=recordings, stats=data["stats"],
                source_bytes=int(data["source_bytes"]), dataset_bytes=int(data["dataset_bytes"]),
                seed=int(data["seed"]), val_fraction=float(data["val_fraction"]),
                emotions=tuple(data.get("emotions", EMOTIONS)), extra=data.get("extra", {}),
                format=data["format"],
            )
        except DataError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from None

    def save(self, root: str) -> None:
        with open(os.path.join(root, MANIFEST_NAME), "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, root: "str | Store", formats: tuple[str, ...] = READABLE_FORMATS) -> "Manifest":
        """The manifest of a dataset: a local path, a URI (``s3://…``) or a ``Store``."""
        from fuelline.server.sources.storage import Store

        store = root if isinstance(root, Store) else Store(root)
        path = store.where(MANIFEST_NAME)
        try:
            data = json.loads(store.read_bytes(MANIFEST_NAME))
        except OSError as exc:
            raise DataError(f"{path}: cannot read the manifest ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not valid JSON ({exc})") from None
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from None
        return cls.from_json(data, where=path, formats=formats)


def is_converted_dataset(path: "str | Store") -> bool:
    """Whether a dataset (a local path, a URI or a ``Store``) has a manifest at its root.

    Raises:
        DataError: a remote dataset's filesystem cannot be resolved or reached (naming the URI),
            rather than answering False and failing again, slower, as a Parquet dataset.
    """
    from fuelline.server.sources.storage import Store, is_uri

    if isinstance(path, str) and not is_uri(path):
        return os.path.isfile(os.path.join(path, MANIFEST_NAME))
    store = path if isinstance(path, Store) else Store(path)
    return store.kind(MANIFEST_NAME) == "file"
