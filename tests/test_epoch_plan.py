"""The epoch's plan is made a block at a time: the same order as made whole, and a reader is
served as soon as the blocks up to its rows are made, its first units decoding meanwhile."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
from hypothesis import given, settings, strategies as st

from fuelline.server.sources.contract import Waiting
from fuelline.server.sources.ordering import EpochPlan, RankRows, epoch_order, rank_rows, rows_per_rank

from support.workers import FakeUnits

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
class RowUnits(FakeUnits):
    """Units of 1,000 rows, whose ``sample_id`` is each row's global id (u * 1000 + row). It
    serves the plans it is given, and sets an event per unit once it has been decoded."""

    def __init__(self, units: int, plans: list[EpochPlan], **options) -> None:
        super().__init__(units=units, rows=1000, **options)
        self.plans = plans  # served in the order epochs ask for them
        self.decoded = {u: threading.Event() for u in range(units)}

    def _new_plan(self, split: str, epoch: int) -> EpochPlan:
        return self.plans.pop(0)

    def decode_unit(self, split: str, u: int, columns) -> dict[str, np.ndarray]:
        out = super().decode_unit(split, u, columns)
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
    lengths = np.full(40, 1000)
    plan = HeldPlan(lengths, 5, 0, True, 4, held=1)  # its thread made block 0 only
    source = RowUnits(40, [plan], batch_size=32, seed=5, shuffle=True, shuffle_block=4, decoded_cache_mb=0)
    try:
        batches = source.iter_batches("train", 0, 0, 2, 0, ("sample_id",))
        first = next(batches)
        assert plan._filled < plan.held + 1, f"{plan._filled} of {plan.n_blocks} blocks made for rank 0's first batch"
        assert np.array_equal(first["sample_id"], epoch_order(lengths, 5, 0, True, 4)[:32])
        batches.close()
    finally:
        plan.go.set()
        source.close()


class GatedPlan(EpochPlan):
    """A plan whose own thread makes block 0 only once a reader waits for it, then stops before
    block 1 until ``go`` is set."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reader_waits = threading.Event()
        self.go = threading.Event()

    def _fill_through(self, block: int) -> None:
        if threading.current_thread() is not self._thread:
            self.reader_waits.set()
        super()._fill_through(block)

    def _fill_block(self, b: int) -> None:
        if threading.current_thread() is self._thread:
            event = self.reader_waits if b == 0 else self.go
            assert event.wait(TIMEOUT), f"block {b} was never let go on"
        super()._fill_block(b)


def test_a_reader_waiting_for_a_block_being_made_has_it_once_made_not_after_the_next() -> None:
    """The plan's thread goes on to the next block as soon as one is made; a reader that waited
    for that one must not wait for the next too (nor, starved of a lock, for the whole plan)."""
    lengths = np.full(40, 1000)
    plan = GatedPlan(lengths, 5, 0, True, 4).start()
    got: list[np.ndarray] = []
    reader = threading.Thread(target=lambda: got.append(plan.span(0, 32).copy()), daemon=True)
    try:
        reader.start()
        reader.join(TIMEOUT / 4)
        assert not reader.is_alive(), "the reader of block 0 still waits while the plan's thread makes block 1"
        assert plan._filled == 1
        assert np.array_equal(got[0], epoch_order(lengths, 5, 0, True, 4)[:32])
    finally:
        plan.go.set()
        reader.join(TIMEOUT)


def test_a_serving_loop_waits_for_the_plan_as_for_a_decode_and_the_ranks_units_decode_meanwhile() -> None:
    lengths = np.full(40, 1000)
    plan = HeldPlan(lengths, 5, 0, True, 4, held=2)
    source = RowUnits(40, [plan], batch_size=32, seed=5, shuffle=True, shuffle_block=4, decoded_cache_mb=0)
    world, rank = 2, 1  # rank 1's rows start half way through the order: block 5
    try:
        steps = source.iter_steps("train", 0, rank, world, 0, ("sample_id",))
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
        whole = epoch_order(lengths, 5, 0, True, 4)
        assert np.array_equal(step["sample_id"], rank_rows(whole, rank, world)[:32])
        steps.close()
    finally:
        plan.go.set()
        source.close()
