"""Serving units of rows (row groups, recordings) in epoch order, a block at a time.

``UnitSource`` is the part every unit-based source shares: the epoch plan (see
``fuelline.server.sources.ordering``), sharding, batch counts, and a per-client ``BlockReader`` that
decodes whole blocks of units ahead of need. A source supplies how many rows each unit has and how
to decode one unit into column arrays.

Units are decoded on read-ahead threads of the serving process (``workers=0``) or, with
``workers=N``, in N worker processes (``fuelline.server.workers.pool``) that get a pickled copy of the
source: ``__getstate__`` leaves out what belongs to the serving process alone. A source whose
``finish_batch`` runs a user's code (``user_stages``) has it run on the threads of a
``StagePool`` when a serving loop steps it (``iter_steps``), never on the loop.
"""

from __future__ import annotations

import abc
import functools
import logging
import os
import pickle
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, cast

import numpy as np

from fuelline.protocol.common.threadnames import name_this_thread
from fuelline.server.cache.decoded import DecodedUnits
from fuelline.server.sources.block_reader import BlockReader, Column
from fuelline.server.sources.contract import Batches, BatchSource, StageRun, Steps, Waiting
from fuelline.server.sources.epoch_plan import EpochPlan
from fuelline.server.sources.options import SourceOptions
from fuelline.server.sources.ordering import RankRows, batches_per_rank, rank_rows, remaining_order
from fuelline.server.sources.stage_pool import StagePool

if TYPE_CHECKING:
    from fuelline.server.workers.pool import WorkerPool

__all__ = ["Column", "UnitSource", "BlockReader"]  # (Column and BlockReader are block_reader's, re-exported)

log = logging.getLogger("fuelline.server")

STAGE_THREADS_MIN = 4  # the stage pool's threads at least, by default: one reader's slow stage never fills it


