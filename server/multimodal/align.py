"""Cutting windows on the master clock and resampling each modality onto its nominal grid.

Window k of a recording starts at ``t0 + k * hop`` (t0: the recording's first sample on the
master clock, over all modalities) and lasts ``length`` seconds. A modality of rate r is resampled
at ``start + i / r``, i = 0 … length·r − 1: continuous signals by linear interpolation between the
two neighbouring samples, video by the nearest frame.

A window is valid when every modality covers it and no modality misses more than ``max_gap``
consecutive samples where the window needs them. Samples missing between two neighbours: their
spacing in nominal periods, rounded, minus one, so that jitter never turns one dropped sample into
a gap. Invalid windows are dropped and counted by reason, never filled.

Everything is vectorised over windows and grid points (``searchsorted`` + interpolation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fuelline.protocol.errors import OptionError

__all__ = ["Signal", "WindowSpec", "Validity", "candidate_starts", "validity", "resample", "sample_on_grid"]


@dataclass(frozen=True)
class Signal:
    """One modality of one recording: master-clock times (ascending) and samples (n, channels)."""

    t: np.ndarray
    x: np.ndarray
    rate: float
    nearest: bool = False  # video: nearest frame, not interpolation


@dataclass(frozen=True)
class WindowSpec:
    length: float = 2.0
    hop: float = 1.0
    max_gap: int = 2

    def __post_init__(self) -> None:
        for name, value in (("window", self.length), ("hop", self.hop)):
            if not value > 0:
                raise OptionError(name, f"must be > 0 seconds, got {value}")
        if self.max_gap < 0:
            raise OptionError("max_gap", f"must be >= 0, got {self.max_gap}")

    def points(self, rate: float) -> int:
        """Grid points of one window at ``rate``."""
        return int(round(self.length * rate))


@dataclass(frozen=True)
class Validity:
    """Which candidate windows of a recording are valid, and why the others are not."""

    starts: np.ndarray  # master-clock start of every candidate window
    valid: np.ndarray  # bool per candidate
    reason: np.ndarray  # per candidate: "" if valid, else e.g. "eeg not covered", "gsr gap > 2"


def candidate_starts(signals: dict[str, Signal], spec: WindowSpec) -> np.ndarray:
    """Starts of every window between the recording's first and last sample."""
    t0 = min(float(s.t[0]) for s in signals.values())
    t1 = max(float(s.t[-1]) for s in signals.values())
    # The last grid point of a window sits one period before its end; a window fits when its
    # last grid point of the slowest modality does, which `length` bounds from above.
    count = int(np.floor((t1 - t0 - spec.length) / spec.hop + 1e-9)) + 1 if t1 - t0 >= spec.length else 0
    return t0 + spec.hop * np.arange(max(count, 0), dtype=np.float64)


def _missing(sig: Signal) -> np.ndarray:
    """Samples missing between each pair of neighbours, in nominal periods."""
    return np.rint(np.diff(sig.t) * sig.rate).astype(np.int64) - 1


def validity(signals: dict[str, Signal], spec: WindowSpec) -> Validity:
    """Check every candidate window against every modality (in the order given)."""
    starts = candidate_starts(signals, spec)
    reason = np.full(len(starts), "", dtype=object)
    for name, sig in signals.items():
        n = spec.points(sig.rate)
        first, last = starts, starts + (n - 1) / sig.rate
        # Interpolation needs a sample at or before the first grid point and at or after the
        # last; the nearest frame may lie half a period beyond.
        slack = 0.5 / sig.rate if sig.nearest else 0.0
        covered = (sig.t[0] <= first + slack) & (sig.t[-1] >= last - slack)
        # Gaps between the samples that bracket the window: intervals [lo, hi) of neighbours.
        lo = np.clip(np.searchsorted(sig.t, first, side="right") - 1, 0, None)
        hi = np.searchsorted(sig.t, last, side="left")
        bad = np.concatenate([[0], np.cumsum(_missing(sig) > spec.max_gap)])
        hi_c = np.clip(hi, 0, len(sig.t) - 1)
        gapped = covered & (bad[hi_c] - bad[np.minimum(lo, hi_c)] > 0)
        todo = reason == ""
        reason[todo & ~covered] = f"{name} not covered"
        reason[todo & gapped] = f"{name} gap > {spec.max_gap}"
    return Validity(starts=starts, valid=reason == "", reason=reason)


def sample_on_grid(sig: Signal, grid: np.ndarray) -> np.ndarray:
    """Samples of ``sig`` at the master times ``grid`` (1-d): (points, channels)."""
    if sig.nearest:
        j = np.clip(np.searchsorted(sig.t, grid), 1, len(sig.t) - 1)
        earlier = (grid - sig.t[j - 1]) <= (sig.t[j] - grid)
        return sig.x[np.where(earlier, j - 1, j)]
    j = np.clip(np.searchsorted(sig.t, grid, side="right") - 1, 0, len(sig.t) - 2)
    w = ((grid - sig.t[j]) / (sig.t[j + 1] - sig.t[j])).astype(sig.x.dtype)[:, None]
    out = sig.x[j + 1] - sig.x[j]
    out *= w
    out += sig.x[j]
    return out


def _shared_step(sig: Signal, starts: np.ndarray, spec: WindowSpec) -> tuple[int, np.ndarray] | None:
    """When every start lies a whole number of grid points after the first (the hop is a
    multiple of the period), the windows share one grid: (points per hop, each window's hop
    count from the first). None when they do not, or when the windows are so sparse that the
    shared grid would hold more points than the windows do."""
    if len(starts) < 2:
        return None
    step = spec.hop * sig.rate
    if abs(step - round(step)) > 1e-9 or round(step) < 1:
        return None
    hops = np.rint((starts - starts[0]) / spec.hop).astype(np.int64)
    if np.abs(starts[0] + hops * spec.hop - starts).max() > 1e-9 * max(1.0, abs(float(starts[-1]))):
        return None
    if int(hops[-1]) * round(step) + spec.points(sig.rate) > len(starts) * spec.points(sig.rate):
        return None
    return int(round(step)), hops


def resample(sig: Signal, starts: np.ndarray, spec: WindowSpec, channels_first: bool = False) -> np.ndarray:
    """Samples of ``sig`` on the nominal grid of each window: (windows, points, channels), or
    (windows, channels, points) with ``channels_first``; always a fresh C-contiguous array.

    Overlapping windows (hop < length) share grid points. When the hop is a whole number of
    periods, the signal is resampled once on one grid, ``starts[0] + i / rate``, and each window
    is cut from it: every point is computed once however much the windows overlap.
    """
    n = spec.points(sig.rate)
    shared = _shared_step(sig, starts, spec)
    if shared is None:
        grid = starts[:, None] + np.arange(n) / sig.rate  # (windows, points), master seconds
        out = sample_on_grid(sig, grid.reshape(-1)).reshape(len(starts), n, sig.x.shape[1])
        return np.ascontiguousarray(out.transpose(0, 2, 1)) if channels_first else out
    step, hops = shared
    grid = starts[0] + np.arange(int(hops[-1]) * step + n) / sig.rate
    values = sample_on_grid(sig, grid)  # (points, channels)
    if channels_first:
        values = np.ascontiguousarray(values.T)  # (channels, points)
        windows = np.lib.stride_tricks.sliding_window_view(values, n, axis=1)[:, ::step]  # (channels, hops, n)
        return windows.transpose(1, 0, 2)[hops]
    windows = np.lib.stride_tricks.sliding_window_view(values, n, axis=0)[::step]  # (hops, channels, n)
    return windows.transpose(0, 2, 1)[hops]
