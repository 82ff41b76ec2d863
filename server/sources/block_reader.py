"""``BlockReader``: one client's reader of a unit source, a block of units at a time, decoding
the next block while the current one is served."""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import CancelledError, Future
from typing import Callable, Protocol, Sequence

import numpy as np

from fuelline.protocol import DataError
from fuelline.server.sources.buffers import empty, gathering
from fuelline.server.sources.epoch_plan import EpochPlan

__all__ = ["BlockReader", "Column", "ROWS"]

log = logging.getLogger("fuelline.server")

# In a decoded unit, beside its columns: which rows of its arrays the unit serves, in order, when
# they hold more (rows it skips, so that the rest can stay views of one buffer); absent, all rows.
ROWS = "\x00rows"


# Rows at least this large are copied one at a time, straight into the batch: fancy indexing
# would copy them twice (into a temporary, then into place), which costs more than a Python step
# per row from about 8 KB a row (a 28 KB window: 1.1 against 1.6 µs a row; a 1 KB one: 0.33 against 0.25).
# Gathers take turns (``buffers.gathering``), so each has the rows' copies to itself.
ROW_BY_ROW_BYTES = 8192


def _gather_rows(out: np.ndarray, dest: np.ndarray, part: np.ndarray, src: np.ndarray) -> None:
    """``out[dest] = part[src]``, each large row copied once."""
    if out.ndim and out[0].nbytes >= ROW_BY_ROW_BYTES:
        for d, s in zip(dest.tolist(), src.tolist()):
            out[d] = part[s]
    else:
        out[dest] = part[src]


