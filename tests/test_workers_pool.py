"""The worker pool in this process: units decoded in worker processes come back as the source
decodes them; errors arrive as raised; a worker that dies, crashes in native code or gets stuck is
named, replaced and its unit retried once; a crash loop or a failed set-up breaks the pool loudly;
closing it leaves no process or hand-off file behind."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fuelline.protocol import DataError
from fuelline.server.workers import handoff
from fuelline.server.workers.pool import RemoteTraceback, WorkerError, WorkerPool, WorkerPoolBroken

from support.processes import wait_until
from support.worker_processes import TIMEOUT, alive, handoff_files, handoff_folders
from support.workers import FakeUnits, UncopyableUnits, start_pool


# -- the pool, in this process -------------------------------------------------------------------
def test_a_pool_decodes_what_the_source_decodes_and_counts(pools: list) -> None:
    source = FakeUnits(units=6)
    columns = source.column_specs(source.sources)
    pool = start_pool(pools, source, 2)
    futures = [pool.submit("train", u, columns) for u in range(6)]
    expected = FakeUnits(units=6)
    for u, future in enumerate(futures):
        got = future.result(TIMEOUT)
        want = expected.decode_unit("train", u, columns)
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name])
            assert not got[name].flags.writeable  # batches cut from units go out zero-copy: nobody writes them
    assert source.counters["units_decoded"] == 6  # counted in the workers' copies, added up here
    assert source.counters["worker_tasks"] == 6
    assert source.counters["workers_started"] == 2
    assert not handoff_files(os.getpid()), "every hand-off file is unlinked once mapped"


def test_errors_raised_in_a_worker_arrive_as_raised(pools: list) -> None:
    source = FakeUnits(units=4, behaviour={1: "data", 2: "bug"})
    columns = source.column_specs(source.sources)
    pool = start_pool(pools, source, 1)
    bad, bug, good = (pool.submit("train", u, columns) for u in (1, 2, 3))
    error = bad.exception(TIMEOUT)
    assert type(error) is DataError and str(error) == "unit 1 is unreadable on purpose"
    error = bug.exception(TIMEOUT)
    assert isinstance(error, WorkerError) and not isinstance(error, DataError)
    assert "unit 2 of split train" in str(error) and "ZeroDivisionError" in str(error)
    assert isinstance(error.__cause__, RemoteTraceback)
    assert "decode_unit" in str(error.__cause__) and "a bug in decode_unit" in str(error.__cause__)
    assert np.array_equal(good.result(TIMEOUT)["sample_id"], 3000 + np.arange(10))
    assert source.counters["workers_restarted"] == 0  # exceptions do not cost a worker


def test_a_unit_that_kills_its_worker_every_time_fails_with_a_data_error(pools: list, caplog) -> None:
    caplog.set_level(logging.INFO, logger="fuelline.server")
    source = FakeUnits(units=6, behaviour={3: "exit"})
    columns = source.column_specs(source.sources)
    pool = start_pool(pools, source, 2)
    futures = [pool.submit("train", u, columns) for u in range(6)]
    error = futures[3].exception(TIMEOUT)
    assert isinstance(error, DataError)
    assert "unit 3 of split train" in str(error) and "died while decoding it, twice" in str(error)
    assert "exited with code 3" in str(error)
    for u in (0, 1, 2, 4, 5):
        assert np.array_equal(futures[u].result(TIMEOUT)["x"], np.full((10, 2), u, dtype="<f4"))
    assert source.counters["workers_restarted"] == 2
    deaths = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(deaths) == 2
    for message in deaths:
        assert re.match(r"worker \d \(pid \d+\) exited with code 3 while decoding unit 3 of split train", message)
    assert any("retrying unit 3 of split train once" in r.getMessage() for r in caplog.records)
    assert len([r for r in caplog.records if re.match(r"worker \d restarted as pid \d+", r.getMessage())]) == 2
    # It would kill a worker again: it fails at once from now on.
    again = pool.submit("train", 3, columns)
    assert str(again.exception(TIMEOUT)) == str(error)
    assert source.counters["workers_restarted"] == 2
    assert all(alive(pid) for pid in pool.pids)


def test_a_crash_in_native_code_is_named_with_its_signal_and_traceback(pools: list, capfd) -> None:
    source = FakeUnits(units=3, behaviour={2: "segv"})
    columns = source.column_specs(source.sources)
    pool = start_pool(pools, source, 1)
    error = pool.submit("train", 2, columns).exception(TIMEOUT)
    assert isinstance(error, DataError) and "killed by signal SIGSEGV" in str(error)
    assert np.array_equal(pool.submit("train", 1, columns).result(TIMEOUT)["x"], np.ones((10, 2), "<f4"))
    err = capfd.readouterr().err  # the workers write to this process's stderr
    assert "Segmentation fault" in err and "decode_unit" in err  # faulthandler's traceback


def test_a_worker_stuck_on_a_unit_is_stopped_named_and_its_unit_fails_after_one_retry(
    pools: list, caplog, capfd
) -> None:
    caplog.set_level(logging.INFO, logger="fuelline.server")
    source = FakeUnits(units=4, behaviour={2: "hang"})
    columns = source.column_specs(source.sources)
    pool = start_pool(pools, source, 1, task_timeout=1.0)
    stuck = pool.submit("train", 2, columns)
    error = stuck.exception(TIMEOUT)
    assert isinstance(error, DataError)
    assert "unit 2 of split train" in str(error) and "was stuck for more than 1s" in str(error)
    deaths = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(deaths) == 2
    for message in deaths:
        assert re.match(r"worker 0 \(pid \d+\) was stuck for more than 1s and stopped by its watchdog "
                        r"while decoding unit 2 of split train; where its threads were", message), message
    err = capfd.readouterr().err  # the workers write to this process's stderr
    assert "Timeout (0:00:01)!" in err and "decode_unit" in err
    # The pool goes on: the replacement decodes the next unit.
    assert np.array_equal(pool.submit("train", 3, columns).result(TIMEOUT)["x"], np.full((10, 2), 3, "<f4"))


def test_worker_timeout_is_checked() -> None:
    with pytest.raises(DataError, match="^worker_timeout must be >= 0"):
        FakeUnits(worker_timeout=-1.0)
    with pytest.raises(ValueError, match="task_timeout"):
        WorkerPool(FakeUnits(), 1, task_timeout=0.0)


def test_a_unit_whose_first_worker_died_is_retried_once(pools: list, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="fuelline.server")
    source = FakeUnits(units=3, behaviour={2: ("exit-once", str(tmp_path / "crashed"))})
    columns = source.column_specs(source.sources)
    pool = start_pool(pools, source, 1)
    got = pool.submit("train", 2, columns).result(TIMEOUT)
    assert np.array_equal(got["sample_id"], 2000 + np.arange(10))
    assert source.counters["workers_restarted"] == 1 and source.counters["workers_started"] == 2
    assert any("exited with code 4 while decoding unit 2 of split train" in r.getMessage() for r in caplog.records)


def test_a_crash_loop_breaks_the_pool_loudly(pools: list, caplog) -> None:
    caplog.set_level(logging.INFO, logger="fuelline.server")
    source = FakeUnits(units=5, behaviour={u: "exit" for u in range(5)})
    columns = source.column_specs(source.sources)
    pool = start_pool(pools, source, 1, max_restarts=2)
    futures = [pool.submit("train", u, columns) for u in range(5)]
    errors = [f.exception(TIMEOUT) for f in futures]
    # Unit 0 killed two workers (restarts 1 and 2); unit 1 killed a third: more than 2 restarts.
    assert isinstance(errors[0], DataError) and not isinstance(errors[0], WorkerError)
    for error in errors[1:]:
        assert isinstance(error, WorkerPoolBroken)
        assert "3 worker restarts within 60s" in str(error) and "unit 1 of split train" in str(error)
    later = pool.submit("train", 4, columns).exception(TIMEOUT)
    assert isinstance(later, WorkerPoolBroken)
    assert any("worker pool broken" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    wait_until(lambda: not any(alive(pid) for pid in pool.pids), TIMEOUT, "workers of a broken pool stop")


def test_a_worker_that_cannot_set_up_breaks_the_pool_with_its_traceback(pools: list) -> None:
    source = UncopyableUnits(units=3)
    pool = start_pool(pools, source, 2)
    error = pool.submit("train", 0, source.column_specs(source.sources)).exception(TIMEOUT)
    assert isinstance(error, WorkerPoolBroken)
    assert "could not set up its copy of the source" in str(error)
    assert "RuntimeError: the dataset is not reachable from here" in str(error)
    assert source.counters["workers_restarted"] == 0  # no restarts: a copy that fails once fails again


def test_hand_off_files_of_dead_servers_are_swept_at_start(pools: list) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, timeout=TIMEOUT, check=True)
    dead = int(gone.stdout)
    # Named as older versions named them: one of a dead process, one of this process (which never
    # writes such names any more, so it is a dead run's that had this pid).
    stale = Path(handoff.shm_dir()) / f"{handoff.PREFIX}{dead}-0-7"
    stale.write_bytes(b"left by a server killed mid hand-off")
    reused = Path(handoff.shm_dir()) / f"{handoff.PREFIX}{os.getpid()}-999-0"
    reused.write_bytes(b"left by a server that had this pid")
    live = handoff.Incarnation(handoff.shm_dir())  # another pool of this process, alive
    Path(live.task_path(0)).write_bytes(b"being handed over")
    try:
        start_pool(pools, FakeUnits(units=1), 1)
        assert not stale.exists() and not reused.exists()
        assert Path(live.task_path(0)).exists()
    finally:
        live.remove()
        stale.unlink(missing_ok=True)
        reused.unlink(missing_ok=True)


def test_closing_a_pool_fails_what_waits_and_leaves_nothing_behind(pools: list) -> None:
    source = FakeUnits(units=60)
    columns = source.column_specs(source.sources)
    pool = start_pool(pools, source, 2)
    futures = [pool.submit("train", u, columns) for u in range(60)]
    futures[0].result(TIMEOUT)  # the workers are up and busy
    pids = pool.pids
    pool.close()
    for future in futures:
        error = future.exception(TIMEOUT)  # done either way, none left waiting
        assert error is None or isinstance(error, WorkerError)
    assert not any(alive(pid) for pid in pids)
    assert not handoff_folders(os.getpid())
    assert isinstance(pool.submit("train", 1, columns).exception(TIMEOUT), WorkerError)


@pytest.mark.parametrize("mode", ["skip", "fail"])
def test_a_unit_that_kills_workers_under_each_bad_shard_mode(mode: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="fuelline.server")
    source = FakeUnits(units=8, behaviour={3: "exit"}, workers=2, on_bad_shard=mode)
    losses: list[str] = []
    try:
        batches = source.iter_batches("train", 0, 0, 1, 0, source.sources, on_loss=losses.append)
        if mode == "fail":
            with pytest.raises(DataError, match=r"unit 3 of split train: a worker process died"):
                list(batches)
            return
        ids = np.concatenate([b["sample_id"] for b in batches])
    finally:
        source.close()
    assert sorted(ids.tolist()) == [u * 1000 + r for u in range(8) if u != 3 for r in range(10)]
    assert len(losses) == 1 and "unit 3 of split train" in losses[0] and "died" in losses[0]
    assert "its 10 rows are left out" in losses[0]


@pytest.mark.parametrize("workers", [0, 1])
def test_prefetch_hears_of_the_blocks_ahead_in_the_serving_process(workers: int) -> None:
    source = FakeUnits(units=9, shuffle_block=2, prefetch=2, workers=workers)
    try:
        batches = list(source.iter_batches("train", 0, 0, 1, 0, source.sources))
    finally:
        source.close()
    assert batches
    perm = [int(u) for u in source._plan("train", 0).unit_perm]
    assert {pid for pid, _ in source.prefetched} == {os.getpid()}
    # Block 0 submitted: blocks 1 and 2 are prefetched; then each block once, in need order.
    assert source.prefetched[0][1] == perm[2:6]
    assert [u for _, units in source.prefetched for u in units] == perm[2:]
