"""The order of an epoch: a pure function of the data layout, seed, epoch, rank and world size.

Order, in three steps:

1. **Units.** The dataset is a list of units (Parquet row groups, in file order). The epoch's
   generator, seeded by (seed, epoch), permutes the units, so every epoch walks the files in a
   different order.
2. **Blocks.** Consecutive runs of ``shuffle_block`` units of that permutation form a block; rows are
   permuted within each block, by a generator seeded by (seed, epoch, block) (order version 2;
   version 1 drew every block from the epoch's generator, in turn). Rows of different files end
   up side by side, and a reader needs only one block of decoded units in memory at a time.
3. **Ranks.** The epoch's row sequence is padded by wrapping around to a multiple of world_size
   (as torch's DistributedSampler does; the padding is the only duplication), and rank r takes
   the r-th contiguous span. Contiguous spans keep each rank on few units; the global sequence
   does not depend on the world size, so a position can be carried across world sizes.

Nothing here depends on timing, worker counts or the number of clients.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence

import numpy as np

from fuelline.protocol.messages import MAX_HISTORY_WORLD
from fuelline.server.sources.epoch_plan import ORDER_VERSION, EpochPlan

__all__ = ["RankRows", "epoch_plan", "epoch_order", "rank_rows", "rows_per_rank", "batches_per_rank", "remaining_order"]


def epoch_plan(
    unit_lengths: np.ndarray, seed: int, epoch: int, shuffle: bool = True, shuffle_block: int = 8,
    order_version: int = ORDER_VERSION,
) -> EpochPlan:
    """The plan of one epoch, made whole.

    Args:
        unit_lengths: rows per unit, in storage order; global row ids count through them.
        seed, epoch: the epoch's generator is seeded by both.
        shuffle: False serves storage order (one unit per block).
        shuffle_block: how many consecutive units (after the unit permutation) mix their rows.
        order_version: how a block's rows are shuffled (``EpochPlan``).
    """
    plan = EpochPlan(unit_lengths, seed, epoch, shuffle, shuffle_block, order_version)
    plan.span(0, plan.total)
    return plan


def epoch_order(
    unit_lengths: np.ndarray, seed: int, epoch: int, shuffle: bool = True, shuffle_block: int = 8,
    order_version: int = ORDER_VERSION,
) -> np.ndarray:
    """Global row ids of one epoch, in the order they are served (before sharding)."""
    return epoch_plan(unit_lengths, seed, epoch, shuffle, shuffle_block, order_version).order


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
