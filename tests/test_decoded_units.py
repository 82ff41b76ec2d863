"""Decoded units shared by every reader of a server: the ranks of a job decode each unit once an
epoch, a data set that fits is decoded once, and sharing never changes a batch."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import DataError
from fuelline.server.cache.decoded import DecodedUnits
from fuelline.server.sources.block_reader import BlockReader
from fuelline.server.sources.counters import Counts

from support.metrics import metrics_port, scrape
from support.workers import FakeUnits

TIMEOUT = 20.0
SOURCES = ("x", "sample_id")


class CountingUnits(FakeUnits):
    """FakeUnits that count their decodes, and may hold every decode until ``gate`` is set."""

    def __init__(self, *args, gate: threading.Event | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.decodes = Counts()
        self.gate = gate

    def decode_unit(self, split, u, columns):
        if self.gate is not None and not self.gate.wait(TIMEOUT):
            raise TimeoutError("the gate was never opened")
        self.decodes.add(u)
        return super().decode_unit(split, u, columns)


def _epoch(source, epoch: int, rank: int = 0, world: int = 1) -> list[dict[str, np.ndarray]]:
    return list(source.iter_batches("train", epoch, rank, world, 0, SOURCES))


def _same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# -- the cache itself ----------------------------------------------------------------------------
def test_one_decode_per_key_and_finished_units_are_read_only() -> None:
    counts = Counts()
    units = DecodedUnits(1 << 20, counts)
    calls = []
    with ThreadPoolExecutor(2) as pool:
        def decode(u: int) -> Future:
            calls.append(u)
            return pool.submit(lambda: {"x": np.full(4, u, dtype=np.float32)})

        a = units.get(("train", 1), lambda: decode(1))
        b = units.get(("train", 1), lambda: decode(1))
        c = units.get(("train", 2), lambda: decode(2))
        assert a is b and a is not c
        assert a.result(TIMEOUT)["x"].tolist() == [1.0] * 4
        c.result(TIMEOUT)
    assert calls == [1, 2]
    assert counts["cache_decoded_misses"] == 2 and counts["cache_decoded_hits"] == 1
    with pytest.raises(ValueError, match="read-only"):
        a.result()["x"][0] = 5.0
    assert units.held_bytes == 2 * 16


def test_least_recently_asked_is_evicted_beyond_the_budget() -> None:
    counts = Counts()
    units = DecodedUnits(2 * 400, counts)  # room for two units of 400 bytes

    def done(u: int) -> Future:
        f: Future = Future()
        f.set_result({"x": np.full(100, u, dtype=np.float32)})
        return f

    for u in (1, 2):
        units.get(u, lambda u=u: done(u))
    units.get(1, lambda: done(1))  # 1 is now the most recent
    units.get(3, lambda: done(3))  # over budget: 2 goes
    assert counts["cache_decoded_evictions"] == 1 and units.held_bytes == 800
    before = counts["cache_decoded_misses"]
    units.get(1, lambda: done(1))
    assert counts["cache_decoded_misses"] == before  # kept
    units.get(2, lambda: done(2))
    assert counts["cache_decoded_misses"] == before + 1  # evicted, decoded again


def test_an_evicted_unit_is_freed_at_once_not_left_to_the_garbage_collector() -> None:
    """Nothing but its readers may keep an evicted unit alive: a reference cycle would hold its
    memory, past the budget, until the cyclic garbage collector happened to run."""
    import gc
    import weakref

    counts = Counts()
    units = DecodedUnits(400, counts)  # room for one unit of 400 bytes

    def decoded(u: int) -> None:
        work: Future = Future()  # a decode that finishes after it was handed out, as a pool's does
        units.get(u, lambda: work)
        work.set_result({"x": np.full(100, u, dtype=np.float32)})

    gc.disable()
    try:
        decoded(1)
        first = weakref.ref(units.get(1, lambda: Future()).result()["x"])
        decoded(2)  # over budget: 1 is evicted, and no reader holds it
        assert counts["cache_decoded_evictions"] == 1
        assert first() is None, "the evicted unit's arrays outlived every reference but a cycle"
    finally:
        gc.enable()


def test_an_evicted_unit_a_reader_still_holds_is_handed_out_again_not_decoded_again() -> None:
    counts = Counts()
    units = DecodedUnits(400, counts)  # room for one unit of 400 bytes
    decodes: list[int] = []

    def done(u: int) -> Future:
        decodes.append(u)
        f: Future = Future()
        f.set_result({"x": np.full(100, u, dtype=np.float32)})
        return f

    held = units.get(1, lambda: done(1)).result()  # a reader gathers from unit 1
    units.get(2, lambda: done(2))  # over budget: 1 is evicted, though the reader still has it
    assert counts["cache_decoded_evictions"] == 1
    again = units.get(1, lambda: done(1)).result()
    assert decodes == [1, 2] and again["x"] is held["x"]  # the same arrays, no second copy
    assert counts["cache_decoded_revived"] == 1 and units.held_bytes == 400  # kept again, 2 made room
    del held, again  # every reader lets unit 1 go
    units.get(2, lambda: done(2))  # 1 is evicted, and nobody holds it any more
    units.get(1, lambda: done(1))
    assert decodes == [1, 2, 2, 1]  # freed, so decoded again


def test_ranks_that_drift_apart_share_what_one_of_them_still_holds(monkeypatch) -> None:
    """A budget smaller than the blocks two ranks read at once: a unit evicted while one rank
    still gathers from it is the other rank's too, not decoded a second time."""
    from fuelline.server.sources.blocks import UnitSource

    monkeypatch.setattr(UnitSource, "_decoded_budget", lambda self: 2 * 10 * 24)  # two units of 10 rows
    source = CountingUnits(units=8, rows=10)
    try:
        r0 = source.iter_batches("train", 0, 0, 2, 0, SOURCES)
        r1 = source.iter_batches("train", 0, 1, 2, 0, SOURCES)
        got = [b for pair in zip(r0, r1) for b in pair]
        assert len(got) == 2 * source.batches_per_epoch("train", 0, 2)
        assert source.counters["cache_decoded_evictions"] > 0  # the budget was too small to keep them
        assert sorted(source.decodes.values()) == [1] * 8, source.decodes
    finally:
        source.close()


