"""Alignment, on signals whose every sample carries its true master time."""

from __future__ import annotations

import numpy as np
import pytest

from fuelline.server.multimodal.align import Signal, WindowSpec, resample, validity


def probe_signal(rate: float, start: float, stop: float, *, drift_ppm: float = 0.0, jitter_s: float = 0.0,
                 drop: tuple[int, ...] = (), nearest: bool = False, seed: int = 0) -> Signal:
    """Samples at the device's own period (drifting against the master clock), timestamps with
    jitter, and channel 0 holding each sample's true master time."""
    rng = np.random.default_rng(seed)
    true = start + np.arange(int((stop - start) * rate)) / (rate * (1 + drift_ppm * 1e-6))
    stamped = true + np.clip(rng.normal(0, jitter_s, len(true)), -3 * jitter_s, 3 * jitter_s)
    keep = np.ones(len(true), dtype=bool)
    keep[list(drop)] = False
    x = np.stack([true[keep], rng.random(keep.sum())], axis=1).astype(np.float64)
    return Signal(stamped[keep], x, rate, nearest)


SPEC = WindowSpec(2.0, 1.0, 2)


def test_interpolated_grid_points_sit_within_a_millisecond_of_nominal() -> None:
    signals = {
        "eeg": probe_signal(128, 0.0, 60, drift_ppm=80, jitter_s=0.0003),
        "ecg": probe_signal(256, 0.0, 60, drift_ppm=-80, jitter_s=0.0003, seed=1),
        "gsr": probe_signal(4, 0.0, 60, drift_ppm=50, jitter_s=0.0003, seed=2),
    }
    v = validity(signals, SPEC)
    # Jitter at the first sample and drift at the last may leave the first and last window
    # without cover (nothing to interpolate from); every window between is valid.
    assert v.valid[1:-1].all() and set(v.reason[~v.valid]) <= {"eeg not covered", "ecg not covered", "gsr not covered"}
    starts = v.starts[v.valid]
    for name, sig in signals.items():
        out = resample(sig, starts, SPEC)
        grid = starts[:, None] + np.arange(SPEC.points(sig.rate)) / sig.rate
        assert np.abs(out[..., 0] - grid).max() < 1e-3, name


def test_video_takes_the_nearest_frame() -> None:
    sig = probe_signal(30, 0.0, 30, drift_ppm=-60, jitter_s=0.0003, nearest=True)
    starts = np.arange(0.0, 27.0, 1.0)
    out = resample(sig, starts, SPEC)
    grid = starts[:, None] + np.arange(60) / 30
    chosen = out[..., 0]  # the true time of the frame chosen for each grid point
    # The nearest existing frame: no other frame is closer (by timestamp) to the grid point.
    nearest = sig.x[np.abs(sig.t[None, :] - grid.reshape(-1)[:, None]).argmin(axis=1), 0].reshape(grid.shape)
    assert np.array_equal(chosen, nearest)
    assert np.abs(chosen - grid).max() <= 0.5 / 30 + 1e-3


def test_jitter_never_makes_a_gap_but_three_missing_samples_do() -> None:
    clean = {"eeg": probe_signal(128, 0.0, 20, jitter_s=0.0009)}
    assert validity(clean, SPEC).valid.all()
    two = {"eeg": probe_signal(128, 0.0, 20, jitter_s=0.0003, drop=(640, 641))}
    assert validity(two, SPEC).valid.all()  # 2 missing in a row is allowed with max_gap 2
    three = {"eeg": probe_signal(128, 0.0, 20, drop=(640, 641, 642))}
    v = validity(three, SPEC)
    # Sample 640 sits at 5.0 s: windows [4, 6) and [5, 7) need it; [3, 5) ends at its last grid
    # point 4.992 s, bracketed by sample 639, so it does not.
    assert list(np.flatnonzero(~v.valid)) == [4, 5]
    assert set(v.reason[~v.valid]) == {"eeg gap > 2"}


def test_a_late_device_leaves_early_windows_uncovered_and_counted() -> None:
    signals = {"eeg": probe_signal(128, 0.0, 20), "gsr": probe_signal(4, 3.2, 20)}
    v = validity(signals, SPEC)
    assert list(v.reason[:4]) == ["gsr not covered"] * 4  # windows starting at 0, 1, 2, 3 s
    assert v.valid[4:].all()


def test_window_spec_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="^window must be > 0"):
        WindowSpec(0.0, 1.0, 2)
    with pytest.raises(ValueError, match="^max_gap must be >= 0"):
        WindowSpec(2.0, 1.0, -1)


@pytest.mark.parametrize("nearest", [False, True])
@pytest.mark.parametrize("hop", [1.0, 0.33])  # a whole number of 128 Hz periods, and not
def test_resample_matches_each_window_resampled_on_its_own(nearest: bool, hop: float) -> None:
    """Windows cut from one shared grid (hop a whole number of periods) hold what resampling each
    window on its own grid gives; so do windows of a hop that is not, which take that route."""
    from fuelline.server.multimodal.align import _shared_step, sample_on_grid

    sig = probe_signal(128, 0.0, 40, drift_ppm=40, jitter_s=0.0003, nearest=nearest, seed=3)
    spec = WindowSpec(2.0, hop, 2)
    v = validity({"eeg": sig}, spec)
    starts = v.starts[v.valid][::2]  # every other window: gaps between the ones asked for
    assert (_shared_step(sig, starts, spec) is not None) == (hop == 1.0)
    n = spec.points(sig.rate)
    own = np.stack([sample_on_grid(sig, s + np.arange(n) / sig.rate) for s in starts])  # (windows, points, channels)
    np.testing.assert_allclose(resample(sig, starts, spec), own, rtol=0, atol=1e-9)
    channels_first = resample(sig, starts, spec, channels_first=True)
    assert channels_first.flags.c_contiguous
    np.testing.assert_allclose(channels_first, own.transpose(0, 2, 1), rtol=0, atol=1e-9)
