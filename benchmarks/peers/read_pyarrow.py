"""A torch DataLoader over pyarrow, in the trainer's own process: what a user writes without a
data server.

An ``IterableDataset`` reads the table's row groups in a shuffled order (seeded per epoch), each
with ``ParquetFile.read_row_group`` into numpy, and keeps a shuffle buffer of ``--shuffle-rows``
rows: once it is full, each batch is ``--batch-size`` rows drawn at random from it, and the rows
drawn are replaced by the buffer's last ones (a streaming shuffle buffer, vectorised per batch
rather than per row). It yields whole batches as tensors (``torch.from_numpy``), read through
``DataLoader(batch_size=None, num_workers=K)``; with K workers, worker w reads every K-th row group
of the epoch's order, with a buffer of its own.

The columns are the data folder's (``readerlib.columns``): the flat table's, or the windows'
sources, whose fixed-size lists are reshaped to the shape a window's source has; for the windows,
a row group is a recording.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import readerlib
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class ShuffledRowGroups(IterableDataset):
    def __init__(self, folder: Path, cols: list[readerlib.Column], batch_size: int, buffer_rows: int, seed: int) -> None:
        self.cols = cols
        self.files = sorted(folder.glob("*.parquet"))
        self.groups = [(f, g) for f in self.files for g in range(pq.ParquetFile(f).num_row_groups)]
        self.batch_size, self.buffer_rows, self.seed = batch_size, buffer_rows, seed
        self.epoch = 0

    def _row_groups(self, rng: np.random.Generator) -> Iterator[dict[str, np.ndarray]]:
        order = rng.permutation(len(self.groups))
        info = get_worker_info()
        if info is not None:
            order = order[info.id::info.num_workers]
        opened: dict[Path, pq.ParquetFile] = {}
        for i in order:
            path, group = self.groups[i]
            pf = opened.get(path) or opened.setdefault(path, pq.ParquetFile(path))
            yield readerlib.table_arrays(pf.read_row_group(group, columns=[c.name for c in self.cols]), self.cols)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        rng = np.random.default_rng((self.seed, self.epoch))
        buffer: dict[str, np.ndarray] | None = None
        size = 0
        for group in self._row_groups(rng):
            buffer, size = _append(buffer, size, group)
            while size >= self.buffer_rows:
                batch, size = _draw(buffer, size, self.batch_size, rng)
                yield tuple(batch[c.name] for c in self.cols)
        while buffer is not None and size > 0:
            batch, size = _draw(buffer, size, min(self.batch_size, size), rng)
            yield tuple(batch[c.name] for c in self.cols)


def _append(buffer: dict[str, np.ndarray] | None, size: int, group: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    n = len(next(iter(group.values())))
    if buffer is None or size + n > len(next(iter(buffer.values()))):
        grown = {k: np.empty((max(2 * (size + n), 1),) + v.shape[1:], v.dtype) for k, v in group.items()}
        if buffer is not None:
            for k in grown:
                grown[k][:size] = buffer[k][:size]
        buffer = grown
    for k, v in group.items():
        buffer[k][size:size + n] = v
    return buffer, size + n


def _draw(buffer: dict[str, np.ndarray], size: int, n: int, rng: np.random.Generator) -> tuple[dict[str, torch.Tensor], int]:
    """``n`` rows at random out of the buffer's first ``size``; the last ``n`` rows take their places."""
    picked = rng.choice(size, n, replace=False)
    batch = {k: torch.from_numpy(v[picked]) for k, v in buffer.items()}
    tail = np.arange(size - n, size)
    keep_tail = tail[~np.isin(tail, picked)]
    holes = np.sort(picked[picked < size - n])
    for k in buffer:
        buffer[k][holes] = buffer[k][keep_tail]
    return batch, size - n


def main() -> int:
    args = readerlib.parser(__doc__).parse_args()
    try:
        with readerlib.ProcTree() as tree:
            started = time.perf_counter()
            dataset = ShuffledRowGroups(Path(args.data) / "parquet", readerlib.columns(args.data), args.batch_size, args.shuffle_rows, args.seed)
            loader = DataLoader(dataset, batch_size=None, num_workers=args.workers,
                                timeout=args.timeout if args.workers else 0)

            def epoch(e: int) -> Any:
                dataset.epoch = e
                return loader

            result = readerlib.measure(tree, epoch, args, started)
            readerlib.emit(result, tree, versions={"torch": torch.__version__, "pyarrow": pa.__version__})
        return 0
    except Exception as exc:
        return readerlib.fail(exc)


if __name__ == "__main__":
    raise SystemExit(main())
