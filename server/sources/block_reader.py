"""``BlockReader``: one client's reader of a unit source, a block of units at a time, decoding
the next block while the current one is served."""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import CancelledError, Future
from typing import Callable, Protocol, Sequence

import numpy as np

from fuelline.protocol import DataError
from fuelline.server.sources.ordering import EpochPlan

__all__ = ["BlockReader", "Column"]

log = logging.getLogger("fuelline.server")


class Column(Protocol):
    """What a reader needs to know of a column: its name, dtype and per-row shape."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


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
