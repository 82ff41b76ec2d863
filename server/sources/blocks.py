"""Serving units of rows (row groups, recordings) in epoch order, a block at a time.

``UnitSource`` is the part every unit-based source shares: the epoch plan (see
``fuelline.server.sources.ordering``), sharding, batch counts, and a per-client ``BlockReader`` that
decodes whole blocks of units ahead of need. A source supplies how many rows each unit has and how
to decode one unit into column arrays.

Units are decoded on read-ahead threads of the serving process (``workers=0``) or, with
``workers=N``, in N worker processes (``fuelline.server.workers.pool``) that get a pickled copy of the
source: ``__getstate__`` leaves out what belongs to the serving process alone.
"""

from __future__ import annotations

import abc
import functools
import logging
import os
import pickle
import threading
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from fuelline.protocol import DataError
from fuelline.server.cache.decoded import DecodedUnits
from fuelline.server.sources.contract import Batches, BatchSource
from fuelline.server.sources.options import SourceOptions
from fuelline.server.sources.ordering import EpochPlan, batches_per_rank, epoch_plan, rank_rows, remaining_order

if TYPE_CHECKING:
    from fuelline.server.workers.pool import WorkerPool

__all__ = ["Column", "UnitSource", "BlockReader"]

log = logging.getLogger("fuelline.server")


