"""``fuelline serve --workers N``: units decoded in worker processes. The batches are the same for
any N; a worker that dies is named, replaced and its unit retried once; nothing is left behind."""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import DataError
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.server.multimodal.source import WindowSource
from fuelline.server.sources.parquet import ParquetSource
from fuelline.server.sources.sample import write_sample_dataset
from fuelline.server.workers import handoff
from fuelline.server.workers.pool import RemoteTraceback, WorkerError, WorkerPool, WorkerPoolBroken

from support.processes import ServerProcess, wait_until
from support.workers import FakeUnits, UncopyableUnits, start_pool

TIMEOUT = 60.0


# -- fixtures and helpers ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def windows_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A converted multimodal dataset: ten short recordings (eight in train)."""
    root = tmp_path_factory.mktemp("workers-windows")
    synthesize(str(root / "raw"), 10, 16.0, 11, video_dim=4)
    convert(str(root / "raw"), str(root / "data"), val_fraction=0.2, seed=0, progress=False)
    return root / "data"


@pytest.fixture(scope="module")
def parquet_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("workers-parquet") / "sample"
    write_sample_dataset(str(out), rows=3000, dim=4, files=3, row_group_rows=150)
    return out


def handoff_folders(pid: int, directory: str | None = None) -> list[str]:
    """Hand-off folders of the serving process ``pid``'s pools (in /dev/shm, or the fallback)."""
    directory = directory or handoff.shm_dir()
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(f"{handoff.PREFIX}{pid}-"))


def handoff_files(pid: int, directory: str | None = None) -> list[str]:
    """Hand-off files of the serving process ``pid``: its pools' task files, not their locks."""
    files = []
    for folder in handoff_folders(pid, directory):
        try:
            files += [os.path.join(folder, n) for n in os.listdir(folder) if n != handoff.LOCK]
        except OSError:
            continue  # (removed meanwhile)
    return sorted(files)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX"  # a zombie has exited; only its entry is left


