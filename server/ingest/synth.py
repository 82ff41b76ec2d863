"""Synthetic AMIGOS-like raw recordings, in the raw format ``fuelline convert`` reads (RAW_FORMAT.md).

The data are untidy the way real recordings are, so that the converter and the alignment can be
tested against a known truth:

- every device has its own clock: an offset of up to ±600 s and a drift of up to ±80 ppm per
  recording, written to ``clocks.tsv``; ``t_dev = offset_s + (1 + drift_ppm * 1e-6) * t_master``;
- a device samples at its nominal rate on its own clock, so in master time its period is
  ``1 / (rate * (1 + drift_ppm * 1e-6))``; its timestamps jitter (Gaussian, ``jitter_ms`` std,
  clipped to ±3 std and to ±0.4 of a period, so they never go backwards);
- each sample is lost with probability ``drop``, and with probability ``drop / 20`` a run of 3–20
  samples is lost from there on (dropouts are rarer than lost samples; the first and last sample
  of a device are always kept);
- devices start at a master time in [0, 1.5] s and stop in [seconds − 1.5, seconds] (the 1.5 s
  shrink to seconds / 4 for very short recordings), so no two start or stop together;
- the signals depend on the recording's emotion, so that a model can learn it: EEG alpha and beta
  power, heart rate, skin conductance (through arousal) and a per-emotion offset of the face
  features. Emotions follow the skew of the original data set.

**Probe.** With ``probe=True`` channel 0 of every modality (AF3, ECG_R, GSR, f000) holds the true
master time of its sample instead of a signal. Sample i of a device is taken when the device clock
reads ``t_dev_nominal_i = t_dev_start + i / rate``; its true master time is
``(t_dev_nominal_i - offset_s) / (1 + drift_ppm * 1e-6)``, and its written timestamp is
``t_dev_nominal_i + jitter_i``. Mapping a timestamp through ``clocks.tsv`` therefore lands within
the jitter bound of the probe, and an aligned probe channel shows how far alignment is from the
truth.

Everything is drawn from generators seeded with ``seed``: the same arguments give byte-identical
files.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from fuelline.protocol.common.atomic import atomic_directory
from fuelline.server.multimodal.manifest import EEG_CHANNELS, EMOTIONS, MODALITIES

__all__ = ["EMOTION_PROBABILITIES", "channel_names", "estimated_bytes", "synthesize"]

# Share of each emotion (in EMOTIONS order) among the recordings of the original data set.
EMOTION_PROBABILITIES = (0.415, 0.213, 0.135, 0.106, 0.088, 0.043)
OFFSET_MAX_S = 600.0
DRIFT_MAX_PPM = 80.0
RUN_SHARE = 1 / 20  # a dropout run starts this much less often than a single sample is lost
EDGE_S = 1.5  # how late a device may start and how early it may stop

# Per emotion, in EMOTIONS order. Self-assessment centres follow the circumplex model of affect.
_VALENCE = (5.0, 7.5, 2.5, 6.0, 2.5, 2.5)
_AROUSAL = (3.0, 6.0, 3.5, 7.0, 7.5, 6.5)
_ALPHA_UV = (12.0, 9.0, 14.0, 7.0, 6.0, 7.5)  # relaxed states show more alpha ...
_BETA_UV = (3.0, 5.0, 2.5, 7.0, 9.0, 8.0)  # ... aroused ones more beta
_HEART_BPM = (64.0, 74.0, 61.0, 82.0, 90.0, 86.0)
# One heartbeat as Gaussian bumps (amplitude mV, position in the beat, width): P, Q, R, S, T.
_PQRST = ((0.12, 0.15, 0.025), (-0.12, 0.31, 0.008), (1.2, 0.33, 0.010), (-0.25, 0.35, 0.008), (0.3, 0.55, 0.04))
# Decimals written per modality (about 6 significant digits of the signal); times get microseconds.
_DECIMALS = {"eeg": 4, "ecg": 5, "gsr": 5, "video": 3}
_TIME_DECIMALS = 6


@dataclass(frozen=True)
class _Clock:
    """How one device's clock maps to the master clock (one row of clocks.tsv)."""

    offset_s: float
    drift_ppm: float

    @property
    def rate_scale(self) -> float:
        return 1.0 + self.drift_ppm * 1e-6


@dataclass(frozen=True)
class _Recording:
    """One row of recordings.tsv."""

    id: str
    participant: int
    video: int
    emotion: int
    arousal: float
    valence: float


@dataclass(frozen=True)
class _Faces:
    """What every recording's video features share: a mean face and a per-emotion offset."""

    mean: np.ndarray  # (D,)
    emotion_offset: np.ndarray  # (len(EMOTIONS), D)
    seed: int  # of the per-participant faces


