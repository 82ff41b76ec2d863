"""What a serving loop needs from a source of batches.

A source knows its sources (the arrays of a batch), its splits, and can produce batch ``start``,
``start + 1``... of any epoch for any rank, deterministically. Two implementations:
``fuelline.server.sources.parquet.ParquetSource``, the aligned windows of a converted multimodal
dataset (``fuelline.server.multimodal.source.WindowSource``) and, for any Fuel-style stream,
``fuelline.server.sources.fuel.FuelStreamSource``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Protocol

import numpy as np

__all__ = ["BatchSource"]


class BatchSource(Protocol):
    """The interface ``fuelline.server.Server`` serves."""

    @property
    def sources(self) -> tuple[str, ...]:
        """All source names, in their canonical order."""

    @property
    def splits(self) -> tuple[str, ...]:
        """The split names a client may ask for."""

    def schema(self) -> Mapping[str, Mapping[str, Any]]:
        """Per source ``{"dtype": str | None, "shape": list | None}`` (shape without batch axis)."""

    def info(self, split: str) -> Mapping[str, Any]:
        """Plain facts about a split, sent to clients in their Welcome."""

    def fingerprint(self, split: str) -> dict[str, str]:
        """The sequence fingerprint of a split, sent to clients in their Welcome: named parts (at
        most 64, values of at most 256 characters) of everything that decides which batch a
        position means (files, seed, batch size, shuffle, windowing, stages...), and nothing that
        does not (workers, caches, where the files are mounted). Clients refuse a server whose
        fingerprint differs from the one their position was read under, naming the part. See
        ``fuelline.server.sources.fingerprint``."""

    def batches_per_epoch(self, split: str, rank: int, world_size: int) -> int | None:
        """Batches each rank gets per epoch, or None if unknown until the epoch ends."""

    def iter_batches(
        self, split: str, epoch: int, rank: int, world_size: int, start: int, sources: tuple[str, ...],
        on_loss: Callable[[str], None] | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches ``start, start + 1, …`` of one epoch for one rank, then stop; ``on_loss`` hears
        of data the source had to leave out."""

    def close(self) -> None:
        """Release files and memory."""