class UnitSource(BatchSource):
    """Base of sources whose data comes in units; subclasses implement ``unit_rows``,
    ``column_specs`` and ``decode_unit``, may override ``finish_batch``, and fill ``_columns``
    (name -> column with ``to_schema()``, in serving order) and ``_splits`` (name -> split).

    The options every unit source takes are one ``SourceOptions``
    (``fuelline.server.sources.options``), checked when it is made.
    """

    _columns: Mapping[str, Any]
    _splits: Mapping[str, Any]
    # Attributes a worker process's copy does without (set to None there): a subclass lists what
    # only the serving process uses and would be costly or impossible to pickle.
    _serving_only: tuple[str, ...] = ()
    _TRANSIENT = ("_pool", "_pool_lock", "_process_pool", "_decoded", "_stages")
    immutable_batches = True  # batches are never written once yielded (the memory tier keeps them as they are)
    cooperative = True  # decodes run on read-ahead threads or worker processes: ``iter_steps`` waits on none
    store: Any = None  # where a subclass reads its files (fuelline.server.sources.storage.Store), if it has one
    # The user's code ``finish_batch`` runs (``module:function`` each, in order): a serving loop
    # has it run on a ``StagePool``. Empty: ``finish_batch`` is the project's own quick touches.
    user_stages: tuple[str, ...] = ()

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.batch_size = options.batch_size
        self.seed = options.seed
        self.shuffle = options.shuffle
        self.shuffle_block = options.shuffle_block
        self.order_version = options.order_version
        self.on_bad_shard = options.on_bad_shard
        self.workers = options.workers  # processes that decode units; 0: threads of this process
        self.worker_timeout = options.worker_timeout  # seconds a worker may spend on one unit; 0: no limit
        self.prefetch = options.prefetch  # blocks ahead whose shards are fetched into the local cache
        self.decoded_cache_mb = options.decoded_cache_mb  # decoded units every reader shares (0: none)
        # Threads that run the user's stages (0: as many as the cores, at least STAGE_THREADS_MIN).
        self.stage_threads = options.stage_threads or max(STAGE_THREADS_MIN, os.cpu_count() or 1)
        # (``counters``: worker processes count in their own copy and send the increments back
        # with each result.)
        super().__init__()
        self._pool: ThreadPoolExecutor | None = None
        self._process_pool: WorkerPool | None = None
        self._decoded: DecodedUnits | None = None
        self._stages: StagePool | None = None
        self._pool_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """A copy for a worker process: no pools or locks (they belong to this process), and
        ``workers`` 0, since the copy decodes on its own and never starts workers of its own.
        ``counters`` is copied as it is (members may share it); the worker sends back what it
        adds to it after each task."""
        state = self.__dict__.copy()
        for name in (*self._TRANSIENT, *self._serving_only):
            state.pop(name, None)
        state["workers"] = 0
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = None
        self._process_pool = None
        self._decoded = None
        self._stages = None
        self._pool_lock = threading.Lock()
        for name in self._serving_only:
            setattr(self, name, None)
        if self.store is not None:
            self.store.counters = self.counters  # the copy's own counters, sent back per task

    # -- what a subclass supplies ---------------------------------------------------------------
    @abc.abstractmethod
    def unit_rows(self, split: str) -> np.ndarray:
        """Rows per unit of a split, in storage order."""

    @abc.abstractmethod
    def column_specs(self, sources: tuple[str, ...]) -> Sequence[Column]:
        """The columns a reader must decode to serve ``sources``."""

    @abc.abstractmethod
    def decode_unit(self, split: str, u: int, columns: Sequence[Column]) -> dict[str, np.ndarray]:
        """Unit ``u`` of a split as one array per column; DataError naming the file if it fails.

        The arrays may be views, non-contiguous ones too (windows of a signal): a reader copies
        a batch's rows straight from them by fancy indexing, which reads only those rows, and
        serves a batch that is a run of one unit as a view of it. So nothing may write to them
        once returned (shared decoded units are made read-only).
        """

    def prefetch_units(self, split: str, units: Sequence[int]) -> None:
        """Start fetching what decoding ``units`` will need (remote shards into the local cache)
        in the background; the default has nothing to fetch. Called in the serving process (not
        in workers), with the units of the ``prefetch`` blocks after the one being read ahead,
        in the order they will be needed."""

    def describe_unit(self, split: str, u: int) -> str:
        """A unit as a person would name it in a log line (its file, row group, recording)."""
        return f"unit {u} of split {split}"

    def finish_batch(self, split: str, batch: dict[str, np.ndarray], sources: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Last touches on a gathered batch (preprocessing stages), keeping ``sources``; the
        default gathers exactly the sources and has nothing to do."""
        return batch

    # -- shared ----------------------------------------------------------------------------------
    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(self._columns)

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self._splits)

    def schema(self) -> Mapping[str, Mapping[str, Any]]:
        return {name: column.to_schema() for name, column in self._columns.items()}

    def rows(self, split: str) -> int:
        return int(self.unit_rows(split).sum())

    def batches_per_epoch(self, split: str, rank: int, world_size: int) -> int:
        return batches_per_rank(self.rows(split), world_size, self.batch_size)

    # Bounded, and the source lives as long as the server: the cache holding ``self`` leaks nothing.
    @functools.lru_cache(maxsize=8)  # noqa: B019
    def _plan(self, split: str, epoch: int) -> EpochPlan:
        return self._new_plan(split, epoch).start()

    def _new_plan(self, split: str, epoch: int) -> EpochPlan:
        """An epoch's plan, to be made on a thread of its own a block at a time: a reader's first
        batch waits only for the blocks up to its rows, and their units decode meanwhile."""
        return EpochPlan(self.unit_rows(split), self.seed, epoch, self.shuffle, self.shuffle_block, self.order_version)

    def _readahead_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="fuelline-read",
                                                initializer=name_this_thread, initargs=("fl-read",))
            return self._pool

    def _worker_pool(self) -> WorkerPool:
        """The worker processes, one pool for every client, started on first use."""
        from fuelline.server.workers.pool import WorkerError, WorkerPool

        with self._pool_lock:
            if self._process_pool is None:
                try:
                    pool = WorkerPool(self, self.workers, task_timeout=self.worker_timeout or None)
                except (pickle.PicklingError, TypeError, AttributeError) as exc:
                    raise WorkerError(f"workers: this source cannot be copied into worker processes: {exc}") from exc
                pool.start()
                self._process_pool = pool
            return self._process_pool

    def _submitter(self, split: str, columns: Sequence[Column]) -> Callable[[int], Future]:
        """How a reader has unit ``u`` decoded: by a worker process, or on a read-ahead thread,
        through the decoded units every reader shares (``decoded_cache_mb``)."""
        if self.workers:
            workers = self._worker_pool()
            decode: Callable[[int], Future] = lambda u: workers.submit(split, u, columns)  # noqa: E731
        else:
            threads = self._readahead_pool()
            decode = lambda u: threads.submit(self.decode_unit, split, u, columns)  # noqa: E731
        shared = self._decoded_units()
        if shared is None:
            return decode
        signature = tuple((c.name, str(c.dtype), tuple(c.shape)) for c in columns)
        return lambda u: shared.get((split, u, signature), lambda: decode(u))

    def _stage_pool(self) -> StagePool:
        """The threads that run the user's stages, for every reader; made on first use."""
        with self._pool_lock:
            if self._stages is None:
                self._stages = StagePool(self.stage_threads)
                self._stages_made(self._stages)
            return self._stages

    def _stages_made(self, pool: StagePool) -> None:
        """A subclass hears of its stage pool here (to have its pipeline report to it)."""

    def stage_runs(self) -> list[StageRun]:
        stages = self._stages
        return stages.runs() if stages is not None else []

    def stage_times(self) -> dict[str, tuple[int, float]]:
        stages = self._stages
        return stages.times() if stages is not None else {}

    def _decoded_units(self) -> DecodedUnits | None:
        with self._pool_lock:
            if self._decoded is None and self.decoded_cache_mb:
                self._decoded = DecodedUnits(self._decoded_budget(), self.counters)
            return self._decoded

    def _decoded_budget(self) -> int:
        """``decoded_cache_mb`` in bytes; with worker processes, at most half of /dev/shm, where
        the units they decode stay for as long as they are kept."""
        budget = self.decoded_cache_mb * 2**20
        if self.workers:
            from fuelline.server.workers import handoff

            room = handoff.shm_size()
            if room is not None and budget > room // 2:
                log.warning(
                    "--decoded-cache-mb %d: keeping at most %d MB of decoded units, half of /dev/shm (%d MB), "
                    "which the units worker processes decode occupy while kept; give /dev/shm more room "
                    "(docker --shm-size, a memory-backed emptyDir) to keep more",
                    self.decoded_cache_mb, room // 2 // 2**20, room // 2**20,
                )
                budget = room // 2
        return budget

    def iter_batches(
        self, split: str, epoch: int, rank: int, world_size: int, start: int, sources: tuple[str, ...],
        on_loss: Callable[[str], None] | None = None,
        history: Sequence[tuple[int, ...]] = (),
    ) -> Batches:
        """Batches ``start…`` of an epoch for a rank. With ``--on-bad-shard skip`` a unit that
        cannot be read is left out of its batches (which come out shorter) and ``on_loss`` is
        told which and how many rows; otherwise its DataError ends the epoch. ``history``: the
        segments of this epoch already run at other world sizes (see ``remaining_order``)."""
        # (Not cooperative, it never yields a Waiting.)
        return cast(Batches, self._steps(split, epoch, rank, world_size, start, sources, on_loss, history, cooperative=False))

    def iter_steps(
        self, split: str, epoch: int, rank: int, world_size: int, start: int, sources: tuple[str, ...],
        on_loss: Callable[[str], None] | None = None,
        history: Sequence[tuple[int, ...]] = (),
    ) -> Steps:
        """``iter_batches``, with a ``Waiting`` yielded before a gather whose units are still
        being decoded: a serving loop that prepares batches on its own thread serves its other
        clients meanwhile."""
        return self._steps(split, epoch, rank, world_size, start, sources, on_loss, history, cooperative=True)

    def _steps(
        self, split: str, epoch: int, rank: int, world_size: int, start: int, sources: tuple[str, ...],
        on_loss: Callable[[str], None] | None, history: Sequence[tuple[int, ...]], *, cooperative: bool,
    ) -> Steps:
        plan = self._plan(split, epoch)
        rows = self._rank_rows(plan, rank, world_size, history)
        count = -(-len(rows) // self.batch_size)
        columns = list(self.column_specs(sources))
        first_block = rows.first_block(start * self.batch_size)
        plan.prepare(first_block)  # (made on the plan's thread while the block's units are decoded)
        reader = BlockReader(
            self.unit_rows(split), columns, plan, self._submitter(split, columns),
            skip_bad=self.on_bad_shard == "skip", on_loss=on_loss,
            prefetch=lambda units: self.prefetch_units(split, units), prefetch_blocks=self.prefetch,
            first_block=first_block,
        )
        step = BlockReader.batches_at_once(columns, self.batch_size)
        # A serving loop never runs the user's stages itself: they go to the stage pool, a batch
        # at a time for this reader, and the loop waits for each as for a decode.
        stages = self._stage_pool() if cooperative and self.user_stages else None
        owner = object()  # this reader, to the stage pool
        try:
            for b in range(start, count, step):
                lo, hi = b * self.batch_size, min(b + step, count) * self.batch_size
                while cooperative and (made := rows.pending(lo, hi)) is not None:
                    yield Waiting([made])
                chunk = rows.take(lo, hi)
                while cooperative and (waits := reader.waits_for(chunk)):
                    yield Waiting(waits)
                if stages is None:
                    # (A generator expression: no name here keeps a batch, and with it the buffers
                    # of its gather, alive while the next batches are gathered.)
                    yield from (self.finish_batch(split, batch, sources) for batch in reader.gather_batches(chunk, self.batch_size))
                    continue
                futures = [
                    stages.submit(owner, f"epoch {epoch} batch {b + i} of split {split!r}, rank {rank} of {world_size}",
                                  self.finish_batch, split, batch, sources)
                    for i, batch in enumerate(reader.gather_batches(chunk, self.batch_size))
                ]
                while futures:
                    while not futures[0].done():
                        yield Waiting(futures[:1])
                    yield futures.pop(0).result()
        finally:
            if stages is not None:
                stages.forget(owner)
            reader.close()

    def _rank_rows(self, plan: EpochPlan, rank: int, world_size: int, history: Sequence[tuple[int, ...]]) -> RankRows:
        """A rank's rows of an epoch: its span of the plan, read as the plan is made; after
        segments at other world sizes, its share of what they left (the whole plan first)."""
        if not history:
            return RankRows(plan, rank, world_size)
        rest = remaining_order(plan.order, history, self.batch_size)
        return RankRows(plan, rank, world_size, rank_rows(rest, rank, world_size))

    def worker_pids(self) -> list[int]:
        """The worker processes running now (none before the first client, or with ``workers`` 0)."""
        pool = self._process_pool
        return pool.alive_pids if pool is not None else []

    def close(self) -> None:
        self._plan.cache_clear()
        with self._pool_lock:
            pool, self._pool = self._pool, None
            workers, self._process_pool = self._process_pool, None
            decoded, self._decoded = self._decoded, None
            stages, self._stages = self._stages, None
        if stages is not None:
            stages.close()  # (a stage still running is left to its daemon thread: it cannot be stopped)
        if decoded is not None:
            decoded.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if workers is not None:
            workers.close()
        if self.store is not None:
            self.store.close()