def test_a_failed_decode_is_not_kept() -> None:
    units = DecodedUnits(1 << 20, Counts())
    attempts = []

    def decode() -> Future:
        attempts.append(1)
        f: Future = Future()
        if len(attempts) == 1:
            f.set_exception(DataError("shard a.parquet: unreadable"))
        else:
            f.set_result({"x": np.zeros(2)})
        return f

    with pytest.raises(DataError):
        units.get("k", decode).result()
    assert units.get("k", decode).result()["x"].shape == (2,)
    assert len(attempts) == 2


def test_a_pool_shutting_down_while_a_unit_is_asked_for_does_not_deadlock() -> None:
    """A pool that cancels its queue on shutdown runs the cancelled futures' callbacks under its
    own lock; the cache's callback takes the cache's lock. Asking for a unit while that happens
    must not hold the cache's lock across the pool's submit, or the two wait for each other."""
    units = DecodedUnits(1 << 20, Counts())
    pool = ThreadPoolExecutor(1)
    busy, release = threading.Event(), threading.Event()
    pool.submit(lambda: (busy.set(), release.wait(TIMEOUT)))  # the only worker: later ones queue
    assert busy.wait(TIMEOUT)
    queued = units.get("a", lambda: pool.submit(lambda: {"x": np.zeros(2)}))
    asking, go_on = threading.Event(), threading.Event()
    outcome: list[BaseException | Future] = []

    def decode_b() -> Future:
        asking.set()  # inside get("b"), before the submit
        assert go_on.wait(TIMEOUT)
        return pool.submit(lambda: {"x": np.ones(2)})

    def ask_b() -> None:
        try:
            outcome.append(units.get("b", decode_b))
        except BaseException as exc:  # (the pool was shut down meanwhile: submit refuses)
            outcome.append(exc)

    asker = threading.Thread(target=ask_b, daemon=True)
    asker.start()
    assert asking.wait(TIMEOUT)
    stopper = threading.Thread(target=lambda: pool.shutdown(wait=False, cancel_futures=True), daemon=True)
    stopper.start()
    stopper.join(TIMEOUT)
    go_on.set()
    asker.join(TIMEOUT)
    release.set()
    assert not stopper.is_alive(), "the pool's shutdown waited for the cache's lock, held across a submit"
    assert not asker.is_alive(), "asking for a unit never returned"
    assert queued.cancelled()
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)  # refused after shutdown, not hung
    # Neither the cancelled unit nor the refused one is kept: both are decoded when asked again.
    with ThreadPoolExecutor(1) as again:
        for key in ("a", "b"):
            assert units.get(key, lambda: again.submit(lambda: {"x": np.full(2, 7.0)})).result(TIMEOUT)["x"].tolist() == [7.0, 7.0]


def test_a_unit_can_be_cancelled_while_queued_not_once_its_decode_runs() -> None:
    """As a pool's own future: a reader that closes cancels what is still queued (it never
    runs), while a decode already running finishes and is kept for the other readers."""
    units = DecodedUnits(1 << 20, Counts())
    started, release = threading.Event(), threading.Event()
    ran = []

    def slow() -> dict:
        started.set()
        assert release.wait(TIMEOUT)
        return {"x": np.zeros(2)}

    with ThreadPoolExecutor(1) as pool:
        running = units.get("running", lambda: pool.submit(slow))
        queued = units.get("queued", lambda: pool.submit(lambda: ran.append(1) or {"x": np.ones(2)}))
        assert started.wait(TIMEOUT)
        assert not running.cancel() and not running.cancelled()
        assert queued.cancel() and queued.cancelled()
        release.set()
        assert running.result(TIMEOUT)["x"].tolist() == [0.0, 0.0]
    assert ran == []  # the cancelled decode never ran
    assert units.get("running", lambda: pytest.fail("decoded again")) is running  # kept


