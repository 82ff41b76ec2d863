"""The epoch's plan is made a block at a time: the same order as made whole, and a reader is
served as soon as the blocks its rows need are made (its own; in order 1, every one up to its
rows), its first units decoding meanwhile."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import Future

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fuelline.server.sources.contract import Waiting
from fuelline.server.sources.epoch_plan import ORDER_VERSIONS, EpochPlan
from fuelline.server.sources.ordering import RankRows, epoch_order, rank_rows, rows_per_rank

from support.workers import FakeUnits

TIMEOUT = 20.0


class ThreadedPlan(EpochPlan):
    """A plan that starts a thread of its own however small it is (the tests' plans are)."""

    inline_rows = 0


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=25),
    seed=st.integers(0, 2**40),
    block=st.integers(1, 6),
    shuffle=st.booleans(),
    spans=st.lists(st.tuples(st.integers(0, 1200), st.integers(0, 300)), min_size=1, max_size=8),
    version=st.sampled_from(ORDER_VERSIONS),
)
def test_spans_asked_in_any_order_are_those_of_the_order_made_whole(
    lengths: list[int], seed: int, block: int, shuffle: bool, spans: list[tuple[int, int]], version: int
) -> None:
    whole = epoch_order(np.array(lengths), seed, 4, shuffle, block, version)
    plan = EpochPlan(np.array(lengths), seed, 4, shuffle, block, version)
    for lo, n in spans:
        got = plan.span(lo, lo + n)
        want = whole[(lo + np.arange(n)) % len(whole)] if len(whole) else whole[:0]
        assert np.array_equal(got, want), (lo, n)
        assert not got.flags.writeable
    assert np.array_equal(plan.order, whole)


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 300), world=st.integers(1, 9), block=st.integers(1, 5), chunk=st.integers(1, 50),
       version=st.sampled_from(ORDER_VERSIONS))