class Column(Protocol):
    """What a reader needs to know of a column: its name, dtype and per-row shape."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


class BlockReader:
    """One client's reader. It holds the decoded units of the block a batch draws from (and of
    the next one, for a batch that straddles two) as they were decoded, and copies a shuffled
    batch's rows straight from them: one copy per row. ``submit`` goes through the source's
    shared decoded units, so each row group is decoded once per epoch for all the ranks of a
    job, and once only while the decoded data set fits ``decoded_cache_mb``. While a block is
    served, the next one is decoded ahead (``submit``: on the source's read-ahead threads or worker processes), so
    decoding overlaps sending; and ``prefetch`` hears of the units of the ``prefetch_blocks``
    blocks after that one, so remote shards can be fetched before they are decoded."""

    BLOCKS_HELD = 2  # at most: the blocks a gather draws from (one, or two where it straddles)
    # Batches gathered at once (``gather_batches``), by bytes and by count: enough to pay the
    # per-unit steps of a shuffled gather once for several batches, little against a block.
    GATHER_BYTES = 4 * 2**20
    GATHER_BATCHES = 16

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
        first_block: int = 0,
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
        # Per block held: its decoded units by unit (the lost ones left out).
        self.blocks: OrderedDict[int, dict[int, dict[str, np.ndarray]]] = OrderedDict()
        self.pending: dict[int, list[tuple[int, Future | None]]] = {}
        # The first block too (the one its first rows are in): its units decode side by side, not
        # one by one, and while the rest of the epoch's plan is made.
        self._read_ahead(first_block)

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

    def _build(self, b: int) -> dict[int, dict[str, np.ndarray]]:
        ahead = self.pending.pop(b, None)
        jobs = ahead if ahead is not None else self._submit_block(b)
        # The decoded units as they are: a batch gathers its rows straight from them, so a row
        # is copied once (into its batch), not twice (into a block table, then into a batch).
        # A lost unit has no entry; gather never reads its rows.
        return {u: part for u, part in ((u, self._result(u, f)) for u, f in jobs) if part is not None}

    def waits_for(self, rows: np.ndarray) -> list[Future]:
        """The decodes a gather of these rows would wait for now: none, if it would not wait.
        The blocks it needs that were not asked for yet are asked for (as it would ask for
        them), and a decode another reader gave up is asked for again, so that the futures
        returned are the ones the gather will wait on."""
        if not len(rows):
            return []
        units = np.searchsorted(self.unit_start, np.asarray(rows, dtype=np.int64), side="right") - 1
        waiting: list[Future] = []
        for b in np.unique(self.block_of_unit[units]).tolist():
            if b in self.blocks:
                continue
            self._read_ahead(b)
            jobs = self.pending[b]
            for i, (u, future) in enumerate(jobs):
                if future is not None and future.cancelled():
                    future = self.submit(u)
                    jobs[i] = (u, future)
                if future is not None and not future.done():
                    waiting.append(future)
        return waiting

    def block(self, b: int) -> dict[int, dict[str, np.ndarray]]:
        if b in self.blocks:
            units = self.blocks.pop(b)
        else:
            units = self._build(b)
            if len(self.blocks) >= self.BLOCKS_HELD:
                self.blocks.popitem(last=False)
        self.blocks[b] = units
        self._read_ahead(b + 1)
        return units

    @classmethod
    def batches_at_once(cls, columns: Sequence[Column], batch_size: int) -> int:
        """How many consecutive batches ``gather_batches`` should be given at a time: enough that
        its per-unit, per-column steps are paid once for several batches, few enough that they
        hold at most ``GATHER_BYTES`` (and ``GATHER_BATCHES``) before they are sent."""
        row_bytes = sum(int(np.prod(c.shape, dtype=np.int64)) * np.dtype(c.dtype).itemsize for c in columns)
        return int(max(1, min(cls.GATHER_BATCHES, cls.GATHER_BYTES // max(1, batch_size * row_bytes))))

    def gather(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """One batch: the rows (global row ids, in batch order) as one array per column."""
        return self.gather_batches(rows, max(1, len(rows)))[0]

    def gather_batches(self, rows: np.ndarray, batch_size: int) -> list[dict[str, np.ndarray]]:
        """Consecutive batches: ``rows`` cut every ``batch_size`` rows (the last cut may be
        shorter), each as one array per column. Rows of a lost unit are left out of their batch.

        A batch whose rows are a run of one unit in storage order is a view of that unit; the
        others are copied from the units, a row at a time, into one buffer per column that they
        are views of. Units are read by fancy indexing, which reads only the rows it is given:
        a unit may be any array, a non-contiguous view included (windows of a signal).
        """
        rows = np.asarray(rows, dtype=np.int64)
        ends = np.append(np.arange(batch_size, len(rows), batch_size), len(rows))
        units = np.searchsorted(self.unit_start, rows, side="right") - 1
        offsets = rows - self.unit_start[units]
        parts = self._parts(units)
        for u in np.unique(units).tolist():
            served = parts.get(u, {}).get(ROWS)
            if served is not None:
                drawn = units == u
                offsets[drawn] = served[offsets[drawn]]
        if self.lost:
            keep = ~np.isin(units, list(self.lost))
            units, offsets = units[keep], offsets[keep]
            ends = np.cumsum(keep)[ends - 1] if len(keep) else ends
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        # breaks[i]: how many times the sequence leaves a run of consecutive rows of one unit
        # before position i; a batch is a run when none happens inside it.
        follows = (units[1:] == units[:-1]) & (offsets[1:] == offsets[:-1] + 1)
        breaks = np.concatenate([[0], np.cumsum(~follows)])
        spans = list(zip(starts.tolist(), ends.tolist()))
        runs = [hi > lo and breaks[hi - 1] == breaks[lo] for lo, hi in spans]
        if any(runs):
            pick = [np.arange(lo, hi) for (lo, hi), run in zip(spans, runs) if not run]
            copy = np.concatenate(pick) if pick else np.empty(0, dtype=np.int64)
            gathered = self._copy(units[copy], offsets[copy], parts)
        else:
            gathered = self._copy(units, offsets, parts)
        batches: list[dict[str, np.ndarray]] = []
        at = 0
        for (lo, hi), run in zip(spans, runs):
            if run:
                # Views, no copy. Safe to send zero-copy: decoded units are never written to.
                part, first = parts[int(units[lo])], int(offsets[lo])
                batches.append({c.name: part[c.name][first : first + hi - lo] for c in self.columns})
            else:
                batches.append({name: arr[at : at + hi - lo] for name, arr in gathered.items()})
                at += hi - lo
        return batches

    def _parts(self, units: np.ndarray) -> dict[int, dict[str, np.ndarray]]:
        """The decoded units (lost ones left out) of every block these units belong to."""
        blocks = self.block_of_unit[units]
        # In order of first appearance, so the block held longest is the one released first.
        _, firsts = np.unique(blocks, return_index=True)
        needed = blocks[np.sort(firsts)].tolist()
        # Blocks this gather does not draw from are behind it (a rank's rows go through the
        # blocks in order; its wrap-around padding reads the first ones again, decoded anew):
        # let them go now rather than when the next block is built, and before the block after
        # this one is read ahead. A block's units are freed together, and the fewer are held,
        # the more of that memory the next block's decode reuses instead of faulting in afresh.
        for b in [b for b in self.blocks if b not in needed]:
            del self.blocks[b]
        parts: dict[int, dict[str, np.ndarray]] = {}
        for b in needed:
            parts.update(self.block(b))
        return parts

    def _copy(self, units: np.ndarray, offsets: np.ndarray, parts: dict[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        n = len(units)
        if not n:
            return {c.name: np.empty((0, *c.shape), dtype=c.dtype) for c in self.columns}
        arrays = empty([((n, *c.shape), np.dtype(c.dtype)) for c in self.columns])
        out = {c.name: arr for c, arr in zip(self.columns, arrays)}
        if units[0] == units[-1] and (units == units[0]).all():
            groups = [(int(units[0]), np.arange(n), offsets)]
        else:
            # Positions grouped by unit once, for every column: each unit is then one gather per
            # column, whatever the number of rows drawn from it.
            by_unit = np.argsort(units, kind="stable")
            grouped = units[by_unit]
            bounds = [0, *(np.flatnonzero(grouped[1:] != grouped[:-1]) + 1).tolist(), n]
            groups = [(int(grouped[lo]), by_unit[lo:hi], offsets[by_unit[lo:hi]]) for lo, hi in zip(bounds[:-1], bounds[1:])]
        with gathering():
            for u, dest, src in groups:
                part = parts[u]
                for c in self.columns:
                    _gather_rows(out[c.name], dest, part[c.name], src)
        return out

    def close(self) -> None:
        for ahead in self.pending.values():
            for _, future in ahead:
                if future is not None:
                    future.cancel()
        self.pending.clear()
        self.blocks.clear()