def worker_pids(server_pid: int) -> list[int]:
    """The worker processes of a server: its children started by multiprocessing's spawn."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(int(entry))
        if stat is None or stat[1] != server_pid or not alive(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return sorted(pids)


def fingerprint(batch: dict) -> dict:
    return {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in batch.items()}


def served(endpoint: str, epochs: int = 2, world_size: int = 2) -> dict[int, list[list[dict]]]:
    """Every batch each rank receives in ``epochs`` epochs, as bytes."""
    out = {}
    for rank in range(world_size):
        with ServerDataStream(endpoints=[endpoint], rank=rank, world_size=world_size, timeout=TIMEOUT) as s:
            out[rank] = [[fingerprint(b) for b in s.get_epoch_iterator(as_dict=True)] for _ in range(epochs)]
    return out


def first_difference(got: dict, want: dict) -> str | None:
    for rank in want:
        for epoch, (g, w) in enumerate(zip(got[rank], want[rank])):
            if len(g) != len(w):
                return f"rank {rank}, epoch {epoch}: {len(g)} batches, not {len(w)}"
            for i, (a, b) in enumerate(zip(g, w)):
                if a != b:
                    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                    return f"rank {rank}, epoch {epoch}, batch {i}: {keys} differ"
    return None


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
            assert not got[name].flags.writeable  # block tables go out zero-copy: nobody writes them
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


def test_worker_copies_of_the_sources_decode_the_same(windows_dataset: Path, parquet_dataset: Path) -> None:
    for source in (ParquetSource(str(parquet_dataset), workers=2), WindowSource(str(windows_dataset), workers=2)):
        try:
            columns = source.column_specs(source.sources)
            source._readahead_pool()  # transient state the copy leaves out
            copy = pickle.loads(pickle.dumps(source))
            assert copy.workers == 0 and copy._pool is None and copy._process_pool is None
            for name in source._serving_only:
                assert getattr(copy, name) is None
            want, got = source.decode_unit("train", 1, columns), copy.decode_unit("train", 1, columns)
            assert list(want) == list(got) and all(np.array_equal(want[k], got[k]) for k in want)
            assert source.describe_unit("train", 1) == copy.describe_unit("train", 1)
        finally:
            source.close()
    assert re.fullmatch(r"shard .+\.parquet, row group \d+", ParquetSource(str(parquet_dataset)).describe_unit("train", 1))
    assert re.fullmatch(r"recording \S+", WindowSource(str(windows_dataset)).describe_unit("train", 1))


# -- fuelline serve --workers N ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["windows", "parquet"])
def test_batches_are_byte_identical_for_any_number_of_workers(
    kind: str, windows_dataset: Path, parquet_dataset: Path, start_serve
) -> None:
    dataset = windows_dataset if kind == "windows" else parquet_dataset
    options = ["--batch-size", "16", "--shuffle-block", "2", "--seed", "5"]
    reference = None
    for workers in (0, 1, 2, 4):
        server = start_serve(dataset, "--workers", str(workers), *options)
        got = served(server.endpoint)
        if workers:
            assert f"started {workers} worker process" in server.log()
        assert server.terminate() == 0
        if reference is None:
            reference = got
            for rank in got:  # shuffled: the two epochs differ, and every batch has every source
                assert got[rank][0] != got[rank][1]
                assert "sample_id" in got[rank][0][0]
        else:
            assert first_difference(got, reference) is None, f"--workers {workers}: {first_difference(got, reference)}"


def test_a_worker_killed_mid_epoch_is_named_replaced_and_its_unit_retried(
    windows_dataset: Path, start_serve, servers: list, tmp_path: Path
) -> None:
    options = ["--batch-size", "4", "--shuffle-block", "1", "--seed", "2", "--hwm", "2"]
    reference = served(start_serve(windows_dataset, "--workers", "0", *options).endpoint, epochs=1, world_size=1)[0][0]
    # DEBUG: the server logs each unit as it hands it to a worker.
    args = [sys.executable, "-m", "fuelline.server.cli", "--log-level", "DEBUG", "serve", str(windows_dataset),
            "--port", "0", "--workers", "1", *options]
    servers.append(ServerProcess(args, tmp_path / "killed-worker.log"))
    server = servers[-1]

    received: list[dict] = []
    first, go = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def read() -> None:
        try:
            with ServerDataStream(endpoints=[server.endpoint], hwm=2, timeout=TIMEOUT) as s:
                for batch in s.get_epoch_iterator(as_dict=True):
                    received.append(fingerprint(batch))
                    first.set()
                    if not go.wait(TIMEOUT):
                        raise AssertionError("never told to go on")
        except BaseException as exc:  # reported by the test thread
            failure.append(exc)
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(TIMEOUT) and not failure, failure
    [pid] = worker_pids(server.proc.pid)
    handed = re.compile(rf"worker 0 \(pid {pid}\): decoding (recording \S+)")
    done = re.compile(rf"worker 0 \(pid {pid}\): done with ")

    def idle(log: str) -> bool:
        return len(handed.findall(log)) == len(done.findall(log))

    # The client waits after its first batch, so the server soon has all it may prepare and asks
    # for nothing more: the worker goes idle. Stopped then, it holds no unit; the next unit handed
    # to it (logged before it is sent) stays in its hands.
    for _ in range(5):
        wait_until(lambda: idle(server.log()), TIMEOUT, "the worker idle while the client waits")
        os.kill(pid, signal.SIGSTOP)
        mark = len(server.log())
        if idle(server.log()[:mark]):
            break
        os.kill(pid, signal.SIGCONT)  # a unit was handed out in between: wait again
    else:
        raise AssertionError("the worker never stayed idle")
    go.set()
    wait_until(lambda: handed.search(server.log()[mark:]), TIMEOUT, "a unit handed to the stopped worker")
    unit = handed.search(server.log()[mark:]).group(1)
    os.kill(pid, signal.SIGKILL)
    log = server.wait_log(r"worker 0 restarted as pid \d+", timeout=TIMEOUT)
    assert f"worker 0 (pid {pid}) killed by signal SIGKILL while decoding {unit}" in log
    assert f"retrying {unit} once" in log
    new_pid = int(re.search(r"worker 0 restarted as pid (\d+)", log).group(1))
    reader.join(TIMEOUT)
    assert not reader.is_alive() and not failure, failure
    assert len(received) == len(reference) and received == reference  # complete, and the same
    assert alive(new_pid) and worker_pids(server.proc.pid) == [new_pid]
    assert "died while decoding it, twice" not in server.log()


def test_sigterm_stops_the_workers_and_leaves_no_shared_memory(parquet_dataset: Path, start_serve) -> None:
    server = start_serve(parquet_dataset, "--workers", "2", "--batch-size", "64")
    served(server.endpoint, epochs=1, world_size=1)
    pids = worker_pids(server.proc.pid)
    assert len(pids) == 2 and re.search(r"started 2 worker processes .*pids", server.log())
    wait_until(lambda: not handoff_files(server.proc.pid), TIMEOUT, "hand-off files unlinked once mapped")
    assert server.terminate() == 0
    wait_until(lambda: not any(alive(pid) for pid in pids), TIMEOUT, "workers exit with their server")
    assert not handoff_folders(server.proc.pid)


def test_workers_of_a_killed_server_exit(parquet_dataset: Path, start_serve) -> None:
    server = start_serve(parquet_dataset, "--workers", "2", "--batch-size", "64")
    with ServerDataStream(endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        next(iter(s.get_epoch_iterator()))
    pids = worker_pids(server.proc.pid)
    assert len(pids) == 2
    server.kill()
    wait_until(lambda: not any(alive(pid) for pid in pids), TIMEOUT, "workers exit when their server is killed")
    # Its pool's folder goes with them: its lock died with the server.
    wait_until(lambda: not handoff_folders(server.proc.pid), TIMEOUT, "the killed server's hand-off folder removed")