class Column(Protocol):
    """What a reader needs to know of a column: its name, dtype and per-row shape."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


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
    _TRANSIENT = ("_pool", "_pool_lock", "_process_pool", "_decoded")
    immutable_batches = True  # batches are never written once yielded (the memory tier keeps them as they are)
    store: Any = None  # where a subclass reads its files (fuelline.server.sources.storage.Store), if it has one

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.batch_size = options.batch_size
        self.seed = options.seed
        self.shuffle = options.shuffle
        self.shuffle_block = options.shuffle_block
        self.on_bad_shard = options.on_bad_shard
        self.workers = options.workers  # processes that decode units; 0: threads of this process
        self.worker_timeout = options.worker_timeout  # seconds a worker may spend on one unit; 0: no limit
        self.prefetch = options.prefetch  # blocks ahead whose shards are fetched into the local cache
        self.decoded_cache_mb = options.decoded_cache_mb  # decoded units every reader shares (0: none)
        # (``counters``: worker processes count in their own copy and send the increments back
        # with each result.)
        super().__init__()
        self._pool: ThreadPoolExecutor | None = None
        self._process_pool: WorkerPool | None = None
        self._decoded: DecodedUnits | None = None
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
        """Unit ``u`` of a split as one array per column; DataError naming the file if it fails."""

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
        plan = epoch_plan(self.unit_rows(split), self.seed, epoch, self.shuffle, self.shuffle_block)
        plan.order.setflags(write=False)
        return plan

    def _readahead_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="fuelline-read")
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
        history: Sequence[tuple[int, int]] = (),
    ) -> Batches:
        """Batches ``start…`` of an epoch for a rank. With ``--on-bad-shard skip`` a unit that
        cannot be read is left out of its batches (which come out shorter) and ``on_loss`` is
        told which and how many rows; otherwise its DataError ends the epoch. ``history``: the
        segments of this epoch already run at other world sizes (see ``remaining_order``)."""
        plan = self._plan(split, epoch)
        order = remaining_order(plan.order, history, self.batch_size) if history else plan.order
        rows = rank_rows(order, rank, world_size)
        count = -(-len(rows) // self.batch_size) if len(order) else 0
        columns = list(self.column_specs(sources))
        reader = BlockReader(
            self.unit_rows(split), columns, plan, self._submitter(split, columns),
            skip_bad=self.on_bad_shard == "skip", on_loss=on_loss,
            prefetch=lambda units: self.prefetch_units(split, units), prefetch_blocks=self.prefetch,
        )
        try:
            for b in range(start, count):
                batch = reader.gather(rows[b * self.batch_size : (b + 1) * self.batch_size])
                yield self.finish_batch(split, batch, sources)
        finally:
            reader.close()

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
        if decoded is not None:
            decoded.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if workers is not None:
            workers.close()
        if self.store is not None:
            self.store.close()


class BlockReader:
    """One client's reader. It holds the block a batch draws from (and the next one, for a
    batch that straddles two) as one table per column, so a shuffled batch is one gather per
    column. ``submit`` goes through the source's shared decoded units, so each row group is
    decoded once per epoch for all the ranks of a job, and once only while the decoded data
    set fits ``decoded_cache_mb``. While a block is served, the next one
    is decoded ahead (``submit``: on the source's read-ahead threads or worker processes), so
    decoding overlaps sending; and ``prefetch`` hears of the units of the ``prefetch_blocks``
    blocks after that one, so remote shards can be fetched before they are decoded."""

    BLOCKS_HELD = 2

    def __init__(
        self,
        unit_rows: np.ndarray,
        columns: Sequence[Column],
        plan: EpochPlan,
        submit: Callable[[int], Future],
        skip_bad: bool = False,
        on_loss: Callable[[str], None] | None = None,
        prefetch: Callable[[list[int]], None] | None = None,
        prefetch_blocks: int = 0,
    ) -> None:
        self.skip_bad = skip_bad
        self.on_loss = on_loss
        self.lost: set[int] = set()  # units that could not be read (skip mode)
        self.unit_rows = unit_rows
        self.unit_start = np.concatenate([[0], np.cumsum(unit_rows)[:-1]]).astype(np.int64)
        self.columns = columns
        self.plan = plan
        self.submit = submit
        self.prefetch = prefetch
        self.prefetch_blocks = prefetch_blocks
        self.prefetched = 0  # blocks 1 … prefetched were handed to prefetch already
        k = plan.shuffle_block
        perm = plan.unit_perm
        self.n_blocks = -(-len(perm) // k)
        self.block_of_unit = np.empty(len(perm), dtype=np.int64)
        self.block_of_unit[perm] = np.arange(len(perm)) // k
        # Where each unit's first row sits in its block's table.
        lengths = unit_rows[perm]
        within = np.cumsum(lengths) - lengths
        block_start = within[(np.arange(len(perm)) // k) * k]
        self.unit_pos = np.empty(len(perm), dtype=np.int64)
        self.unit_pos[perm] = within - block_start
        self.blocks: OrderedDict[int, dict[str, np.ndarray] | None] = OrderedDict()
        self.pending: dict[int, list[tuple[int, Future | None]]] = {}
        self._read_ahead(0)  # the first block too: its units decode side by side, not one by one

    def _units(self, b: int) -> list[int]:
        k = self.plan.shuffle_block
        return [int(u) for u in self.plan.unit_perm[b * k : (b + 1) * k] if self.unit_rows[u]]

    def _submit_block(self, b: int) -> list[tuple[int, Future | None]]:
        # Each unit is its own task, so a block's units are decoded side by side.
        # (Not a unit already lost this epoch: it would only fail again.)
        jobs = [(u, None if u in self.lost else self.submit(u)) for u in self._units(b)]
        self._prefetch_after(b)
        return jobs

    def _prefetch_after(self, b: int) -> None:
        last = min(b + self.prefetch_blocks, self.n_blocks - 1)
        first = max(b + 1, self.prefetched + 1)
        if self.prefetch is None or first > last:
            return
        self.prefetched = last
        units = [u for c in range(first, last + 1) for u in self._units(c)]
        try:
            self.prefetch(units)
        except Exception:  # only a head start: decoding fetches what is missing, and says why
            log.warning("prefetching blocks %d-%d failed", first, last, exc_info=True)

    def _read_ahead(self, b: int) -> None:
        if b < self.n_blocks and b not in self.blocks and b not in self.pending:
            self.pending[b] = self._submit_block(b)

    def _result(self, u: int, future: Future | None) -> dict[str, np.ndarray] | None:
        if u in self.lost or future is None:
            return None  # reported once; the wrap-around padding may ask again
        try:
            while True:
                try:
                    return future.result()
                except CancelledError:
                    # Another client's reader, closing, gave up the decode this one shared.
                    future = self.submit(u)
        except DataError as exc:
            if not self.skip_bad:
                raise
            self.lost.add(u)
            message = f"{exc}; its {int(self.unit_rows[u])} rows are left out of this epoch (--on-bad-shard skip)"
            log.warning("%s", message)
            if self.on_loss is not None:
                self.on_loss(message)
            return None

    def _build(self, b: int) -> dict[str, np.ndarray] | None:
        ahead = self.pending.pop(b, None)
        jobs = ahead if ahead is not None else self._submit_block(b)
        parts = [(u, part) for u, part in ((u, self._result(u, f)) for u, f in jobs) if part is not None]
        if not parts:
            return None  # every unit of the block was lost: its rows are filtered out by gather
        if len(jobs) == 1:
            return parts[0][1]  # nothing to mix: the decoded arrays as they are
        # Room for every unit of the block, lost ones too: rows sit at their units' positions, and
        # gather never reads the rows of a lost unit.
        rows = int(sum(self.unit_rows[u] for u, _ in jobs))
        data = {c.name: np.empty((rows, *c.shape), dtype=c.dtype) for c in self.columns}
        for u, part in parts:
            lo = int(self.unit_pos[u])
            for name in data:
                data[name][lo : lo + len(part[name])] = part[name]
        return data

    def block(self, b: int) -> dict[str, np.ndarray] | None:
        if b in self.blocks:
            data = self.blocks.pop(b)
        else:
            data = self._build(b)
            if len(self.blocks) >= self.BLOCKS_HELD:
                self.blocks.popitem(last=False)
        self.blocks[b] = data
        self._read_ahead(b + 1)
        return data

    def gather(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        units = np.searchsorted(self.unit_start, rows, side="right") - 1
        pos = self.unit_pos[units] + (rows - self.unit_start[units])
        blocks = self.block_of_unit[units]
        # In order of first appearance, so the block held longest is the one released first.
        _, firsts = np.unique(blocks, return_index=True)
        tables = {int(b): self.block(int(b)) for b in blocks[np.sort(firsts)]}
        if self.lost:
            keep = ~np.isin(units, list(self.lost))
            rows, units, pos, blocks = rows[keep], units[keep], pos[keep], blocks[keep]
            if not len(rows):
                return {c.name: np.empty((0, *c.shape), dtype=c.dtype) for c in self.columns}
        first = int(blocks[0])
        if (blocks == first).all():
            table = tables[first]
            lo = int(pos[0])
            if pos[-1] - lo == len(pos) - 1 and (np.diff(pos) == 1).all():
                # A run in storage order: views, no copy. Safe to send zero-copy, since block
                # tables are never written to once built.
                return {c.name: table[c.name][lo : lo + len(pos)] for c in self.columns}
            return {c.name: table[c.name].take(pos, axis=0) for c in self.columns}
        out = {c.name: np.empty((len(rows), *c.shape), dtype=c.dtype) for c in self.columns}
        for b in np.unique(blocks):
            mask = blocks == b
            table = tables[int(b)]
            for c in self.columns:
                out[c.name][mask] = table[c.name][pos[mask]]
        return out

    def close(self) -> None:
        for ahead in self.pending.values():
            for _, future in ahead:
                if future is not None:
                    future.cancel()
        self.pending.clear()
        self.blocks.clear()
