"""The epoch's plan is made a block at a time: the same order as made whole, and a reader is
served as soon as the blocks up to its rows are made, its first units decoding meanwhile."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings, strategies as st

from fuelline.server.sources.blocks import UnitSource
from fuelline.server.sources.contract import Waiting
from fuelline.server.sources.options import SourceOptions
from fuelline.server.sources.ordering import EpochPlan, RankRows, epoch_order, rank_rows, rows_per_rank

TIMEOUT = 20.0


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=25),
    seed=st.integers(0, 2**40),
    block=st.integers(1, 6),
    shuffle=st.booleans(),
    spans=st.lists(st.tuples(st.integers(0, 1200), st.integers(0, 300)), min_size=1, max_size=8),
)
def test_spans_asked_in_any_order_are_those_of_the_order_made_whole(
    lengths: list[int], seed: int, block: int, shuffle: bool, spans: list[tuple[int, int]]
) -> None:
    whole = epoch_order(np.array(lengths), seed, 4, shuffle, block)
    plan = EpochPlan(np.array(lengths), seed, 4, shuffle, block)
    for lo, n in spans:
        got = plan.span(lo, lo + n)
        want = whole[(lo + np.arange(n)) % len(whole)] if len(whole) else whole[:0]
        assert np.array_equal(got, want), (lo, n)
        assert not got.flags.writeable
    assert np.array_equal(plan.order, whole)


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 300), world=st.integers(1, 9), block=st.integers(1, 5), chunk=st.integers(1, 50))
def test_a_ranks_rows_taken_in_chunks_are_its_span_of_the_whole_order(total: int, world: int, block: int, chunk: int) -> None:
    lengths = np.array([total // 3, total - total // 3 - total // 5, total // 5])
    whole = epoch_order(lengths, 9, 0, True, block)
    for rank in range(world):
        rows = RankRows(EpochPlan(lengths, 9, 0, True, block), rank, world)
        assert len(rows) == rows_per_rank(total, world)
        taken = np.concatenate([rows.take(lo, lo + chunk) for lo in range(0, len(rows), chunk)])
        assert np.array_equal(taken, rank_rows(whole, rank, world))


def test_a_plan_made_on_its_own_thread_is_the_same_order_and_says_when_a_span_is_made() -> None:
    lengths = np.full(64, 5000)
    whole = epoch_order(lengths, 3, 1, True, 4)
    plan = EpochPlan(lengths, 3, 1, True, 4).start()
    last = plan.pending(plan.total - 10, plan.total)
    if last is not None:
        last.result(timeout=TIMEOUT)
    assert plan.pending(0, plan.total) is None
    assert np.array_equal(plan.order, whole)
    assert plan.order.itemsize == 4  # row ids that fit in 32 bits are held in 32 bits


# -- a source served from a plan not yet whole ------------------------------------------------------
@dataclass(frozen=True)
class Col:
    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_schema(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape)}


class RowUnits(UnitSource):
    """Units of one column, ``row``: each row's global id. It records which units were decoded,
    and an event per unit is set once it has been."""

    def __init__(self, lengths: list[int], **options) -> None:
        super().__init__(SourceOptions.of(**options))
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        self._columns = {"row": Col("row", "<i8", ())}
        self._splits = {"train": None}
        self.decoded = {u: threading.Event() for u in range(len(lengths))}
        self.plans: list[EpochPlan] = []  # the plans it serves from, in the order epochs ask

    def _new_plan(self, split: str, epoch: int) -> EpochPlan:
        return self.plans.pop(0)

    def info(self, split: str) -> dict:
        return {"kind": "row-units"}

    def fingerprint(self, split: str) -> dict[str, str]:
        return {"lengths": ",".join(map(str, self.lengths))}

    def unit_rows(self, split: str) -> np.ndarray:
        return self.lengths

    def column_specs(self, sources: tuple[str, ...]) -> list[Col]:
        return [self._columns[n] for n in sources]

    def decode_unit(self, split: str, u: int, columns) -> dict[str, np.ndarray]:
        out = {"row": self.starts[u] + np.arange(int(self.lengths[u]), dtype=np.int64)}
        self.decoded[u].set()
        return out


class HeldPlan(EpochPlan):
    """A plan whose own thread stops before block ``held`` until ``go`` is set."""

    def __init__(self, *args, held: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held = held
        self.go = threading.Event()

    def _fill_block(self, b: int) -> None:
        if b >= self.held and threading.current_thread() is self._thread:
            assert self.go.wait(TIMEOUT), "the test never let the plan go on"
        super()._fill_block(b)


def test_a_ranks_first_batch_needs_only_the_blocks_up_to_its_rows() -> None:
    source = RowUnits([1000] * 40, batch_size=32, seed=5, shuffle=True, shuffle_block=4, decoded_cache_mb=0)
    plan = HeldPlan(source.unit_rows("train"), 5, 0, True, 4, held=1)  # its thread made block 0 only
    source.plans.append(plan)
    try:
        batches = source.iter_batches("train", 0, 0, 2, 0, ("row",))
        first = next(batches)
        assert plan._filled < plan.held + 1, f"{plan._filled} of {plan.n_blocks} blocks made for rank 0's first batch"
        assert np.array_equal(first["row"], epoch_order(source.unit_rows("train"), 5, 0, True, 4)[:32])
        batches.close()
    finally:
        plan.go.set()
        source.close()


def test_a_serving_loop_waits_for_the_plan_as_for_a_decode_and_the_ranks_units_decode_meanwhile() -> None:
    source = RowUnits([1000] * 40, batch_size=32, seed=5, shuffle=True, shuffle_block=4, decoded_cache_mb=0)
    plan = HeldPlan(source.unit_rows("train"), 5, 0, True, 4, held=2)
    source.plans.append(plan)
    world, rank = 2, 1  # rank 1's rows start half way through the order: block 5
    try:
        steps = source.iter_steps("train", 0, rank, world, 0, ("row",))
        step = next(steps)
        # The loop is not held while the plan is made: it is told what to wait for, a future
        # not done while the plan's thread is held.
        assert isinstance(step, Waiting)
        assert not any(f.done() for f in step.futures)
        first_position = rows_per_rank(plan.total, world) * rank
        block = plan.block_at(first_position)
        assert block >= plan.held
        for u in plan.unit_perm[block * 4 : (block + 1) * 4].tolist():
            assert source.decoded[u].wait(TIMEOUT), f"unit {u} of rank {rank}'s first block was not decoded while the plan was held"
        plan.go.set()
        while isinstance(step, Waiting):
            for f in step.futures:
                assert isinstance(f, Future)
                f.result(timeout=TIMEOUT)
            step = next(steps)
        whole = epoch_order(source.unit_rows("train"), 5, 0, True, 4)
        assert np.array_equal(step["row"], rank_rows(whole, rank, world)[:32])
        steps.close()
    finally:
        plan.go.set()
        source.close()
