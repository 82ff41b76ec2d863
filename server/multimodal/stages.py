"""Preprocessing stages, as Fuel's Transformers were: each takes a batch (a dict of arrays, one
row per window) and returns a batch.

The pipeline of a window source is: align, window and ``Normalize`` (per recording, on the
read-ahead threads: ``fuelline.server.multimodal.align``), then per batch: the user's stages, in the
order given → ``Cast``.
A user stage is any callable ``f(batch) -> batch`` named as ``module:function`` on the command
line (``fuelline serve DATASET --stage mypkg.features:band_power``); it may replace, add or drop
arrays, and runs on the data server's cores, not in the trainer. The arrays it is given may be
read-only (decoded windows are shared by every client of a server): a stage returns new arrays
rather than writing into those. ``band_power`` below is an example.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from fuelline.protocol import DataError
from fuelline.protocol.common.callables import load_callable
from fuelline.server.sources.fingerprint import callable_name

__all__ = ["Batch", "Stage", "Normalize", "Cast", "Pipeline", "load_stage", "band_power"]

Batch = dict[str, np.ndarray]
Stage = Callable[[Batch], Batch]

# Axis of the channels in each served modality: eeg/ecg/gsr are (B, C, T), video is (B, T, D).
CHANNEL_AXIS = {"eeg": 1, "ecg": 1, "gsr": 1, "video": 2}


class Normalize:
    """z-score every channel with the train split's mean and std (from the dataset manifest).

    Args:
        stats: modality -> {"mean": [...], "std": [...]}, per channel.
        in_place: overwrite the arrays it is given where they are writeable, for callers that own
            them (decoded data that several batches share is read-only: see ``WindowSource``).
        modalities: the modalities it normalises (default: every one ``stats`` has).
    """

    def __init__(self, stats: Mapping[str, Mapping[str, Sequence[float]]], in_place: bool = False,
                 modalities: Sequence[str] | None = None, name: str = "normalize") -> None:
        self.in_place = in_place
        self.name = name
        chosen = [m for m in CHANNEL_AXIS if m in stats and (modalities is None or m in modalities)]
        # mean and 1/std as float32, once: the same operations, in the same order, as ever.
        self._by_modality = {}
        for m in chosen:
            std = np.asarray(stats[m]["std"], dtype=np.float32)
            scale = (1.0 / np.where(std > 0, std, 1.0)).astype(np.float32)
            self._by_modality[m] = (np.asarray(stats[m]["mean"], dtype=np.float32), scale)

    @property
    def modalities(self) -> list[str]:
        return list(self._by_modality)

    def __call__(self, batch: Batch) -> Batch:
        out = dict(batch)
        for modality, (mean, scale) in self._by_modality.items():
            if modality not in batch:
                continue
            x = batch[modality]
            axis = CHANNEL_AXIS[modality]
            shape = [1] * x.ndim
            shape[axis] = x.shape[axis]
            m, s = mean.reshape(shape), scale.reshape(shape)
            if self.in_place and x.dtype == np.float32 and x.flags.writeable:
                x -= m
                x *= s
            else:
                y = np.subtract(x, m)
                y *= s
                out[modality] = y
        return out


@dataclass(frozen=True)
class Cast:
    """Floating arrays to float32, integers to int64, t_start stays float64: the served dtypes."""

    name: str = "cast"

    def __call__(self, batch: Batch) -> Batch:
        out = {}
        for key, x in batch.items():
            x = np.asarray(x)
            if key == "t_start":
                out[key] = x.astype(np.float64, copy=False)
            elif x.dtype.kind == "f":
                out[key] = x.astype(np.float32, copy=False)
            elif x.dtype.kind in "iub":
                out[key] = x.astype(np.int64, copy=False) if x.dtype.kind != "b" else x
            else:
                raise DataError(f"stage output {key!r} has dtype {x.dtype}, which cannot be served")
        return out


class StageObserver(Protocol):
    """What hears of each stage a batch goes through (``fuelline.server.sources.stage_pool.StagePool``)."""

    def entering(self, stage: str) -> None: ...

    def left(self, stage: str, seconds: float) -> None: ...


class Pipeline:
    """Stages applied in order; a stage that fails is named in the error. An ``observer`` hears
    of each stage a batch enters and of the time it took there, by ``labels`` (``module:function``
    for a user's stage, its own name for the project's)."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = list(stages)
        self.labels = [s.name if isinstance(s, (Normalize, Cast)) else callable_name(s) for s in self.stages]
        self.observer: StageObserver | None = None

    @property
    def names(self) -> list[str]:
        return [getattr(s, "name", "") or getattr(s, "__qualname__", type(s).__name__) for s in self.stages]

    def __call__(self, batch: Batch) -> Batch:
        observer = self.observer
        for stage, name, label in zip(self.stages, self.names, self.labels):
            if observer is not None:
                observer.entering(label)
                started = time.perf_counter()
            try:
                result = stage(batch)
            except DataError:
                raise
            except Exception as exc:
                raise DataError(f"stage {name!r} failed: {type(exc).__name__}: {exc}") from exc
            finally:
                if observer is not None:
                    observer.left(label, time.perf_counter() - started)
            if not isinstance(result, Mapping):
                raise DataError(f"stage {name!r} returned {type(result).__name__}, not a dict of arrays")
            batch = dict(result)
        return batch


_MOVED = {"fuelline.server.windows.stages": __name__}


def load_stage(spec: str) -> Stage:
    """Import ``module:function`` (the value of a ``--stage`` option). The example stages lived in
    ``fuelline.server.windows.stages`` before the server's modules were grouped by concern; command
    lines and unit files written then keep working."""
    return load_callable(spec, "--stage", f"{__name__}:band_power", moved=_MOVED)


# Bands of the EEG band-power example, in Hz.
BANDS = {"theta": (4.0, 8.0), "alpha": (8.0, 13.0), "beta": (13.0, 30.0), "gamma": (30.0, 45.0)}
EEG_RATE = 128


def band_power(batch: Batch) -> Batch:
    """Example stage: log power of each EEG channel in the theta, alpha, beta and gamma bands,
    added as ``eeg_bands`` (B, 14, 4), from a real FFT of each window."""
    eeg = batch["eeg"]
    spectrum = np.abs(np.fft.rfft(eeg, axis=-1)) ** 2
    freqs = np.fft.rfftfreq(eeg.shape[-1], d=1.0 / EEG_RATE)
    bands = [spectrum[..., (freqs >= lo) & (freqs < hi)].mean(axis=-1) for lo, hi in BANDS.values()]
    return {**batch, "eeg_bands": np.log1p(np.stack(bands, axis=-1)).astype(np.float32)}
