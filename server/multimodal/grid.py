"""Each modality of a recording resampled once, when it is converted, onto its nominal grid on the
master clock, so that serving a window is a slice.

A recording's grid for a modality of rate r holds its samples at ``t0 + i / r``, i = 0 … points − 1,
where ``t0`` is the recording's first sample on the master clock over all modalities: the start of
its window 0, whatever the window and hop a server is started with. Window k starts at
``t0 + k · hop``; when ``hop · r`` is a whole number of periods (1 s hops at 128, 256, 4 and 30 Hz,
0.5 s hops…), its points are grid points ``k · hop · r`` … ``k · hop · r + length · r − 1``, the same
samples per-window resampling computes (``fuelline.server.multimodal.align``), but computed once per
recording instead of once per window that needs them. A server resamples per window only for the
modalities where the hop is not a whole number of periods, from the samples as recorded.

Grids are float32 in the layout a window is served in: (channels, points) for continuous signals,
(points, features) for video. Which windows are valid is still decided from the recorded
timestamps (coverage and gaps), so a grid point that lies in a gap or beyond a device's last
sample is never served.

On disk: per shard and modality, one Arrow IPC file (``<modality>/grid-NNNNN.arrow``) beside the
Parquet shard, holding record batch i for the shard's row group i: one float32 column ``x``, the
grid flattened, uncompressed, so that a server maps the file and slices it without decoding; and
``<modality>/zgrid-NNNNN.arrow``, the same grids z-scored per channel with the train split's
statistics, which is what a server normalising with them (the default) serves: it then maps the
windows it sends, normalised, without a pass over them. Each file's schema holds the xxh3 of its
grids (``fuelline.server.sources.fingerprint.CONTENT_KEY``; files written before it was added lack
it, and are served all the same), so that its footer, which a server hashes into the sequence
fingerprint at start-up, changes whenever its grids do.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa

from fuelline.protocol import DataError
from fuelline.server.multimodal.align import Signal, WindowSpec, sample_on_grid
from fuelline.server.sources.fingerprint import CONTENT_KEY, ContentDigest

__all__ = ["SCHEMA", "grid_file", "zgrid_file", "write_zscored", "grid_points", "grid_origin", "on_master_grid", "points_per_hop",
           "GridWriter", "grid_arrays", "shaped", "recording_grids", "cut_windows"]

SCHEMA = pa.schema([pa.field("x", pa.float32(), nullable=False)], metadata={"fuelline.grid": "1"})
TOLERANCE = 1e-9  # a hop within this many periods of a whole number of periods is one


def grid_file(parquet_file: str) -> str:
    """The grid file that goes with a Parquet shard (``eeg/part-00003.parquet`` → ``eeg/grid-00003.arrow``)."""
    folder, name = os.path.split(parquet_file)
    stem = name[: -len(".parquet")] if name.endswith(".parquet") else name
    return os.path.join(folder, stem.replace("part-", "grid-", 1) + ".arrow").replace("\\", "/")


def zgrid_file(parquet_file: str) -> str:
    """The z-scored grid file that goes with a Parquet shard (``eeg/zgrid-00003.arrow``)."""
    folder, name = os.path.split(grid_file(parquet_file))
    return os.path.join(folder, "z" + name).replace("\\", "/")


def write_zscored(source: str, target: str, stats: Mapping[str, Sequence[float]], nearest: bool) -> None:
    """``target``: every grid of the grid file ``source`` z-scored per channel with ``stats``
    (``{"mean": [...], "std": [...]}``), by the very operations a server would apply to it, so
    that serving from it gives the same bits. Written under a temporary name, then renamed."""
    from fuelline.server.multimodal.stages import Normalize

    channels = len(stats["mean"])
    # (the modality's name only tells Normalize where a batch has its channels)
    name, norm = ("video", Normalize({"video": stats})) if nearest else ("eeg", Normalize({"eeg": stats}))
    temporary = f"{target}.tmp-{os.getpid()}"
    writer = GridWriter(temporary)
    try:
        with pa.memory_map(source, "r") as mapped:
            for flat in grid_arrays(mapped, source):
                grid = flat.reshape((-1, channels) if nearest else (channels, -1))
                writer.append(norm({name: grid[None]})[name][0])
        writer.close()
        os.replace(temporary, target)
    except BaseException:
        writer.discard()
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def grid_origin(first_times: Mapping[str, float]) -> float:
    """A recording's ``t0``: its first sample on the master clock, over all modalities."""
    return min(float(t) for t in first_times.values())


def grid_points(t0: float, t_end: float, rate: float) -> int:
    """Grid points from ``t0`` to the recording's last sample (over all modalities): every point
    of every window that fits between the two, whatever its length and hop."""
    return int(np.floor((t_end - t0) * rate + TOLERANCE)) + 1


def on_master_grid(sig: Signal, t0: float, points: int) -> np.ndarray:
    """``sig`` at ``t0 + i / rate``: (channels, points) for a continuous signal, (points, features)
    for video (``sig.nearest``), float32, C-contiguous."""
    values = sample_on_grid(sig, t0 + np.arange(points) / sig.rate)
    return values if sig.nearest else np.ascontiguousarray(values.T)


def recording_grids(signals: Mapping[str, Signal]) -> dict[str, np.ndarray]:
    """Every modality of one recording on its master grid."""
    t0 = grid_origin({m: s.t[0] for m, s in signals.items()})
    t_end = max(float(s.t[-1]) for s in signals.values())
    return {m: on_master_grid(s, t0, grid_points(t0, t_end, s.rate)) for m, s in signals.items()}


