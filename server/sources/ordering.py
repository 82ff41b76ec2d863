"""The order of an epoch: a pure function of the data layout, seed, epoch, rank and world size.

Order, in three steps:

1. **Units.** The dataset is a list of units (Parquet row groups, in file order). The epoch's
   generator, seeded by (seed, epoch), permutes the units, so every epoch walks the files in a
   different order.
2. **Blocks.** Consecutive runs of ``shuffle_block`` units of that permutation form a block; rows are
   permuted within each block. Rows of different files end up side by side, and a reader needs
   only one block of decoded units in memory at a time.
3. **Ranks.** The epoch's row sequence is padded by wrapping around to a multiple of world_size
   (as torch's DistributedSampler does; the padding is the only duplication), and rank r takes
   the r-th contiguous span. Contiguous spans keep each rank on few units; the global sequence
   does not depend on the world size, so a position can be carried across world sizes.

Nothing here depends on timing, worker counts or the number of clients.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Sequence

import numpy as np

from fuelline.protocol.common.threadnames import name_this_thread
from fuelline.protocol.messages import MAX_HISTORY_WORLD

__all__ = ["EpochPlan", "RankRows", "epoch_plan", "epoch_rng", "epoch_order", "rank_rows", "rows_per_rank", "batches_per_rank", "remaining_order"]


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32, int(epoch)]))


class EpochPlan:
    """One epoch's order and the blocks it was mixed in, made a block at a time.

    The units' permutation is drawn at once; the order of the rows is then written and shuffled
    block by block, in serving order, each block's shuffle drawing from the generator where the
    one before left it: the same draws, hence the same order, as making it whole. A reader needs
    only the blocks up to its rows, so it is served while the rest of the plan is made (``start``:
    on a thread of its own), and its first units are decoded meanwhile (``unit_perm`` and
    ``block_at`` are known from the start). For 38 M rows the whole plan takes about 0.6 s.

    Attributes:
        unit_perm: the units in serving order.
        shuffle_block: consecutive units of ``unit_perm`` whose rows are mixed together.
        total: rows in the epoch.
        bounds: where each block starts in the order, and the order's end (``n_blocks + 1``).
    """

    def __init__(self, unit_lengths: np.ndarray, seed: int, epoch: int, shuffle: bool = True, shuffle_block: int = 8) -> None:
        lengths = np.asarray(unit_lengths, dtype=np.int64)
        if shuffle and shuffle_block < 1:
            raise ValueError(f"shuffle_block must be >= 1, got {shuffle_block}")
        self.total = int(lengths.sum())
        self._unit_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self._rng: np.random.Generator | None = None
        if shuffle:
            self._rng = epoch_rng(seed, epoch)
            self.unit_perm = self._rng.permutation(len(lengths))
            self.shuffle_block = shuffle_block
        else:
            self.unit_perm, self.shuffle_block = np.arange(len(lengths)), 1
        self._perm_lengths = lengths[self.unit_perm]
        ends = np.concatenate([[0], np.cumsum(self._perm_lengths)]).astype(np.int64)
        bounds = ends[::self.shuffle_block]
        self.bounds = np.append(bounds, self.total) if bounds[-1] != self.total else bounds
        # Row ids in 32 bits where they fit: half the memory to hold and to fault in (a 38 M-row
        # plan is 150 MB), and the same order: a shuffle's draws do not depend on the item size.
        self._order = np.empty(self.total, dtype=np.int32 if self.total < 2**31 else np.int64)
        self._filled = 0  # blocks written and shuffled, in order
        self._error: BaseException | None = None
        # One block is made at a time, by whichever thread asks first; the others wait for the
        # block they need, not for the lock: a thread that held a lock while it made each block
        # took it straight back for the next one, and a reader of a block already made waited on.
        self._made = threading.Condition()  # guards _filled, _error and _making
        self._making = False
        self._waiters: dict[int, Future[None]] = {}  # a block → the future of a reader waiting for it
        self._waiters_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def n_blocks(self) -> int:
        return len(self.bounds) - 1

    def start(self) -> "EpochPlan":
        """Make the rest of the plan on a thread of its own (a daemon: it only computes)."""
        if self._thread is None and self._filled < self.n_blocks:
            self._thread = threading.Thread(target=self._make_rest, name="fuelline-plan", daemon=True)
            self._thread.start()
        return self

    def _make_rest(self) -> None:
        name_this_thread("fl-plan")
        try:
            self._fill_through(self.n_blocks - 1)
        except BaseException:  # (kept, and raised to every reader that needs what is missing)
            pass

    def _fill_through(self, block: int) -> None:
        """Blocks up to ``block`` made: here, or by the thread already making the next one."""
        while True:
            with self._made:
                while True:
                    if self._error is not None:
                        raise self._error
                    if self._filled > block:
                        return
                    if not self._making:
                        break
                    self._made.wait()
                b, self._making = self._filled, True
            try:
                self._fill_block(b)
            except BaseException as exc:
                with self._made:
                    self._error, self._making = exc, False
                    self._made.notify_all()
                self._resolve(exc)
                raise
            with self._made:
                self._filled, self._making = b + 1, False
                self._made.notify_all()
            self._resolve(None)

    def _fill_block(self, b: int) -> None:
        lo, hi = int(self.bounds[b]), int(self.bounds[b + 1])
        k = self.shuffle_block
        at = lo
        # Row ids of the block's units laid end to end, a unit at a time.
        for u, n in zip(self.unit_perm[b * k : (b + 1) * k].tolist(), self._perm_lengths[b * k : (b + 1) * k].tolist()):
            first = int(self._unit_start[u])
            self._order[at:at + n] = np.arange(first, first + n, dtype=self._order.dtype)
            at += n
        if self._rng is not None:
            # Shuffled in place: the same swaps, from the same draws, as permuting an arange of
            # its length and gathering by it, so the same order, without the two temporaries.
            self._rng.shuffle(self._order[lo:hi])

    def _resolve(self, error: BaseException | None) -> None:
        with self._waiters_lock:
            done = [b for b in self._waiters if b < self._filled or error is not None]
            futures = [self._waiters.pop(b) for b in done]
        for future in futures:
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def block_at(self, position: int) -> int:
        """The block that position ``position`` of the order (``0 <= position < total``) is in."""
        return int(np.searchsorted(self.bounds, position, side="right")) - 1

    def block_of_row(self, row: int) -> int:
        """The block a row (a global row id) is served in."""
        unit = int(np.searchsorted(self._unit_start, row, side="right")) - 1
        return int(np.flatnonzero(self.unit_perm == unit)[0]) // self.shuffle_block

    def _needed(self, lo: int, hi: int) -> int:
        """The last block positions ``lo…hi`` (taken modulo ``total``) need; -1 for none."""
        if hi <= lo or not self.total:
            return -1
        return self.block_at(hi - 1) if hi <= self.total else self.n_blocks - 1

    def pending(self, lo: int, hi: int) -> "Future[None] | None":
        """None if positions ``lo…hi`` of the order are made; else a future done when they are
        (made on the plan's thread: ``start`` it first, or this makes them here)."""
        block = self._needed(lo, hi)
        if block < self._filled:
            return None
        if self._thread is None:
            self._fill_through(block)
            return None
        with self._waiters_lock:
            if block < self._filled or self._error is not None:
                future: Future[None] = Future()
                if self._error is not None:
                    future.set_exception(self._error)
                else:
                    future.set_result(None)
                return future
            return self._waiters.setdefault(block, Future())

    def span(self, lo: int, hi: int) -> np.ndarray:
        """Global row ids at positions ``lo…hi`` of the order, wrapping around its end (the
        padding of the last ranks); waits for (or makes) the blocks they are in. Read-only."""
        block = self._needed(lo, hi)
        if block >= self._filled:
            self._fill_through(block)
        if hi <= self.total:
            out = self._order[lo:hi]
        else:
            out = self._order[(lo % self.total + np.arange(hi - lo, dtype=np.int64)) % self.total] if self.total else self._order[:0]
        out = out.view()
        out.setflags(write=False)
        return out

    @property
    def order(self) -> np.ndarray:
        """Global row ids in serving order (before sharding), the whole epoch. Read-only."""
        return self.span(0, self.total)


def epoch_plan(
    unit_lengths: np.ndarray, seed: int, epoch: int, shuffle: bool = True, shuffle_block: int = 8
) -> EpochPlan:
    """The plan of one epoch, made whole.

    Args:
        unit_lengths: rows per unit, in storage order; global row ids count through them.
        seed, epoch: the epoch's generator is seeded by both.
        shuffle: False serves storage order (one unit per block).
        shuffle_block: how many consecutive units (after the unit permutation) mix their rows.
    """
    plan = EpochPlan(unit_lengths, seed, epoch, shuffle, shuffle_block)
    plan.span(0, plan.total)
    return plan


def epoch_order(
    unit_lengths: np.ndarray, seed: int, epoch: int, shuffle: bool = True, shuffle_block: int = 8
) -> np.ndarray:
    """Global row ids of one epoch, in the order they are served (before sharding)."""
    return epoch_plan(unit_lengths, seed, epoch, shuffle, shuffle_block).order


def rows_per_rank(total: int, world_size: int) -> int:
    return -(-total // world_size)


def batches_per_rank(total: int, world_size: int, batch_size: int) -> int:
    """Batches every rank gets per epoch: the same for all ranks (the last may be short)."""
    return -(-rows_per_rank(total, world_size) // batch_size)


def rank_rows(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """The contiguous span of the wrap-padded order that belongs to ``rank``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    per_rank = rows_per_rank(len(order), world_size)
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    if hi <= len(order):
        return order[lo:hi]
    # Wrap around by index, which also covers a world size larger than the data. Only this rank's
    # span is built: a Hello may name any world size (2**40), and padding the whole order to
    # world_size × per_rank rows (np.resize) let one small message allocate gigabytes.
    n = len(order)
    return order[(lo % n + np.arange(per_rank, dtype=np.int64)) % n]


class RankRows:
    """A rank's rows of an epoch, in serving order, taken a chunk at a time: its span of the
    plan's wrap-padded order (``rank_rows``), read as the plan is made; or, after segments at
    other world sizes, its share of what was left (``rows``, made whole first)."""

    def __init__(self, plan: EpochPlan, rank: int, world_size: int, rows: np.ndarray | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.plan = plan
        self._rows = rows
        per_rank = rows_per_rank(plan.total, world_size)
        self._lo = rank * per_rank
        self._len = per_rank if rows is None else len(rows)

    def __len__(self) -> int:
        return self._len

    def pending(self, lo: int, hi: int) -> "Future[None] | None":
        """None if rows ``lo…hi`` can be taken now; else a future done when they can."""
        return None if self._rows is not None else self.plan.pending(self._lo + lo, self._lo + min(hi, self._len))

    def take(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo…hi`` of the rank's share (global row ids), waiting for the plan if need be."""
        hi = min(hi, self._len)
        if self._rows is not None:
            return self._rows[lo:hi]
        return self.plan.span(self._lo + lo, self._lo + hi)

    def first_block(self, at: int) -> int:
        """The block row ``at`` of the share is served from (0 past the end), known before the
        rows themselves are: its units can be decoded while the plan is made."""
        if not 0 <= at < self._len or not self.plan.total:
            return 0
        if self._rows is not None:
            return self.plan.block_of_row(int(self._rows[at]))
        return self.plan.block_at((self._lo + at) % self.plan.total)


def remaining_order(order: np.ndarray, history: Sequence[Sequence[int]], batch_size: int) -> np.ndarray:
    """What is left of an epoch's order after segments run at other world sizes.

    ``history`` lists, oldest first, the segments the epoch was interrupted in: (world size,
    batches each rank had taken), or (world size, batches, stride, extra) when ranks did not all
    take as many: then the ranks whose index modulo ``stride`` is below ``extra`` took one batch
    more (a reader of several servers is ``stride`` ranks of its servers' world, read in turn).
    Each segment sharded what was left at the time, as ``rank_rows`` does; the rows its ranks took
    are removed (padding rows included, so a row taken once is never served again in the epoch).
    The rest keeps its order, and the current world size shards it afresh: a position can be
    carried to any world size.
    """
    rest = np.asarray(order)
    for segment in history:
        world_size, batches, stride, extra = (*segment, 1, 0) if len(segment) == 2 else segment
        if not 1 <= world_size <= MAX_HISTORY_WORLD or batches < 0 or stride < 1 or not 0 <= extra < stride:
            raise ValueError(f"invalid resume segment {tuple(segment)}")
        if not len(rest):
            break
        per_rank = rows_per_rank(len(rest), world_size)
        ranks = np.arange(world_size)
        taken_each = np.minimum((batches + (ranks % stride < extra)) * batch_size, per_rank)
        # Positions (in ``rest``) that the segment's ranks took: the head of each rank's span of
        # the wrap-padded sequence.
        heads = np.arange(per_rank)[None, :] < taken_each[:, None]
        padded_positions = (ranks[:, None] * per_rank + np.arange(per_rank)[None, :])[heads]
        taken = np.zeros(len(rest), dtype=bool)
        taken[padded_positions % len(rest)] = True
        rest = rest[~taken]
    return rest
