"""How a reader gathers batches from decoded units: straight from the units (no block table in
between), reading only the rows it serves, from units that may be non-contiguous views, with the
same rows in the same order as the epoch's plan."""

from __future__ import annotations

import tracemalloc
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fuelline.protocol import DataError
from fuelline.server.sources.block_reader import BlockReader
from fuelline.server.sources.blocks import UnitSource
from fuelline.server.sources.options import SourceOptions
from fuelline.server.sources.ordering import rank_rows
from fuelline.server.sources.parquet import ParquetSource
from fuelline.server.sources.sample import expected_features, write_sample_dataset

WINDOW = 512  # samples per window: a window is 4 KB
HOP = 1
SPREAD = 10**6  # unit u's signal starts at u * SPREAD, so a value names its unit and window


@dataclass(frozen=True)
class Col:
    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_schema(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape)}


class WindowUnits(UnitSource):
    """Units whose ``win`` column is cut from a short signal by ``sliding_window_view``, as a
    windowed source's are: rows that overlap in memory, an array that is neither contiguous nor
    small once copied out. ``row`` is the global row id; units listed in ``bad`` fail to decode."""

    def __init__(self, lengths: list[int], bad: tuple[int, ...] = (), **options) -> None:
        super().__init__(SourceOptions.of(**options))
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        self.bad = bad
        self._columns = {"win": Col("win", "<f8", (WINDOW,)), "row": Col("row", "<i8", ())}
        self._splits = {"train": None}

    def info(self, split: str) -> dict:
        return {"kind": "window-units"}

    def fingerprint(self, split: str) -> dict[str, str]:
        return {"lengths": ",".join(map(str, self.lengths))}

    def unit_rows(self, split: str) -> np.ndarray:
        return self.lengths

    def column_specs(self, sources: tuple[str, ...]) -> list[Col]:
        return [self._columns[n] for n in sources]

    def decode_unit(self, split: str, u: int, columns) -> dict[str, np.ndarray]:
        if u in self.bad:
            raise DataError(f"unit {u}: unreadable on purpose")
        n = int(self.lengths[u])
        signal = u * SPREAD + np.arange((n - 1) * HOP + WINDOW, dtype=np.float64)
        windows = np.lib.stride_tricks.sliding_window_view(signal, WINDOW)[::HOP]
        assert n == 1 or not windows.flags.c_contiguous  # rows overlap: a view, not a copy
        return {"win": windows, "row": self.starts[u] + np.arange(n, dtype=np.int64)}


def expected(source: WindowUnits, rows: np.ndarray) -> dict[str, np.ndarray]:
    units = np.searchsorted(source.starts, rows, side="right") - 1
    first = units * SPREAD + (rows - source.starts[units]) * HOP
    return {"win": first[:, None] + np.arange(WINDOW, dtype=np.float64), "row": rows}


def epoch(source: UnitSource, e: int, rank: int = 0, world: int = 1, start: int = 0, on_loss=None):
    return list(source.iter_batches("train", e, rank, world, start, ("win", "row"), on_loss=on_loss))


