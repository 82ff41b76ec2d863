"""The order of an epoch: a permutation, seeded, mixed across files, sharded evenly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fuelline.protocol import OptionError
from fuelline.server.sources.epoch_plan import ORDER_VERSIONS
from fuelline.server.sources.options import SourceOptions
from fuelline.server.sources.ordering import batches_per_rank, epoch_order, epoch_plan, rank_rows
from fuelline.server.sources.parquet import ParquetSource

unit_lengths = st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(lengths=unit_lengths, seed=st.integers(0, 2**40), epoch=st.integers(0, 1000), block=st.integers(1, 10))
def test_epoch_order_is_a_permutation(lengths: list[int], seed: int, epoch: int, block: int) -> None:
    order = epoch_order(np.array(lengths), seed, epoch, True, block)
    assert sorted(order.tolist()) == list(range(sum(lengths)))


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 500), world_size=st.integers(1, 9), batch_size=st.integers(1, 40))
def test_ranks_are_disjoint_complete_and_equal(total: int, world_size: int, batch_size: int) -> None:
    order = epoch_order(np.array([total]), 0, 0, True, 1)
    shares = [rank_rows(order, r, world_size) for r in range(world_size)]
    assert len({len(s) for s in shares}) == 1  # equal rows, hence equal batch counts
    assert -(-len(shares[0]) // batch_size) == batches_per_rank(total, world_size, batch_size)
    together = np.concatenate(shares)
    assert set(together.tolist()) == set(range(total))  # every row
    # Padding is the only duplication: exactly the rows needed to even out the ranks.
    assert len(together) == -(-total // world_size) * world_size
    _, counts = np.unique(together, return_counts=True)
    assert int((counts - 1).sum()) == len(together) - total


def test_same_seed_same_order_other_seed_or_epoch_differs() -> None:
    lengths = np.array([100, 50, 80, 120])
    a = epoch_order(lengths, 7, 3)
    assert np.array_equal(a, epoch_order(lengths, 7, 3))
    assert not np.array_equal(a, epoch_order(lengths, 8, 3))
    assert not np.array_equal(a, epoch_order(lengths, 7, 4))


def test_no_shuffle_is_storage_order() -> None:
    assert np.array_equal(epoch_order(np.array([3, 4]), 0, 5, shuffle=False), np.arange(7))


def test_shuffle_mixes_rows_of_different_files_within_batches(sample_dataset: Path) -> None:
    src = ParquetSource(str(sample_dataset), batch_size=64, seed=0, shuffle=True, shuffle_block=4)
    # Train has 4 files of 2000 rows: ids 0-1999 in file 0, 2000-3999 in file 1, ...
    batch = next(src.iter_batches("train", 0, 0, 1, 0, ("sample_id",)))
    files = set((batch["sample_id"] // 2000).tolist())
    assert len(files) >= 2, f"a shuffled batch drew rows from only {files}"
    # And rows are shuffled within row groups, not served as runs.
    assert not np.all(np.diff(batch["sample_id"]) == 1)


def test_parquet_source_epoch_covers_every_row_once(sample_dataset: Path) -> None:
    src = ParquetSource(str(sample_dataset), batch_size=100, seed=3)
    ids = np.concatenate([b["sample_id"] for b in src.iter_batches("train", 1, 0, 1, 0, ("sample_id",))])
    assert sorted(ids.tolist()) == list(range(8000))


@pytest.mark.parametrize("start", [0, 1, 17, 79])
def test_iter_batches_from_a_cursor_continues_the_same_sequence(sample_dataset: Path, start: int) -> None:
    src = ParquetSource(str(sample_dataset), batch_size=50, seed=1)
    whole = [b["sample_id"] for b in src.iter_batches("train", 2, 1, 2, 0, ("sample_id",))]
    rest = [b["sample_id"] for b in src.iter_batches("train", 2, 1, 2, start, ("sample_id",))]
    assert len(rest) == len(whole) - start
    for a, b in zip(whole[start:], rest):
        assert np.array_equal(a, b)


def _defined_order(lengths: np.ndarray, seed: int, epoch: int, block: int, version: int) -> np.ndarray:
    """The order as the module defines it, written out the slow way: the permuted units' row ids
    end to end, then each block's rows gathered by a permutation of its length, drawn from the
    epoch's generator in turn (version 1) or from a generator of the block's own (version 2)."""
    entropy = [seed & 0xFFFFFFFF, seed >> 32, epoch]
    rng = np.random.default_rng(np.random.SeedSequence(entropy))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    perm = rng.permutation(len(lengths))
    order = np.concatenate([np.arange(starts[u], starts[u] + lengths[u]) for u in perm] + [np.zeros(0, np.int64)])
    bounds = list(np.cumsum([0, *lengths[perm]])[::block]) + [len(order)]
    for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if version == 2:
            rng = np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=(b,)))
        if hi > lo:
            order[lo:hi] = order[lo:hi][rng.permutation(hi - lo)]
    return order


@pytest.mark.parametrize("version", ORDER_VERSIONS)
def test_the_epoch_order_is_its_definition_bit_for_bit(version: int) -> None:
    # A position saved by one release resumes in another only if both draw one order.
    r = np.random.default_rng(5)
    for _ in range(40):
        lengths = r.integers(0, 400, r.integers(1, 50))
        seed, epoch, block = int(r.integers(0, 2**40)), int(r.integers(0, 9)), int(r.integers(1, 12))
        got = epoch_plan(lengths, seed, epoch, True, block, version).order
        want = _defined_order(lengths, seed, epoch, block, version)
        assert np.array_equal(got, want), (list(lengths), seed, epoch, block)


@pytest.mark.parametrize("version, order", [
    (1, [6, 2, 5, 1, 7, 0, 8, 13, 12, 10, 11, 3, 4, 9]),
    (2, [1, 6, 8, 5, 7, 2, 0, 3, 12, 10, 4, 9, 11, 13]),
])
def test_each_order_version_draws_the_order_it_always_drew(version: int, order: list[int]) -> None:
    # Written out once: a numpy whose generators or shuffle draw otherwise would move saved
    # positions to other rows, which the definition above, drawn by the same numpy, cannot see.
    assert epoch_order(np.array([3, 2, 4, 5]), 7, 1, True, 2, version).tolist() == order


def test_an_unknown_order_version_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="order_version"):
        epoch_order(np.array([3]), 0, 0, True, 1, 3)
    for wrong in (3, 0, True, "2", 2.0):
        with pytest.raises(OptionError, match="order_version"):
            SourceOptions(order_version=wrong)
        with pytest.raises(ValueError, match="order_version"):
            epoch_order(np.array([3]), 0, 0, True, 1, wrong)
    assert SourceOptions(order_version=np.int64(1)).order_version == 1  # (a numpy integer is a whole number)