def test_a_ranks_rows_taken_in_chunks_are_its_span_of_the_whole_order(total: int, world: int, block: int, chunk: int,
                                                                       version: int) -> None:
    lengths = np.array([total // 3, total - total // 3 - total // 5, total // 5])
    whole = epoch_order(lengths, 9, 0, True, block, version)
    for rank in range(world):
        rows = RankRows(EpochPlan(lengths, 9, 0, True, block, version), rank, world)
        assert len(rows) == rows_per_rank(total, world)
        taken = np.concatenate([rows.take(lo, lo + chunk) for lo in range(0, len(rows), chunk)])
        assert np.array_equal(taken, rank_rows(whole, rank, world))


@pytest.mark.parametrize("version", ORDER_VERSIONS)
def test_a_plan_made_on_its_own_thread_is_the_same_order_and_says_when_a_span_is_made(version: int) -> None:
    lengths = np.full(64, 5000)
    whole = epoch_order(lengths, 3, 1, True, 4, version)
    plan = ThreadedPlan(lengths, 3, 1, True, 4, version).start()
    last = plan.pending(plan.total - 10, plan.total)
    if last is not None:
        last.result(timeout=TIMEOUT)
    assert plan.pending(plan.total - 10, plan.total) is None
    if version == 1:  # (a chained plan's last block is made after every other)
        assert plan.pending(0, plan.total) is None
    whole_made = plan.pending(0, plan.total)
    if whole_made is not None:
        whole_made.result(timeout=TIMEOUT)
    assert plan.pending(0, plan.total) is None
    assert np.array_equal(plan.order, whole)
    assert plan.order.itemsize == 4  # row ids that fit in 32 bits are held in 32 bits


@pytest.mark.parametrize("version", ORDER_VERSIONS)
def test_a_small_plan_is_made_whole_where_it_is_started_without_a_thread(version: int) -> None:
    lengths = np.full(40, 40)  # 1,600 rows: an epoch of a few batches
    plan = EpochPlan(lengths, 5, 0, True, 8, version)
    assert plan.total <= plan.inline_rows
    threads = threading.active_count()
    plan.start()
    assert plan._thread is None and threading.active_count() == threads
    assert plan.blocks_made() == list(range(plan.n_blocks))
    assert plan.pending(0, plan.total) is None
    assert np.array_equal(plan.order, epoch_order(lengths, 5, 0, True, 8, version))


class QuickIdlePlan(ThreadedPlan):
    idle_end = 0.2  # (seconds its thread waits for work before it ends)


@pytest.mark.parametrize("version", ORDER_VERSIONS)
def test_the_plans_thread_makes_the_blocks_after_those_asked_for_then_ends_and_holds_nothing(version: int) -> None:
    lengths = np.full(40, 1000)  # 10 blocks of 4 units
    plan = QuickIdlePlan(lengths, 5, 0, True, 4, version).start()
    whole = epoch_order(lengths, 5, 0, True, 4, version)
    assert np.array_equal(plan.span(0, 32), whole[:32])
    deadline = time.monotonic() + TIMEOUT
    while plan._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # (polling the thread's end; the deadline bounds it)
    assert plan._thread is None, "the plan's thread never ended"
    assert plan.blocks_made() == [0, 1, 2]  # the block asked for and the two after it, no more
    # Asked for a block further on, a new thread makes it, and the two after it.
    at = int(plan.bounds[6])
    waited = plan.pending(at, at + 32)
    assert waited is not None
    waited.result(timeout=TIMEOUT)
    assert np.array_equal(plan.span(at, at + 32), whole[at:at + 32])
    deadline = time.monotonic() + TIMEOUT
    while plan._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert plan.blocks_made() == ([0, 1, 2, 6, 7, 8] if version == 2 else list(range(9)))
    # Its thread gone, nothing holds a plan nobody reads (an epoch's plan is 4 bytes a row).
    gone = weakref.ref(plan)
    del plan
    gc.collect()
    assert gone() is None


class CountedPlan(ThreadedPlan):
    """A plan that lists the blocks it makes, in turn."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.made: list[int] = []

    def _fill_block(self, b: int) -> None:
        self.made.append(b)
        super()._fill_block(b)


def _read_spans(plan: EpochPlan, whole: np.ndarray, seed: int, barrier: threading.Barrier,
                wrong: list[tuple[int, int]]) -> None:
    """40 spans of ``plan`` anywhere (wrapping around its end), each waited for as a serving loop
    does and then taken; those that differ from ``whole`` go to ``wrong``."""
    r = np.random.default_rng(seed)
    barrier.wait(TIMEOUT)
    for _ in range(40):
        lo, n = int(r.integers(0, 2 * plan.total)), int(r.integers(0, 700))
        pending = plan.pending(lo, lo + n)
        if pending is not None:
            pending.result(timeout=TIMEOUT)
        if not np.array_equal(plan.span(lo, lo + n), whole[(lo + np.arange(n)) % plan.total]):
            wrong.append((lo, n))


@pytest.mark.parametrize("version", ORDER_VERSIONS)
def test_readers_on_many_threads_and_the_plans_own_get_the_order_made_whole(version: int) -> None:
    """Blocks made by whichever thread asks first, with the plan's thread going on meanwhile: every
    span any reader takes, made or waited for, is the order made whole, and each block is made once."""
    lengths = np.random.default_rng(3).integers(50, 400, 60)
    whole = epoch_order(lengths, 11, 2, True, 3, version)
    for trial in range(5):
        plan = CountedPlan(lengths, 11, 2, True, 3, version)
        if trial % 2:
            plan.start()
        wrong: list[tuple[int, int]] = []
        barrier = threading.Barrier(8)
        readers = [threading.Thread(target=_read_spans, args=(plan, whole, 100 * trial + i, barrier, wrong), daemon=True)
                   for i in range(8)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(TIMEOUT)
        assert not any(t.is_alive() for t in readers), "a reader hung"
        assert wrong == [], wrong[:5]
        assert sorted(plan.made) == sorted(set(plan.made)), "a block was made twice"
        assert np.array_equal(plan.order, whole)


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


class HeldPlan(ThreadedPlan):
    """A plan whose own thread stops before block ``held`` until ``go`` is set."""

    def __init__(self, *args, held: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held = held
        self.go = threading.Event()

    def _fill_block(self, b: int) -> None:
        if b >= self.held and threading.current_thread() is self._thread:
            assert self.go.wait(TIMEOUT), "the test never let the plan go on"
        super()._fill_block(b)


@pytest.mark.parametrize("version", ORDER_VERSIONS)
def test_rank_0s_first_batch_needs_only_the_first_block(version: int) -> None:
    lengths = np.full(40, 1000)
    plan = HeldPlan(lengths, 5, 0, True, 4, version, held=1)  # its thread made block 0 only
    source = RowUnits(40, [plan], batch_size=32, seed=5, shuffle=True, shuffle_block=4, decoded_cache_mb=0,
                      order_version=version)
    try:
        batches = source.iter_batches("train", 0, 0, 2, 0, ("sample_id",))
        first = next(batches)
        assert plan.blocks_made() == [0], f"blocks {plan.blocks_made()} of {plan.n_blocks} made for rank 0's first batch"
        assert np.array_equal(first["sample_id"], epoch_order(lengths, 5, 0, True, 4, version)[:32])
        batches.close()
    finally:
        plan.go.set()
        source.close()


class UnstartedPlan(EpochPlan):
    """A plan with no thread of its own: its readers make the blocks they need."""

    def start(self) -> "UnstartedPlan":
        return self


@pytest.mark.parametrize("version", ORDER_VERSIONS)
def test_the_last_ranks_first_batch_needs_its_own_block_in_order_2_and_every_one_before_in_order_1(version: int) -> None:
    lengths = np.full(40, 1000)
    plan = UnstartedPlan(lengths, 5, 0, True, 4, version)  # the reader makes what it needs
    source = RowUnits(40, [plan], batch_size=32, seed=5, shuffle=True, shuffle_block=4, decoded_cache_mb=0,
                      order_version=version)
    world = 4
    rank = world - 1
    try:
        batches = source.iter_batches("train", 0, rank, world, 0, ("sample_id",))
        first = next(batches)
        own = plan.block_at(rows_per_rank(plan.total, world) * rank)
        assert own == 7
        want = [own] if version == 2 else list(range(own + 1))
        assert plan.blocks_made() == want
        assert np.array_equal(first["sample_id"], rank_rows(epoch_order(lengths, 5, 0, True, 4, version), rank, world)[:32])
        batches.close()
    finally:
        source.close()


class RecordedPlan(ThreadedPlan):
    """A plan whose own thread waits for ``go`` before its first block, and records the blocks
    it makes, in turn."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.go = threading.Event()
        self.by_thread: list[int] = []

    def _fill_block(self, b: int) -> None:
        if threading.current_thread() is self._thread:
            assert self.go.wait(TIMEOUT), "the test never let the plan go on"
            self.by_thread.append(b)
        super()._fill_block(b)


def test_in_order_2_the_plans_thread_makes_the_block_a_reader_waits_for_before_the_others() -> None:
    lengths = np.full(40, 1000)
    plan = RecordedPlan(lengths, 5, 0, True, 4, 2).start()
    try:
        last = plan.block_at(plan.total - 1)
        waited = plan.pending(plan.total - 32, plan.total)
        assert waited is not None and not waited.done()
        plan.go.set()
        waited.result(timeout=TIMEOUT)
        # (The thread may have taken block 0 before the reader asked: then the reader's is next.)
        assert last in plan.by_thread[:2], f"the plan's thread made blocks {plan.by_thread} before block {last}"
        assert np.array_equal(plan.span(plan.total - 32, plan.total), epoch_order(lengths, 5, 0, True, 4, 2)[-32:])
    finally:
        plan.go.set()


class GatedPlan(ThreadedPlan):
    """A plan whose own thread makes block 0 only once a reader waits for it (``making_0`` is set
    when it has taken it), then stops before block 1 until ``go`` is set."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reader_waits = threading.Event()
        self.making_0 = threading.Event()
        self.go = threading.Event()

    def _ensure(self, blocks) -> None:
        if threading.current_thread() is not self._thread:
            self.reader_waits.set()
        super()._ensure(blocks)

    def _fill_block(self, b: int) -> None:
        if threading.current_thread() is self._thread:
            if b == 0:
                self.making_0.set()
            event = self.reader_waits if b == 0 else self.go
            assert event.wait(TIMEOUT), f"block {b} was never let go on"
        super()._fill_block(b)


def _wait_then_read(plan: "GatedPlan", got: list[np.ndarray]) -> None:
    """Ask for block 0 as a serving loop does (the plan's thread takes it), then read it."""
    plan.pending(0, 32)
    assert plan.making_0.wait(TIMEOUT), "the plan's thread never took block 0"
    got.append(plan.span(0, 32).copy())


@pytest.mark.parametrize("version", ORDER_VERSIONS)
def test_a_reader_waiting_for_a_block_being_made_has_it_once_made_not_after_the_next(version: int) -> None:
    """The plan's thread goes on to the next block as soon as one is made; a reader that waited
    for that one must not wait for the next too (nor, starved of a lock, for the whole plan)."""
    lengths = np.full(40, 1000)
    plan = GatedPlan(lengths, 5, 0, True, 4, version).start()
    got: list[np.ndarray] = []
    reader = threading.Thread(target=_wait_then_read, args=(plan, got), daemon=True)
    try:
        reader.start()
        reader.join(TIMEOUT / 4)
        assert not reader.is_alive(), "the reader of block 0 still waits while the plan's thread makes block 1"
        assert plan.blocks_made() == [0]
        assert np.array_equal(got[0], epoch_order(lengths, 5, 0, True, 4, version)[:32])
    finally:
        plan.go.set()
        reader.join(TIMEOUT)


@pytest.mark.parametrize("version", ORDER_VERSIONS)
def test_a_serving_loop_waits_for_the_plan_as_for_a_decode_and_the_ranks_units_decode_meanwhile(version: int) -> None:
    lengths = np.full(40, 1000)
    plan = HeldPlan(lengths, 5, 0, True, 4, version, held=2)
    source = RowUnits(40, [plan], batch_size=32, seed=5, shuffle=True, shuffle_block=4, decoded_cache_mb=0,
                      order_version=version)
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
        whole = epoch_order(lengths, 5, 0, True, 4, version)
        assert np.array_equal(step["sample_id"], rank_rows(whole, rank, world)[:32])
        steps.close()
    finally:
        plan.go.set()
        source.close()