# -- through a source ----------------------------------------------------------------------------
def test_ranks_of_a_job_decode_each_unit_once_an_epoch() -> None:
    shared = CountingUnits(units=8, rows=10)
    alone = CountingUnits(units=8, rows=10, decoded_cache_mb=0)
    try:
        for source in (shared, alone):
            # Two ranks read side by side, as two clients of one server do.
            r0 = source.iter_batches("train", 0, 0, 2, 0, SOURCES)
            r1 = source.iter_batches("train", 0, 1, 2, 0, SOURCES)
            got = [b for pair in zip(r0, r1) for b in pair]
            assert len(got) == 2 * source.batches_per_epoch("train", 0, 2)
        assert sorted(shared.decodes.values()) == [1] * 8
        assert sum(alone.decodes.values()) > 8  # unshared, each rank decodes every block it touches
        # Sharing changes no batch.
        for rank in (0, 1):
            _same(_epoch(shared, 1, rank, 2), _epoch(alone, 1, rank, 2))
    finally:
        shared.close()
        alone.close()


def test_a_data_set_that_fits_is_decoded_once() -> None:
    source = CountingUnits(units=6, rows=10)
    try:
        first = _epoch(source, 0)
        _epoch(source, 1)
        _epoch(source, 2)
        assert sorted(source.decodes.values()) == [1] * 6
        assert source.counters["cache_decoded_misses"] == 6
        # And epoch 0 read again is epoch 0, from memory.
        _same(_epoch(source, 0), first)
    finally:
        source.close()


def test_a_closing_reader_does_not_break_the_one_sharing_its_decodes() -> None:
    gate = threading.Event()
    source = CountingUnits(units=8, rows=10, shuffle_block=8, gate=gate)
    reference = CountingUnits(units=8, rows=10, shuffle_block=8, decoded_cache_mb=0)
    try:
        columns = source.column_specs(SOURCES)
        plan = source._plan("train", 0)
        rows = source.unit_rows("train")
        # Both readers ask for block 0's eight units; the read-ahead threads (at most four) hold
        # some while the gate is shut, so the rest are still queued when the first reader closes.
        leaving = BlockReader(rows, columns, plan, source._submitter("train", columns))
        staying = BlockReader(rows, columns, plan, source._submitter("train", columns))
        leaving.close()
        gate.set()
        everything = np.arange(int(rows.sum()))
        got = staying.gather(everything)
        staying.close()
        assert source.counters["cache_decoded_misses"] > 8  # cancelled decodes were asked for again
        want = BlockReader(rows, columns, plan, reference._submitter("train", columns)).gather(everything)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    finally:
        gate.set()
        source.close()
        reference.close()


def test_decoded_cache_option_is_checked() -> None:
    with pytest.raises(DataError, match="^decoded_cache_mb must be a whole number >= 0"):
        FakeUnits(decoded_cache_mb=-1)


def test_two_clients_of_a_server_share_decodes(sample_dataset: Path, start_serve) -> None:
    """Two ranks read one epoch from one server; its metrics count one decode per row group.
    (TCP only: a client moving to the local socket would drop its first session, whose reader
    gives up its read-ahead, which is then asked for again.)"""
    server = start_serve(sample_dataset, "--batch-size", "100", "--metrics-port", "0", "--hwm", "4", "--no-local-ipc")
    port = metrics_port(server)
    streams = [ServerDataStream(("sample_id",), endpoints=[server.endpoint], rank=r, world_size=2, hwm=4,
                                timeout=TIMEOUT, client_id=f"rank{r}") for r in (0, 1)]
    try:
        its = [s.get_epoch_iterator() for s in streams]
        ids = [b[0] for pair in zip(*its) for b in pair]
    finally:
        for s in streams:
            s.close()
    assert len(np.unique(np.concatenate(ids))) == 8000  # every train row once, across both ranks
    after = scrape(port)
    misses = after[("fuelline_cache_misses_total", (("tier", "decoded"),))]
    hits = after[("fuelline_cache_hits_total", (("tier", "decoded"),))]
    assert misses == 16  # the sample's train split: 16 row groups of 500 rows
    assert hits >= 1  # the other rank found what the first had asked for


def test_with_workers_the_budget_leaves_half_of_dev_shm(monkeypatch, caplog) -> None:
    """Units from worker processes live in /dev/shm while kept: a container's 64 MB one caps
    the budget at 32 MB, said in the log; without workers nothing is capped."""
    from fuelline.server.workers import handoff

    monkeypatch.setattr(handoff, "shm_size", lambda: 64 * 2**20)
    with_workers = FakeUnits(workers=1, decoded_cache_mb=1024)
    threads = FakeUnits(workers=0, decoded_cache_mb=1024)
    assert with_workers._decoded_budget() == 32 * 2**20
    assert any("half of /dev/shm (64 MB)" in r.getMessage() for r in caplog.records)
    assert threads._decoded_budget() == 1024 * 2**20
