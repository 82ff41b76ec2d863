"""The memory of a Fuel stream's copies is written again only once nothing holds it, and a pass
read by its whole world stops holding what every rank has read."""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import zmq

from fuelline.server.sources.fuel import FuelStreamSource
from fuelline.server.sources.recycled import RecycledBuffers

SHAPE = (256, 1024)  # 1 MB of float32
MB = 2**20


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_buffer_is_handed_out_again_only_once_nothing_holds_it() -> None:
    pool = RecycledBuffers(64 * MB)
    first = pool.empty(SHAPE, np.float32)
    where = address(first)
    view = first[3:7]  # a view holds its base, and so the buffer
    del first
    second = pool.empty(SHAPE, np.float32)
    assert address(second) != where
    del view
    third = pool.empty(SHAPE, np.float32)
    assert address(third) == where and pool.reused == 1


def test_a_buffer_lent_to_a_zero_copy_send_or_a_memoryview_is_not_reused() -> None:
    pool = RecycledBuffers(64 * MB)
    a = pool.empty(SHAPE, np.float32)
    b = pool.empty(SHAPE, np.float32)
    address_a, address_b = address(a), address(b)
    lent = {address_a, address_b}
    frame = zmq.Frame(a, copy=False)  # what a zero-copy send keeps until ZeroMQ lets it go
    exported = memoryview(b)
    del a, b
    again = [pool.empty(SHAPE, np.float32) for _ in range(3)]
    assert not lent & {address(x) for x in again}
    del exported, again
    assert address(pool.empty(SHAPE, np.float32)) == address_b  # (idle once the export went)
    del frame  # ZeroMQ lets go of a zero-copy frame's buffer on its own thread, a moment later
    deadline = time.monotonic() + 10
    while address(pool.empty(SHAPE, np.float32)) != address_a:
        assert time.monotonic() < deadline, "the frame's buffer was never used again"


def test_buffers_kept_stay_within_the_limit_and_idle_ones_of_other_sizes_make_room() -> None:
    pool = RecycledBuffers(3 * MB)
    held = [pool.empty(SHAPE, np.float32) for _ in range(5)]  # 3 kept, 2 of plain new memory
    assert pool.kept == 3 * MB and pool.fresh == 5 and pool.reused == 0
    del held
    other = pool.empty((512, 1024), np.float32)  # 2 MB: two idle 1 MB buffers are let go for it
    assert pool.kept <= 3 * MB and other.nbytes == 2 * MB
    small = pool.empty((10,), np.float32)  # under a page: plain memory, never kept
    assert small.shape == (10,) and pool.kept <= 3 * MB


class Refilled:
    """A Fuel stream that refills one buffer for every batch, each batch with its own value."""

    sources = ("x",)

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.buffer = np.empty(SHAPE, np.float32)

    def get_epoch_iterator(self, **kwargs: object) -> Iterator[tuple[np.ndarray]]:
        for i in range(self.batches):
            self.buffer[:] = i
            yield (self.buffer,)


def test_a_batch_held_by_its_reader_keeps_its_values_while_the_memory_of_others_is_reused() -> None:
    source = FuelStreamSource(Refilled(120), buffer_mb=8)
    kept: dict[int, np.ndarray] = {}
    try:
        for i, batch in enumerate(source.iter_batches("train", 0, 0, 1, 0, ("x",))):
            if i % 7 == 0:
                kept[i] = batch["x"]  # as a session's memory tier or a queued send holds one
        reused = source._buffers.reused
    finally:
        source.close()
    assert reused > 50, "the copies' memory was not used again"
    for i, x in kept.items():
        assert np.all(x == i), f"batch {i} was overwritten: it holds {np.unique(x)[:5]}"


def test_a_whole_world_reading_holds_an_eighth_of_the_budget_of_what_it_has_read() -> None:
    source = FuelStreamSource(Refilled(100), buffer_mb=64)
    try:
        for _ in source.iter_batches("train", 0, 0, 1, 0, ("x",)):
            pass
        peak = source.buffer_stats["peak"]
    finally:
        source.close()
    # the eighth, the batch in the reader's hands and batch 0, which a rank may want as padding
    assert peak <= 64 * MB // 8 + 2 * MB + 4096, f"held {peak / MB:.1f} MB of batches its only rank had read"


def test_a_rank_not_reading_yet_keeps_the_whole_budget_for_its_batches() -> None:
    source = FuelStreamSource(Refilled(100), buffer_mb=64)
    try:
        for _ in source.iter_batches("train", 0, 0, 2, 0, ("x",)):  # rank 0 of 2; rank 1 comes later
            pass
        peak = source.buffer_stats["peak"]
        later = [float(b["x"][0, 0]) for b in source.iter_batches("train", 0, 1, 2, 0, ("x",))]
    finally:
        source.close()
    assert peak > 48 * MB, f"only {peak / MB:.1f} MB held for the rank yet to read"
    assert later == [float(i) for i in range(1, 100, 2)]