def channel_names(modality: str, video_dim: int = 136) -> tuple[str, ...]:
    """The channel columns of ``<modality>.tsv``, after ``timestamp``."""
    if modality == "eeg":
        return EEG_CHANNELS
    if modality == "ecg":
        return ("ECG_R", "ECG_L")
    if modality == "gsr":
        return ("GSR",)
    if modality == "video":
        return tuple(f"f{j:03d}" for j in range(video_dim))
    raise ValueError(f"unknown modality {modality!r}")


# -- drawing -------------------------------------------------------------------------------------
def _assign_emotions(rng: np.random.Generator, n: int) -> np.ndarray:
    """Emotion indices with the original skew; with n >= 6 the first six cover every emotion, so
    that even a small data set has every class."""
    labels = rng.choice(len(EMOTIONS), size=n, p=EMOTION_PROBABILITIES)
    if n >= len(EMOTIONS):
        labels[: len(EMOTIONS)] = rng.permutation(len(EMOTIONS))
    return labels


def _recording(rng: np.random.Generator, index: int, emotion: int) -> _Recording:
    # AMIGOS showed 16 short videos to each participant.
    participant, video = index // 16 + 1, index % 16 + 1
    valence, arousal = np.clip(rng.normal((_VALENCE[emotion], _AROUSAL[emotion]), 0.8), 1.0, 9.0).round(2)
    return _Recording(f"P{participant:02d}_V{video:02d}", participant, video, emotion, float(arousal), float(valence))


def _clock(rng: np.random.Generator) -> _Clock:
    # Rounded as written, so that the files describe the clocks the timestamps were made with.
    offset = round(rng.uniform(-OFFSET_MAX_S, OFFSET_MAX_S), 6)
    return _Clock(offset, round(rng.uniform(-DRIFT_MAX_PPM, DRIFT_MAX_PPM), 3))


def _kept(rng: np.random.Generator, n: int, drop: float) -> np.ndarray:
    """Which of n samples survive single drops and runs of 3–20 drops."""
    lost = rng.random(n) < drop
    starts = np.flatnonzero(rng.random(n) < drop * RUN_SHARE)
    ends = np.minimum(starts + rng.integers(3, 21, len(starts)), n)
    depth = np.zeros(n + 1, np.int64)
    np.add.at(depth, starts, 1)
    np.add.at(depth, ends, -1)
    lost |= np.cumsum(depth[:-1]) > 0
    lost[[0, -1]] = False  # the device's start and stop stay where they were drawn
    return ~lost


def _sample_times(
    rng: np.random.Generator, clock: _Clock, rate: int, seconds: float, jitter_ms: float, drop: float
) -> tuple[np.ndarray, np.ndarray]:
    """(written device timestamps, true master times) of the samples a device keeps."""
    edge = min(EDGE_S, seconds / 4)
    start, stop = rng.uniform(0.0, edge), rng.uniform(seconds - edge, seconds)
    n = int(np.floor((stop - start) * clock.rate_scale * rate)) + 1
    nominal = (clock.offset_s + clock.rate_scale * start) + np.arange(n) / rate
    master = (nominal - clock.offset_s) / clock.rate_scale
    keep = _kept(rng, n, drop)
    std = jitter_ms * 1e-3
    # At half a period two neighbours could swap, and real clocks never run backwards: capping at
    # 0.4 of a period keeps neighbours at least 0.2 of a period apart.
    bound = min(3 * std, 0.4 / rate)
    jitter = np.clip(rng.normal(0.0, std, int(keep.sum())), -bound, bound)
    return nominal[keep] + jitter, master[keep]


# -- signals: (channels, samples) arrays at the samples' master times ----------------------------
def _eeg(rng: np.random.Generator, t: np.ndarray, rec: _Recording) -> np.ndarray:
    """Theta, alpha and beta rhythms (µV) whose alpha/beta balance is the emotion's, plus noise."""
    channels = len(EEG_CHANNELS)
    freqs = np.array([rng.uniform(4, 7), rng.uniform(8, 12), rng.uniform(13, 30)])
    # People differ: each recording scales the emotion's rhythms by its own factor.
    amps = np.array([6.0, _ALPHA_UV[rec.emotion], _BETA_UV[rec.emotion]]) * rng.lognormal(0.0, 0.35, 3)
    gains = rng.uniform(0.6, 1.4, (3, channels))
    phases = rng.uniform(0, 2 * np.pi, (3, channels))
    x = rng.normal(0.0, 4.0, (channels, len(t)))
    for f, a, g, p in zip(freqs, amps, gains, phases):
        x += (a * g)[:, None] * np.sin(2 * np.pi * f * t[None, :] + p[:, None])
    return x


