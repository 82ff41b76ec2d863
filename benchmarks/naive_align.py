"""The yardstick of the server's CPU per window: a naive in-memory numpy alignment of the same
windows, window by window.

Everything is decoded and in memory before the clock starts (each recording's master times, and its
samples channel by channel as contiguous float64, which ``np.interp`` wants). Per window and
modality: ``searchsorted`` for the samples around the window, then ``np.interp`` per channel onto
``start + i / rate`` (continuous signals) or the nearest frame (video), written into the batch.
No decoding, normalisation, checksums or sending: alignment alone, as a script would do it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from benchmarks.common import Round
from fuelline.server.multimodal.source import WindowSource

__all__ = ["NaiveRecording", "load", "naive_round"]


@dataclass(frozen=True)
class NaiveRecording:
    signals: dict[str, tuple[np.ndarray, np.ndarray, float, bool]]  # modality -> (t, x, rate, nearest)
    starts: np.ndarray  # the valid windows' starts, master clock


def load(dataset: str, split: str = "train") -> tuple[list[NaiveRecording], float]:
    """Every recording of a split in memory, and the window length (the source's default)."""
    src = WindowSource(dataset)
    out = []
    for u in range(len(src.unit_rows(split))):
        signals, starts = src.recording(split, u)
        prepared = {}
        for m, sig in signals.items():
            # video frames stay rows; a continuous signal becomes one contiguous float64 row per channel
            x = sig.x if sig.nearest else np.ascontiguousarray(sig.x.T, dtype=np.float64)
            prepared[m] = (sig.t, x, sig.rate, sig.nearest)
        out.append(NaiveRecording(prepared, starts))
    length = src.spec.length
    src.close()
    return out, length


def naive_round(recordings: list[NaiveRecording], length: float, batch_size: int, epochs: int = 1) -> Round:
    """Align every window of ``recordings`` ``epochs`` times, into batches of ``batch_size``.

    The Round's ``producer_cpu_s`` is this process's CPU over the pass (the aligning side, as the
    server's is for a served pass); it has no consumer apart."""
    first = recordings[0].signals
    shapes = {m: ((int(round(length * r)), x.shape[1]) if nearest else (x.shape[0], int(round(length * r))))
              for m, (t, x, r, nearest) in first.items()}
    batch = {m: np.empty((batch_size, *shape), dtype=np.float32) for m, shape in shapes.items()}
    grids = {m: np.arange(int(round(length * r))) / r for m, (_, _, r, _) in first.items()}
    windows = batches = nbytes = 0
    b = 0
    cpu0, started = time.process_time(), time.perf_counter()
    for _ in range(epochs):
        for rec in recordings:
            for start in rec.starts:
                for m, (t, x, _, nearest) in rec.signals.items():
                    grid = start + grids[m]
                    lo = max(int(np.searchsorted(t, grid[0], side="right")) - 1, 0)
                    hi = min(int(np.searchsorted(t, grid[-1], side="left")) + 1, len(t))
                    if nearest:
                        j = np.clip(np.searchsorted(t[lo:hi], grid), 1, hi - lo - 1)
                        earlier = (grid - t[lo:hi][j - 1]) <= (t[lo:hi][j] - grid)
                        batch[m][b] = x[lo + np.where(earlier, j - 1, j)]
                    else:
                        out = batch[m][b]
                        for c in range(x.shape[0]):
                            out[c] = np.interp(grid, t[lo:hi], x[c, lo:hi])
                b += 1
                windows += 1
                if b == batch_size:
                    batches += 1
                    nbytes += sum(a.nbytes for a in batch.values())
                    b = 0
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu0
    return Round(batches, windows, nbytes, seconds, 0.0, cpu)
