"""What a serving loop needs from a source of batches: ``BatchSource``, every member named.

A source knows its sources (the arrays of a batch), its splits, and can produce batch ``start``,
``start + 1``... of any epoch for any rank, deterministically. Implementations:
``fuelline.server.sources.parquet.ParquetSource``, the aligned windows of a converted multimodal
dataset (``fuelline.server.multimodal.source.WindowSource``) and, for any Fuel-style stream,
``fuelline.server.sources.fuel.FuelStreamSource``.

The serving side (sessions, status lines, metrics) uses these members and no others; it never
probes for optional ones. A source must implement the abstract members; the rest have defaults
that say "nothing of the kind" (no worker processes, nothing dropped, batches that may be
written to), and a source that has such things overrides them.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from typing import Any, Callable, Generator, Mapping, NamedTuple, Sequence

import numpy as np

from fuelline.server.sources.counters import Counts

__all__ = ["BatchSource", "Batches", "StageRun", "Steps", "Waiting"]

# What ``iter_batches`` returns: a generator, so that a session that stops early closes it and
# the source lets go of its files, threads and buffers at once.
Batches = Generator[dict[str, np.ndarray], None, None]


class Waiting:
    """What ``iter_steps`` yields where its next batch needs work done on other threads (a
    decode): the futures of that work. Asked again once they are done, it goes on."""

    __slots__ = ("futures",)

    def __init__(self, futures: Sequence[Future]) -> None:
        self.futures = tuple(futures)


# What ``iter_steps`` returns: batches, and a ``Waiting`` wherever the next one is not ready.
Steps = Generator["dict[str, np.ndarray] | Waiting", None, None]


class StageRun(NamedTuple):
    """A batch in a user's stage now: which stage (``module:function``), which batch (in words),
    and since when (``time.monotonic()``)."""

    stage: str
    batch: str
    started: float


class BatchSource(abc.ABC):
    """The interface ``fuelline.server.Server`` serves."""

    # Batches are never written once yielded, so the memory tier may keep them as they are
    # (otherwise it keeps copies).
    immutable_batches: bool = False
    # Worker processes asked for (``--workers``), for the metrics.
    workers: int = 0
    # ``iter_steps`` never waits (it yields ``Waiting`` instead) and runs no user code (a user's
    # stage runs on other threads, and ``iter_steps`` waits for it as for a decode): preparing a
    # batch is work a serving loop may do on its own thread between requests, at its own pace.
    # Otherwise each client's batches are prepared on a thread of their own, which may wait on
    # anything.
    cooperative: bool = False

    def __init__(self) -> None:
        # Event counts (cache hits and misses per tier, worker restarts...) for status and metrics.
        self.counters = Counts()
        # Shards or recordings left out at start-up (``--on-bad-shard skip``), one dict each.
        self.skipped: list[dict[str, str]] = []

    # -- what every source supplies ------------------------------------------------------------
    @property
    @abc.abstractmethod
    def sources(self) -> tuple[str, ...]:
        """All source names, in their canonical order."""

    @property
    @abc.abstractmethod
    def splits(self) -> tuple[str, ...]:
        """The split names a client may ask for."""

    @abc.abstractmethod
    def schema(self) -> Mapping[str, Mapping[str, Any]]:
        """Per source ``{"dtype": str | None, "shape": list | None}`` (shape without batch axis)."""

    @abc.abstractmethod
    def info(self, split: str) -> Mapping[str, Any]:
        """Plain facts about a split, sent to clients in their Welcome."""

    @abc.abstractmethod
    def fingerprint(self, split: str) -> dict[str, str]:
        """The sequence fingerprint of a split, sent to clients in their Welcome: named parts (at
        most 64, values of at most 256 characters) of everything that decides which batch a
        position means (files, seed, batch size, shuffle, windowing, stages...), and nothing that
        does not (workers, caches, where the files are mounted). Clients refuse a server whose
        fingerprint differs from the one their position was read under, naming the part. See
        ``fuelline.server.sources.fingerprint``."""

    @abc.abstractmethod
    def batches_per_epoch(self, split: str, rank: int, world_size: int) -> int | None:
        """Batches each rank gets per epoch, or None if unknown until the epoch ends."""

    @abc.abstractmethod
    def iter_batches(
        self, split: str, epoch: int, rank: int, world_size: int, start: int, sources: tuple[str, ...],
        on_loss: Callable[[str], None] | None = None, history: Sequence[tuple[int, ...]] = (),
    ) -> Batches:
        """Batches ``start, start + 1, …`` of one epoch for one rank, then stop.

        Args:
            on_loss: hears of data the source had to leave out, in words.
            history: the segments of this epoch already run at other world sizes, as
                ``(world_size, batches[, stride, extra])`` (``Hello.history``,
                ``fuelline.server.sources.ordering.remaining_order``);
                a source that cannot resume on another world size raises ``DataError`` for any.
        """

    def iter_steps(
        self, split: str, epoch: int, rank: int, world_size: int, start: int, sources: tuple[str, ...],
        on_loss: Callable[[str], None] | None = None, history: Sequence[tuple[int, ...]] = (),
    ) -> Steps:
        """``iter_batches``, with a ``Waiting`` yielded wherever the next batch is not ready
        instead of waiting for it. A ``cooperative`` source overrides it; this default waits."""
        yield from self.iter_batches(split, epoch, rank, world_size, start, sources, on_loss, history)

    @abc.abstractmethod
    def close(self) -> None:
        """Release files, memory and worker processes."""

    # -- what a source may add ------------------------------------------------------------------
    def why_not_servable(self, name: str) -> str | None:
        """Why the array ``name`` (asked for by a client) is not served, or None if it is
        served or simply unknown."""
        return None

    def dropped(self, split: str) -> Mapping[str, int]:
        """Examples (windows) left out of ``split`` at start-up, counted by reason."""
        return {}

    def worker_pids(self) -> list[int]:
        """The worker processes running now."""
        return []

    def memory_per_client(self, split: str) -> int:
        """Bytes a client of ``split`` holds in this server at most (read-ahead, prepared batches)."""
        return 0

    def stage_runs(self) -> Sequence[StageRun]:
        """The batches in a user's stage now, longest running first: what a server warns about
        when one takes long, and names when it stops without them."""
        return ()

    def stage_times(self) -> Mapping[str, tuple[int, float]]:
        """Per stage (``module:function``): the batches it finished and the seconds it took."""
        return {}
