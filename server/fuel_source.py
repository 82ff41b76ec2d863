"""Serve any Fuel-style stream: an object with ``.sources`` and ``.get_epoch_iterator()``.

Each epoch of each client calls ``get_epoch_iterator()`` once and takes the batches of its rank
round-robin (batch i goes to rank i mod world_size). So that every rank gets the same number of
batches, the ranks short of one at the end are padded with the epoch's first batches, as
DistributedSampler pads. A resumed client skips the batches before its cursor by iterating past
them, so the order is as deterministic as the stream itself.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Mapping

import numpy as np

from fuelline.protocol import DataError

__all__ = ["FuelStreamSource"]

DEFAULT_SPLIT = "train"


class FuelStreamSource:
    """Adapts Fuel-style streams (one, or a mapping of split name to stream)."""

    def __init__(self, data_stream: Any) -> None:
        streams = data_stream if isinstance(data_stream, Mapping) else {DEFAULT_SPLIT: data_stream}
        if not streams:
            raise DataError("start_server needs at least one data stream")
        self._streams = dict(streams)
        self._locks = {name: threading.Lock() for name in self._streams}
        sources = None
        for split, stream in self._streams.items():
            if not hasattr(stream, "get_epoch_iterator") or not hasattr(stream, "sources"):
                raise DataError(
                    f"data stream for split {split!r} ({type(stream).__name__}) lacks "
                    "`.sources` or `.get_epoch_iterator()`"
                )
            names = tuple(stream.sources)
            if sources is not None and names != sources:
                raise DataError(f"split {split!r} has sources {names}, other splits have {sources}")
            sources = names
        if not sources or not all(isinstance(s, str) and s for s in sources):
            raise DataError(f"data stream sources must be non-empty strings, got {sources!r}")
        self._sources: tuple[str, ...] = sources

    @property
    def sources(self) -> tuple[str, ...]:
        return self._sources

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self._streams)

    def schema(self) -> Mapping[str, Mapping[str, Any]]:
        # Unknown until a batch exists, and peeking would advance the stream's state.
        return {name: {"dtype": None, "shape": None} for name in self._sources}

    def why_not_servable(self, name: str) -> str | None:
        return None

    def info(self, split: str) -> Mapping[str, Any]:
        return {"kind": "fuel-stream", "split": split, "splits": list(self._streams), "stream": type(self._streams[split]).__name__}

    def batches_per_epoch(self, split: str, rank: int, world_size: int) -> None:
        return None

    def _epoch(self, split: str) -> Iterator[tuple]:
        lock = self._locks[split]
        with lock:
            it = iter(self._streams[split].get_epoch_iterator())
        while True:
            # Streams are not required to be thread-safe; sessions take turns.
            with lock:
                try:
                    batch = next(it)
                except StopIteration:
                    return
            yield batch

    def _as_arrays(self, batch: Any, index: int, sources: tuple[str, ...]) -> dict[str, np.ndarray]:
        if isinstance(batch, Mapping):
            values = [batch[name] for name in self._sources]
        else:
            values = list(batch)
        if len(values) != len(self._sources):
            raise DataError(
                f"batch {index} of the stream has {len(values)} values for {len(self._sources)} sources {self._sources}"
            )
        by_name = dict(zip(self._sources, values))
        return {name: np.asarray(by_name[name]) for name in sources}

    def iter_batches(
        self, split: str, epoch: int, rank: int, world_size: int, start: int, sources: tuple[str, ...],
        on_loss: object = None,
        history: object = (),
    ) -> Iterator[dict[str, np.ndarray]]:
        if history:
            raise DataError(
                "a Fuel-style stream cannot resume an epoch on another world size; "
                "finish the epoch at the old world size, or serve a Parquet dataset"
            )
        head: list[dict[str, np.ndarray]] = []  # the first world_size batches, kept for padding
        mine = 0
        total = 0
        for total, batch in enumerate(self._epoch(split), start=1):
            i = total - 1
            arrays = None
            if i < world_size:
                arrays = {k: np.array(v) for k, v in self._as_arrays(batch, i, sources).items()}
                head.append(arrays)
            if i % world_size == rank:
                if mine >= start:
                    yield arrays if arrays is not None else self._as_arrays(batch, i, sources)
                mine += 1
        if total == 0:
            return
        per_rank = -(-total // world_size)
        while mine < per_rank:
            # Position mine of this rank is padded-sequence index rank + mine*world_size >= total.
            pad = (rank + mine * world_size) % total
            if mine >= start:
                yield head[pad]
            mine += 1

    def close(self) -> None:
        pass
