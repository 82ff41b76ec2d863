"""Serve any Fuel-style stream: an object with ``.sources`` and ``.get_epoch_iterator()``.

The ranks of an epoch share one pass over the stream (``fuelline.server.sources.fuel_epochs``): the server
calls ``get_epoch_iterator()`` once per (split, epoch), so a stream that shuffles differently on
every call still gives every rank, and every client that reconnects, its share of one order.
Batch i of the pass goes to rank i mod world_size. So that every rank gets the same number of
batches, a rank short of one at the end is padded with one of the epoch's first batches, as
DistributedSampler pads; a rank needs at most one such batch, and takes it only then. A resumed
client starts at its cursor in the same pass.

Buffers. Many streams refill one preallocated array per batch, while the server holds a batch
well after the stream moved on (the shared pass, read-ahead, zero-copy sends that leave when the
socket gets to them). So by default each batch is copied once as it is read, and checksummed in
the same pass over its bytes (``fuelline.protocol.arrays.copy_with_checksum``): from then on the
server holds, checks and sends only its own copy. The copy goes straight to where the batch goes:
for a client on the server's host, into the shared memory it maps (``SessionSlabs.carve``), so that
nothing copies it again; otherwise into memory used again once nothing holds it
(``fuelline.server.sources.recycled``). A stream whose every batch is new arrays that nothing
writes to afterwards can say so with ``fresh_arrays=True`` and be served from them.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from fuelline.protocol import WIRE_DTYPES, DataError
from fuelline.protocol.arrays import Checksummed, copy_with_checksum
from fuelline.protocol.messages import MAX_HISTORY_WORLD
from fuelline.server.sources.buffers import carved
from fuelline.server.sources.contract import Batches, BatchSource
from fuelline.server.sources.fuel_epochs import SharedEpochs
from fuelline.server.sources.recycled import RecycledBuffers

__all__ = ["FuelStreamSource", "MAX_WORLD", "DEFAULT_BUFFER_MB"]

DEFAULT_SPLIT = "train"
DEFAULT_BUFFER_MB = 256
# Ranks a Fuel stream is served to at most: as many as a resume history may name. The padding of
# a rank costs nothing more for a larger world, but a world of 2**40 is no job's; it is a mistake.
MAX_WORLD = MAX_HISTORY_WORLD
MAX_PART = 200  # characters of a fingerprint part kept


class FuelStreamSource(BatchSource):
    """Adapts Fuel-style streams (one, or a mapping of split name to stream).

    Args:
        data_stream: a stream, or a mapping of split name to stream.
        buffer_mb: the batches of an epoch's pass are held up to this many MB (all splits and
            epochs together), so that ranks that read the epoch at different speeds, start late
            or reconnect get them from the one pass. A rank further behind reads the stream
            again, checked batch by batch against the pass: fine for a deterministic stream,
            refused (a DataError) for one that shuffles anew on every call.
        fresh_arrays: the stream promises that every batch it yields is arrays of its own that
            neither it nor anyone else writes to afterwards; they are then held and sent as they
            are, not copied. False (the default) copies each batch once as it is read, so a
            stream may refill the same buffers for every batch.
    """

    def __init__(self, data_stream: Any, buffer_mb: int = DEFAULT_BUFFER_MB, *, fresh_arrays: bool = False) -> None:
        if not isinstance(buffer_mb, int) or buffer_mb < 0:
            raise ValueError(f"buffer_mb must be a whole number of MB >= 0, got {buffer_mb!r}")
        if not isinstance(fresh_arrays, bool):
            raise ValueError(f"fresh_arrays must be True or False, got {fresh_arrays!r}")
        super().__init__()
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
        self._fresh = fresh_arrays
        self._copied = 0  # bytes copied out of the stream's arrays
        self._copied_lock = threading.Lock()
        # The copies' memory, used again once nothing holds it: the held batches (the budget)
        # and what sessions still hold beyond them (their memory tier, queued sends).
        budget = buffer_mb * 2**20
        self._buffers = RecycledBuffers(0 if fresh_arrays else budget + max(64 * 2**20, budget // 4))
        self._epochs = SharedEpochs(self._open, self._as_arrays, self._locks, budget)

    @property
    def sources(self) -> tuple[str, ...]:
        return self._sources

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self._streams)

    def schema(self) -> Mapping[str, Mapping[str, Any]]:
        # Unknown until a batch exists, and peeking would advance the stream's state.
        return {name: {"dtype": None, "shape": None} for name in self._sources}

    def info(self, split: str) -> Mapping[str, Any]:
        return {"kind": "fuel-stream", "split": split, "splits": list(self._streams), "stream": type(self._streams[split]).__name__}

    def batches_per_epoch(self, split: str, rank: int, world_size: int) -> None:
        return None

    def fingerprint(self, split: str) -> dict[str, str]:
        """What identifies the stream without reading it: its type, sources and splits, and what
        a Fuel ``DataStream`` says of its dataset and iteration scheme."""
        stream = self._streams[split]
        parts = {
            "kind": "fuel-stream",
            "split": split,
            "stream": _type_name(stream),
            "sources": ",".join(self._sources),
            "splits": ",".join(self._streams),
        }
        dataset = getattr(stream, "dataset", None)
        if dataset is not None:
            parts["dataset"] = _type_name(dataset)
            examples = getattr(dataset, "num_examples", None)
            if isinstance(examples, int):
                parts["examples"] = str(examples)
        scheme = getattr(stream, "iteration_scheme", None)
        if scheme is not None:
            parts["scheme"] = _type_name(scheme)
            batch_size = getattr(scheme, "batch_size", None)
            if isinstance(batch_size, int):
                parts["batch_size"] = str(batch_size)
        return {k: v if len(v) <= MAX_PART else v[: MAX_PART - 1] + "…" for k, v in parts.items()}

    def _open(self, split: str) -> Iterator[Any]:
        return iter(self._streams[split].get_epoch_iterator())

    def _as_arrays(self, batch: Any, index: int, mine: bool = False) -> dict[str, np.ndarray]:
        """The batch's arrays by source: the server's own copies (checksummed as they are made),
        or the stream's arrays themselves where it promised fresh ones. ``mine``: the batch goes
        to the session whose thread this is (else to another rank's, later)."""
        if isinstance(batch, Mapping):
            values = [batch[name] for name in self._sources]
        else:
            values = list(batch)
        if len(values) != len(self._sources):
            raise DataError(
                f"batch {index} of the stream has {len(values)} values for {len(self._sources)} sources {self._sources}"
            )
        arrays = {name: np.asarray(v) for name, v in zip(self._sources, values)}
        if self._fresh:
            return arrays
        # Straight to where the batch goes: a session whose client reads shared memory has its
        # own batches copied into its slabs, the only copy made; others into memory used again.
        specs = [(a.shape, a.dtype) for a in arrays.values()]
        outs = carved(specs) if mine and all(a.dtype.str in WIRE_DTYPES for a in arrays.values()) else None
        if outs is None:
            outs = [self._buffers.empty(shape, dtype) for shape, dtype in specs]
        copies, sums = {}, {}
        for (name, a), out in zip(arrays.items(), outs):
            copies[name], sums[name] = copy_with_checksum(a, out)
        with self._copied_lock:
            self._copied += sum(a.nbytes for a in copies.values())
        return Checksummed(copies, sums)

    def iter_batches(
        self, split: str, epoch: int, rank: int, world_size: int, start: int, sources: tuple[str, ...],
        on_loss: Callable[[str], None] | None = None,
        history: Sequence[tuple[int, ...]] = (),
    ) -> Batches:
        if history:
            raise DataError(
                "a Fuel-style stream cannot resume an epoch on another world size; "
                "finish the epoch at the old world size, or serve a Parquet dataset"
            )
        if world_size > MAX_WORLD:
            raise DataError(f"world size {world_size} is more ranks than a Fuel stream is served to (at most {MAX_WORLD})")
        shared = self._epochs
        reader = shared.reader(split, epoch, rank, world_size, start)
        try:
            slot = start
            while (batch := shared.get(reader, rank + slot * world_size)) is not None:
                slot += 1
                reader.slot = slot  # (before the yield: this reader is done with that batch)
                yield _subset(batch, sources)
            total = shared.total(reader) or 0  # (known once the pass has ended)
            per_rank = -(-total // world_size) if total else 0
            # Past the end of the pass: the rank's last slot wraps to one of its first batches.
            while slot < per_rank:
                batch = shared.get(reader, (rank + slot * world_size) % total)
                assert batch is not None  # (an index within the pass)
                slot += 1
                reader.slot = slot
                yield _subset(batch, sources)
        finally:
            shared.release(reader)

    @property
    def buffer_stats(self) -> dict[str, int]:
        """Bytes of batches held now and at most so far, the budget, and bytes copied out of the
        stream's arrays so far (0 with ``fresh_arrays``)."""
        return {"held": self._epochs.held_bytes, "peak": self._epochs.peak_bytes, "budget": self._epochs.budget,
                "copied": self._copied}

    def close(self) -> None:
        self._epochs.close()
        self._buffers.clear()


def _subset(batch: dict[str, np.ndarray], sources: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The sources a session asked for, with the checksums the shared pass took of them."""
    if isinstance(batch, Checksummed):
        return batch.subset(sources)
    return {name: batch[name] for name in sources}


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"