@pytest.mark.parametrize("shuffle_block", [1, 4])
def test_window_views_are_gathered_row_by_row_not_copied_whole(shuffle_block: int) -> None:
    lengths = [4000, 3500, 4500, 3800]
    source = WindowUnits(lengths, batch_size=16, seed=3, shuffle=True, shuffle_block=shuffle_block,
                         decoded_cache_mb=0)
    unit_bytes = min(lengths) * WINDOW * 8  # one unit's windows copied out: 14 MB and more
    try:
        order = source._plan("train", 0).order  # made before measuring: the plan is not the reader
        served = 0
        tracemalloc.start()
        try:
            # Each batch checked and let go as it comes, as a server sends it and lets it go.
            for i, batch in enumerate(source.iter_batches("train", 0, 0, 1, 0, ("win", "row"))):
                want = expected(source, order[i * 16 : (i + 1) * 16])
                np.testing.assert_array_equal(batch["row"], want["row"], err_msg=f"batch {i}")
                np.testing.assert_array_equal(batch["win"], want["win"], err_msg=f"batch {i}")
                served += len(batch["row"])
                del batch, want
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert served == sum(lengths)
        # Copying a unit's windows out whole (np.take does, before it gathers) or into a block
        # table would allocate a unit's worth at least; gathering reads only the batches' rows.
        assert peak < unit_bytes / 2, f"an epoch allocated {peak / 2**20:.1f} MB at its peak"
    finally:
        source.close()


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_batches_follow_the_plan_at_any_rank_and_start(shuffle: bool, batch_size: int) -> None:
    # Uneven units, some shorter than a batch, so batches straddle units and blocks.
    lengths = [5, 130, 3, 64, 77, 1, 200, 40, 9]
    source = WindowUnits(lengths, batch_size=batch_size, seed=11, shuffle=shuffle, shuffle_block=3,
                         decoded_cache_mb=0)
    try:
        for world, rank, start in [(1, 0, 0), (3, 2, 0), (3, 1, 5)]:
            rows = rank_rows(source._plan("train", 2).order, rank, world)
            batches = epoch(source, 2, rank, world, start)
            assert len(batches) == max(0, -(-len(rows) // batch_size) - start)
            for i, batch in enumerate(batches, start):
                want = expected(source, rows[i * batch_size : (i + 1) * batch_size])
                for k in want:
                    np.testing.assert_array_equal(batch[k], want[k], err_msg=f"{k}, batch {i}")
    finally:
        source.close()


def test_a_lost_unit_shortens_only_the_batches_that_held_its_rows() -> None:
    lengths = [50, 60, 70, 80, 90]
    source = WindowUnits(lengths, bad=(2,), batch_size=16, seed=5, shuffle=True, shuffle_block=2,
                         on_bad_shard="skip", decoded_cache_mb=0)
    losses: list[str] = []
    try:
        batches = epoch(source, 0, on_loss=losses.append)
        order = source._plan("train", 0).order
        lost = (order >= source.starts[2]) & (order < source.starts[2] + lengths[2])
        assert len(batches) == -(-len(order) // 16)
        for i, batch in enumerate(batches):
            span = slice(i * 16, (i + 1) * 16)
            want = expected(source, order[span][~lost[span]])
            np.testing.assert_array_equal(batch["row"], want["row"], err_msg=f"batch {i}")
            np.testing.assert_array_equal(batch["win"], want["win"], err_msg=f"batch {i}")
        assert len(losses) == 1 and "unit 2: unreadable on purpose" in losses[0] and "70 rows" in losses[0]
    finally:
        source.close()


def test_gather_batches_cuts_where_one_batch_at_a_time_would() -> None:
    lengths = [33, 17, 64, 5, 48]
    source = WindowUnits(lengths, batch_size=10, seed=1, shuffle=True, shuffle_block=2, decoded_cache_mb=0)
    try:
        plan = source._plan("train", 0)
        columns = source.column_specs(("win", "row"))
        order = plan.order
        together = BlockReader(source.unit_rows("train"), columns, plan, source._submitter("train", columns))
        alone = BlockReader(source.unit_rows("train"), columns, plan, source._submitter("train", columns))
        try:
            many = together.gather_batches(order, 10)
            assert [len(b["row"]) for b in many] == [10] * 16 + [7]
            for i, batch in enumerate(many):
                one = alone.gather(order[i * 10 : (i + 1) * 10])
                for k in one:
                    np.testing.assert_array_equal(batch[k], one[k], err_msg=f"{k}, batch {i}")
        finally:
            together.close()
            alone.close()
    finally:
        source.close()


def test_a_shuffled_parquet_epoch_allocates_batches_not_blocks(tmp_path: Path) -> None:
    # Eight row groups of 4096 rows of 532 bytes: a block of eight is 17 MB.
    path = tmp_path / "data"
    write_sample_dataset(str(path), rows=40_960, dim=128, files=1, row_group_rows=4096, val_fraction=0.2)
    source = ParquetSource(str(path), batch_size=64, seed=7, shuffle=True, shuffle_block=8, decoded_cache_mb=0)
    block_bytes = 8 * 4096 * (8 + 128 * 4 + 8 + 4)
    try:
        epoch_rows = source.rows("train")
        order = source._plan("train", 1).order  # the plan's own arrays are not what this measures
        # pyarrow decodes into its own memory pool, which tracemalloc does not see: what it
        # counts is what the reader allocates with numpy.
        served = 0
        tracemalloc.start()
        try:
            for i, batch in enumerate(source.iter_batches("train", 1, 0, 1, 0, source.sources)):
                ids = order[i * 64 : (i + 1) * 64]  # sample ids of the train split are its row ids
                np.testing.assert_array_equal(batch["sample_id"], ids, err_msg=f"batch {i}")
                np.testing.assert_array_equal(batch["features"], expected_features(ids, 128), err_msg=f"batch {i}")
                served += len(ids)
                del batch
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert served == epoch_rows
        # A block table per block (two held at a time) would be 17 MB at least.
        assert peak < block_bytes / 4, f"a shuffled epoch allocated {peak / 2**20:.1f} MB at its peak"
    finally:
        source.close()


class TrackedUnits(WindowUnits):
    """WindowUnits that keep a weak reference to every unit they decode, to see when it is freed."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.decoded: dict[int, list[weakref.ref]] = {}

    def decode_unit(self, split: str, u: int, columns) -> dict[str, np.ndarray]:
        part = super().decode_unit(split, u, columns)
        self.decoded.setdefault(u, []).append(weakref.ref(part["row"]))
        return part

    def alive(self) -> set[int]:
        return {u for u, refs in self.decoded.items() if any(r() is not None for r in refs)}


def test_a_block_behind_the_gathers_is_let_go_before_the_next_is_built() -> None:
    # Four blocks of two units of 32 rows: a batch of 16 never straddles two blocks, so once a
    # gather draws from block 1 alone, nothing needs block 0 any more. What is held is the
    # decoded units themselves (no copy of them): those of block 1, and of block 2 read ahead.
    source = TrackedUnits([32, 32, 32, 32, 32, 32, 32, 32], batch_size=16, seed=2, shuffle=True, shuffle_block=2,
                          decoded_cache_mb=0)
    try:
        plan = source._plan("train", 0)
        columns = source.column_specs(("win", "row"))
        reader = BlockReader(source.unit_rows("train"), columns, plan, source._submitter("train", columns))
        try:
            blocks = [set(plan.unit_perm[b * 2 : b * 2 + 2].tolist()) for b in range(4)]
            reader.gather(plan.order[0:16])  # block 0; block 1 is read ahead
            reader.gather(plan.order[64:80])  # block 1 alone; block 2 is read ahead
            for future in [f for jobs in reader.pending.values() for _, f in jobs]:
                future.result(timeout=20)  # (the read-ahead's own references are gone by then)
            alive = source.alive()
            assert not alive & blocks[0], f"block 0's units {sorted(alive & blocks[0])} are still held"
            assert blocks[1] <= alive and blocks[2] <= alive
        finally:
            reader.close()
    finally:
        source.close()


def test_large_rows_are_gathered_alike_row_by_row_and_by_fancy_indexing() -> None:
    from numpy.lib.stride_tricks import sliding_window_view

    from fuelline.server.sources.block_reader import ROW_BY_ROW_BYTES, _gather_rows

    grid = np.arange(4000 * 14, dtype=np.float32).reshape(4000, 14)
    windows = sliding_window_view(grid, 256, axis=0)[::128].transpose(0, 2, 1)  # overlapping views, 14 KB rows
    assert windows[0].nbytes >= ROW_BY_ROW_BYTES
    rng = np.random.default_rng(0)
    src = rng.integers(0, len(windows), 20)
    dest = rng.permutation(32)[:20]
    one, other = np.zeros((32, 256, 14), np.float32), np.zeros((32, 256, 14), np.float32)
    _gather_rows(one, dest, windows, src)  # a row at a time
    other[dest] = windows[src]  # fancy indexing
    np.testing.assert_array_equal(one, other)
    np.testing.assert_array_equal(one[dest], windows[src])


def test_gathers_on_several_threads_take_turns() -> None:
    """Sessions gather on threads of their own: a second gather waits until the first is done."""
    import threading

    from fuelline.server.sources.buffers import gathering

    first_inside, first_may_leave, second_inside = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with gathering():
            first_inside.set()
            first_may_leave.wait(10)

    def second() -> None:
        assert first_inside.wait(10)
        with gathering():
            second_inside.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    try:
        assert first_inside.wait(10)
        # While the first gather lasts, the second one does not start (a bounded look for an absence) ...
        assert not second_inside.wait(0.3), "a second gather ran while the first was still gathering"
    finally:
        first_may_leave.set()
        for t in threads:
            t.join(10)
    # ... and starts as soon as the first is done.
    assert second_inside.is_set()