def points_per_hop(spec: WindowSpec, rate: float) -> int | None:
    """Grid points from one window's start to the next's, when the hop is a whole number of
    periods at ``rate``; None when it is not (those windows are resampled one by one)."""
    step = spec.hop * rate
    whole = round(step)
    return int(whole) if whole >= 1 and abs(step - whole) <= TOLERANCE * max(1.0, step) else None


class GridWriter:
    """One shard's grid file of one modality: record batch i is the shard's row group i.

    The file's schema holds the xxh3 of its grids (``CONTENT_KEY``). Arrow takes a file's schema
    when the file is opened, and the digest is known only once the last grid is in (nor can
    pyarrow before 21 put metadata in a file's footer alone): so the grids go to ``<path>.unsealed`` as they come, and
    ``close`` copies them, mapped, into ``path`` under the schema that names their digest (a few
    milliseconds for 30 MB, against the second it took to compute them) and removes that file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._unsealed = f"{path}.unsealed"
        self._digest = ContentDigest()
        self._sink = pa.OSFile(self._unsealed, "wb")
        self._writer = pa.ipc.new_file(self._sink, SCHEMA)

    def append(self, grid: np.ndarray) -> None:
        flat = np.ascontiguousarray(grid, dtype="<f4").reshape(-1)
        self._digest.update(flat)
        self._writer.write_batch(pa.record_batch([pa.array(flat, pa.float32())], schema=SCHEMA))

    def close(self) -> None:
        """Write the file at ``path``, its schema naming the digest of its grids."""
        if self._sink.closed:
            return
        self._writer.close()
        self._sink.close()
        try:
            schema = SCHEMA.with_metadata({**SCHEMA.metadata, CONTENT_KEY.encode(): self._digest.hexdigest().encode()})
            with pa.memory_map(self._unsealed) as mapped, pa.OSFile(self.path, "wb") as sink, \
                    pa.ipc.new_file(sink, schema) as writer:
                reader = pa.ipc.open_file(mapped)
                for i in range(reader.num_record_batches):
                    writer.write_batch(reader.get_batch(i))
        finally:
            os.unlink(self._unsealed)

    def discard(self) -> None:
        """Stop writing, and leave no file (``path`` is not written)."""
        if not self._sink.closed:
            self._writer.close()
            self._sink.close()
        if os.path.exists(self._unsealed):
            os.unlink(self._unsealed)


def grid_arrays(source: pa.MemoryMappedFile, where: str) -> list[np.ndarray]:
    """Every grid of a mapped grid file, in record-batch order: flat read-only float32 views of the
    map (nothing is decoded or copied until windows are gathered from them)."""
    try:
        reader = pa.ipc.open_file(source)
        if reader.schema.remove_metadata() != SCHEMA.remove_metadata():
            raise DataError(f"{where}: not a grid file (schema {reader.schema})")
        columns = [reader.get_batch(i).column(0) for i in range(reader.num_record_batches)]
    except DataError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{where}: {exc}") from None
    if any(c.null_count for c in columns):
        raise DataError(f"{where}: a grid holds nulls")
    return [c.to_numpy(zero_copy_only=True) for c in columns]


def shaped(grids: list[np.ndarray], index: int, shape: tuple[int, int], where: str) -> np.ndarray:
    """Grid ``index`` of a file's ``grids``, as the manifest says it is shaped."""
    if not 0 <= index < len(grids):
        raise DataError(f"{where}: the file holds {len(grids)} grids, not grid {index}")
    if len(grids[index]) != shape[0] * shape[1]:
        raise DataError(f"{where}: grid {index} holds {len(grids[index])} values, the manifest says {shape[0]} × {shape[1]}")
    return grids[index].reshape(shape)


def cut_windows(grid: np.ndarray, first: np.ndarray, step: int, points: int, nearest: bool) -> np.ndarray:
    """Windows ``first`` (ascending window numbers) of a grid, ``points`` long, ``step`` points
    apart: (windows, channels, points), or (windows, points, features) for video. A view of the
    grid when the windows are consecutive (the usual case: a recording's valid windows run from
    its first to its last but where a device drops out), else one copy per run of them."""
    if len(first) and int(first[-1]) * step + points > grid.shape[0 if nearest else 1]:
        raise DataError(f"window {int(first[-1])} needs {int(first[-1]) * step + points} grid points, "
                        f"the grid has {grid.shape[0 if nearest else 1]}")
    if nearest:  # (P, D) → (K, D, n) → (K, n, D)
        every = np.lib.stride_tricks.sliding_window_view(grid, points, axis=0)[::step].transpose(0, 2, 1)
    else:  # (C, P) → (C, K, n) → (K, C, n)
        every = np.lib.stride_tricks.sliding_window_view(grid, points, axis=1)[:, ::step].transpose(1, 0, 2)
    if not len(first):
        return np.empty((0, *every.shape[1:]), dtype=grid.dtype)
    breaks = np.flatnonzero(np.diff(first) != 1) + 1
    if not len(breaks):
        return every[int(first[0]) : int(first[-1]) + 1]
    out = np.empty((len(first), *every.shape[1:]), dtype=grid.dtype)
    for lo, hi in zip([0, *breaks.tolist()], [*breaks.tolist(), len(first)]):
        out[lo:hi] = every[int(first[lo]) : int(first[hi - 1]) + 1]
    return out
