"""The stage pool that runs user stages off the serving loop: one batch of a reader at a time, in
order, readers in turn, a blocked reader holding one thread only; dropped batches cancelled; what
runs at close is named, not awaited. Real threads; stages block on events the test sets."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, wait

import pytest

from fuelline.server.sources.stage_pool import StagePool

TIMEOUT = 10.0


@pytest.fixture
def pool():
    made: list[StagePool] = []

    def make(threads: int) -> StagePool:
        made.append(StagePool(threads))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_a_reader_whose_stage_blocks_holds_one_thread_and_others_go_on(pool) -> None:
    stages = pool(2)
    gate, entered = threading.Event(), threading.Event()
    slow = [stages.submit("slow", f"slow {i}", lambda: (entered.set(), gate.wait(TIMEOUT))[1]) for i in range(5)]
    assert entered.wait(TIMEOUT)
    fast = [stages.submit(f"fast{i % 3}", f"fast {i}", lambda i=i: i * i) for i in range(30)]
    done, _ = wait(fast, TIMEOUT)
    assert len(done) == 30 and [f.result() for f in fast] == [i * i for i in range(30)]
    assert not any(f.done() for f in slow), "a slow reader's later batches ran beside its first"
    assert [r.batch for r in stages.runs()] == ["slow 0"]
    gate.set()
    assert all(f.result(TIMEOUT) is True for f in slow)


def test_a_readers_batches_run_one_at_a_time_in_order(pool) -> None:
    stages = pool(4)
    seen: list[int] = []
    running = []
    lock = threading.Lock()

    def stage(i: int) -> int:
        with lock:
            running.append(i)
            assert len(running) == 1, running
        seen.append(i)
        with lock:
            running.remove(i)
        return i

    futures = [stages.submit("reader", str(i), stage, i) for i in range(200)]
    assert [f.result(TIMEOUT) for f in futures] == list(range(200))
    assert seen == list(range(200))


def test_readers_take_turns_for_the_threads(pool) -> None:
    stages = pool(1)
    gate = threading.Event()
    order: list[str] = []
    first = stages.submit("a", "a0", lambda: (gate.wait(TIMEOUT), order.append("a0")))
    later = [stages.submit(owner, f"{owner}{i}", lambda o=owner, i=i: order.append(f"{o}{i}"))
             for i in range(1, 3) for owner in ("a", "b")]
    gate.set()
    wait([first, *later], TIMEOUT)
    # b's batches do not wait behind all of a's: the single thread alternates.
    assert order == ["a0", "b1", "a1", "b2", "a2"], order


def test_forgetting_a_reader_cancels_its_waiting_batches(pool) -> None:
    stages = pool(1)
    gate, entered = threading.Event(), threading.Event()
    running = stages.submit("r", "r0", lambda: (entered.set(), gate.wait(TIMEOUT))[1])
    waiting = [stages.submit("r", f"r{i}", lambda: None) for i in range(1, 4)]
    assert entered.wait(TIMEOUT)
    stages.forget("r")
    assert all(f.cancelled() for f in waiting)
    gate.set()
    assert running.result(TIMEOUT) is True
    with pytest.raises(CancelledError):
        waiting[0].result(0)


def test_close_names_what_runs_and_does_not_wait_for_it(pool) -> None:
    stages = pool(2)
    gate = threading.Event()
    entered = threading.Event()

    def hangs() -> None:
        stages.entering("mod:hangs")
        entered.set()
        gate.wait(TIMEOUT)

    stages.submit("r", "epoch 0 batch 3", hangs)
    queued = stages.submit("r", "epoch 0 batch 4", lambda: None)
    assert entered.wait(TIMEOUT)
    abandoned = stages.close()
    assert [(r.stage, r.batch) for r in abandoned] == [("mod:hangs", "epoch 0 batch 3")]
    assert queued.cancelled()
    assert stages.submit("r", "after", lambda: None).cancelled()
    gate.set()


def test_a_stage_error_reaches_the_reader_and_the_pool_goes_on(pool) -> None:
    stages = pool(1)

    def fails() -> None:
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        stages.submit("r", "b0", fails).result(TIMEOUT)
    assert stages.submit("r", "b1", lambda: 7).result(TIMEOUT) == 7


def test_stage_times_are_recorded(pool) -> None:
    stages = pool(1)
    stages.left("mod:f", 0.25)
    stages.left("mod:f", 0.75)
    assert stages.times() == {"mod:f": (2, 1.0)}
