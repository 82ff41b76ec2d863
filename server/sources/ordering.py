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

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fuelline.protocol.messages import MAX_HISTORY_WORLD

__all__ = ["EpochPlan", "epoch_plan", "epoch_rng", "epoch_order", "rank_rows", "rows_per_rank", "batches_per_rank", "remaining_order"]


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32, int(epoch)]))


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's order and the blocks it was mixed in.

    Attributes:
        order: global row ids in serving order (before sharding).
        unit_perm: the units in serving order.
        shuffle_block: consecutive units of ``unit_perm`` whose rows are mixed together.
    """

    order: np.ndarray
    unit_perm: np.ndarray
    shuffle_block: int


def epoch_plan(
    unit_lengths: np.ndarray, seed: int, epoch: int, shuffle: bool = True, shuffle_block: int = 8
) -> EpochPlan:
    """The plan of one epoch.

    Args:
        unit_lengths: rows per unit, in storage order; global row ids count through them.
        seed, epoch: the epoch's generator is seeded by both.
        shuffle: False serves storage order (one unit per block).
        shuffle_block: how many consecutive units (after the unit permutation) mix their rows.
    """
    lengths = np.asarray(unit_lengths, dtype=np.int64)
    total = int(lengths.sum())
    if not shuffle:
        return EpochPlan(np.arange(total, dtype=np.int64), np.arange(len(lengths)), 1)
    if shuffle_block < 1:
        raise ValueError(f"shuffle_block must be >= 1, got {shuffle_block}")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rng = epoch_rng(seed, epoch)
    perm = rng.permutation(len(lengths))
    perm_lengths = lengths[perm]
    # Row ids of the permuted units, laid end to end: one write of the order, a unit at a time
    # (an arange over every row plus repeated offsets made three passes over it).
    order = np.empty(total, dtype=np.int64)
    at = 0
    for first, n in zip(starts[perm].tolist(), perm_lengths.tolist()):
        order[at:at + n] = np.arange(first, first + n, dtype=np.int64)
        at += n
    bounds = np.concatenate([[0], np.cumsum(perm_lengths)])[::shuffle_block]
    bounds = np.append(bounds, total) if bounds[-1] != total else bounds
    # Each block shuffled in place: the same swaps, from the same draws, as permuting an arange
    # of its length and gathering by it, so the same order, without the two temporaries.
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        rng.shuffle(order[lo:hi])
    return EpochPlan(order, perm, shuffle_block)


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