def _ecg(rng: np.random.Generator, t: np.ndarray, rec: _Recording) -> np.ndarray:
    """Two leads (mV) of a PQRST heartbeat at the emotion's heart rate, breathing-modulated."""
    bpm = _HEART_BPM[rec.emotion] + rng.normal(0.0, 6.0)  # resting heart rates differ by person
    beat = bpm / 60.0 * t + 0.03 * np.sin(2 * np.pi * 0.25 * t + rng.uniform(0, 2 * np.pi))
    frac = beat % 1.0
    wave = sum(a * np.exp(-0.5 * ((frac - mu) / w) ** 2) for a, mu, w in _PQRST)
    wander = 0.05 * np.sin(2 * np.pi * 0.15 * t + rng.uniform(0, 2 * np.pi))
    right = wave + wander + rng.normal(0.0, 0.02, len(t))
    left = 0.7 * wave - 0.5 * wander + rng.normal(0.0, 0.02, len(t))
    return np.stack([right, left])


def _gsr(rng: np.random.Generator, t: np.ndarray, rec: _Recording, seconds: float) -> np.ndarray:
    """Skin conductance (µS): a level and a drift that rise with arousal, plus skin responses
    that come more often when aroused."""
    level = 1.5 + 0.6 * rec.arousal + rng.normal(0.0, 0.3)
    slope = 0.004 * (rec.arousal - 4.0)
    onsets = rng.uniform(0.0, seconds, rng.poisson(rec.arousal * seconds / 30.0))
    heights = rng.uniform(0.1, 0.5, len(onsets))
    since = np.maximum(t[None, :] - onsets[:, None], 0.0)
    responses = (heights[:, None] * (1 - np.exp(-since / 1.0)) * np.exp(-since / 5.0)).sum(axis=0)
    x = level + slope * t + responses + rng.normal(0.0, 0.005, len(t))
    return np.maximum(x, 0.05)[None, :]


def _video(rng: np.random.Generator, t: np.ndarray, rec: _Recording, faces: _Faces) -> np.ndarray:
    """Landmark coordinates (pixels): the mean face, the emotion's expression, slow head motion
    (x and y features alternate) and tracking noise."""
    dim = len(faces.mean)
    freqs, phases = rng.uniform(0.05, 0.3, 2), rng.uniform(0, 2 * np.pi, 2)
    head = 3.0 * np.sin(2 * np.pi * freqs[:, None] * t[None, :] + phases[:, None])  # (2, n): x, y
    motion = head[np.arange(dim) % 2]
    # Faces differ by person more than by expression: a per-participant offset, drawn from a
    # generator seeded by the participant so it is the same face in all of their recordings.
    person = np.random.default_rng([faces.seed, rec.participant]).normal(0.0, 3.0, dim)
    base = faces.mean + person + faces.emotion_offset[rec.emotion]
    return base[:, None] + motion + rng.normal(0.0, 1.0, (dim, len(t)))


def _faces(rng: np.random.Generator, video_dim: int) -> _Faces:
    is_x = np.arange(video_dim) % 2 == 0
    mean = np.where(is_x, rng.uniform(200, 440, video_dim), rng.uniform(150, 350, video_dim))
    # Expressions are subtle beside who is in the picture (the per-participant offset).
    return _Faces(mean, rng.normal(0.0, 0.6, (len(EMOTIONS), video_dim)), int(rng.integers(2**31)))


# -- writing -------------------------------------------------------------------------------------
def _write_tsv(path: str, names: tuple[str, ...], columns: np.ndarray, decimals: np.ndarray) -> None:
    """Write (columns, rows) floats as TSV. Rounding first makes Arrow's shortest round-trip
    formatting print at most ``decimals`` digits, vectorised in C++."""
    scale = 10.0 ** decimals[:, None]
    values = np.rint(columns * scale) / scale + 0.0  # + 0.0 turns -0 into 0
    table = pa.table([pa.array(v) for v in values], names=list(names))
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    with pa.OSFile(path, "wb") as f:
        f.write(("\t".join(names) + "\n").encode())  # Arrow would quote the header names
        pacsv.write_csv(table, f, options)


def _write_modality(
    folder: str, modality: str, rng: np.random.Generator, rec: _Recording, clock: _Clock, faces: _Faces,
    seconds: float, jitter_ms: float, drop: float, probe: bool,
) -> int:
    rate = MODALITIES[modality]
    stamps, master = _sample_times(rng, clock, rate, seconds, jitter_ms, drop)
    if modality == "eeg":
        x = _eeg(rng, master, rec)
    elif modality == "ecg":
        x = _ecg(rng, master, rec)
    elif modality == "gsr":
        x = _gsr(rng, master, rec, seconds)
    else:
        x = _video(rng, master, rec, faces)
    decimals = np.full(len(x) + 1, _DECIMALS[modality])
    decimals[0] = _TIME_DECIMALS
    if probe:
        x[0] = master
        decimals[1] = _TIME_DECIMALS
    names = ("timestamp",) + channel_names(modality, len(faces.mean))
    _write_tsv(os.path.join(folder, f"{modality}.tsv"), names, np.vstack([stamps[None, :], x]), decimals)
    return len(stamps)


def _write_small(path: str, header: tuple[str, ...], rows: list[tuple]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("\t".join(header) + "\n")
        f.writelines("\t".join(map(str, row)) + "\n" for row in rows)


def estimated_bytes(recordings: int, seconds: float, video_dim: int = 136) -> int:
    """About how many bytes ``synthesize`` writes: each sample is a line of TSV, its timestamp
    about 12 characters and each channel about 8 (measured on its output: a little more than it writes,
    by a fifth at most)."""
    per_second = sum(rate * (12 + 8 * len(channel_names(m, video_dim))) for m, rate in MODALITIES.items())
    return round(recordings * seconds * per_second)


def _folder_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(root) for name in names)


def synthesize(
    out: str, recordings: int, seconds: float, seed: int, *, video_dim: int = 136, drop: float = 0.002,
    jitter_ms: float = 0.3, probe: bool = False,
) -> dict:
    """Write a raw data set of ``recordings`` recordings of ``seconds`` seconds each to ``out``.

    Args:
        out: the folder to create; it must not exist. It appears only once it is complete.
        recordings: how many recordings (participant × video); >= 1.
        seconds: master-clock length of each recording; > 0.
        seed: seeds every draw; the same arguments write byte-identical files.
        video_dim: video features per frame (``f000`` …); >= 1.
        drop: probability that a sample is lost (a run of 3–20 starts RUN_SHARE as often); in [0, 0.5).
        jitter_ms: standard deviation of timestamp jitter in milliseconds; >= 0.
        probe: put each sample's true master time into channel 0 of every modality.

    Returns:
        ``{"recordings": n, "emotions": {emotion: count}, "rows": {modality: rows}, "bytes": size}``.
    """
    finite = 0 < seconds < math.inf and 0 <= jitter_ms < math.inf
    if recordings < 1 or video_dim < 1 or not 0 <= drop < 0.5 or not finite:
        raise ValueError("recordings >= 1, finite seconds > 0, video_dim >= 1, 0 <= drop < 0.5 and finite "
                         "jitter_ms >= 0 are required")
    if os.path.exists(out):
        raise FileExistsError(f"{out} exists; remove it or choose another path")
    with atomic_directory(out, "raw folder", needed=lambda: estimated_bytes(recordings, seconds, video_dim)) as tmp:
        summary = _write_dataset(tmp, recordings, seconds, seed, video_dim, drop, jitter_ms, probe)
    return summary


def _write_dataset(
    root: str, n: int, seconds: float, seed: int, video_dim: int, drop: float, jitter_ms: float, probe: bool
) -> dict:
    # One generator for what recordings share, one per recording: a recording's data do not
    # depend on how many draws the others made.
    shared, *own = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(n + 1))
    emotions, faces = _assign_emotions(shared, n), _faces(shared, video_dim)
    rows = {m: 0 for m in MODALITIES}
    recs, clocks = [], []
    for index, (rng, emotion) in enumerate(zip(own, emotions)):
        rec = _recording(rng, index, int(emotion))
        folder = os.path.join(root, rec.id)
        os.mkdir(folder)
        for modality in MODALITIES:
            clock = _clock(rng)
            clocks.append((rec.id, modality, f"{clock.offset_s:.6f}", f"{clock.drift_ppm:.3f}"))
            rows[modality] += _write_modality(
                folder, modality, rng, rec, clock, faces, seconds, jitter_ms, drop, probe
            )
        recs.append(
            (rec.id, rec.participant, rec.video, EMOTIONS[rec.emotion], f"{rec.arousal:.2f}", f"{rec.valence:.2f}")
        )
    _write_small(os.path.join(root, "recordings.tsv"),
                 ("recording_id", "participant", "video", "emotion", "arousal", "valence"), recs)
    _write_small(os.path.join(root, "clocks.tsv"), ("recording_id", "device", "offset_s", "drift_ppm"), clocks)
    counts = np.bincount(emotions, minlength=len(EMOTIONS))
    return {
        "recordings": n,
        "emotions": {e: int(c) for e, c in zip(EMOTIONS, counts)},
        "rows": rows,
        "bytes": _folder_bytes(root),
    }
