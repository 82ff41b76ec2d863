"""Hand-off files between worker processes and their server: named apart per pool incarnation (a
server restarted with a dead run's pid meets none of its files), a dead incarnation's swept
whatever its pid, and no room to write them slows units down, never fails them."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.server.sources.sample import write_sample_dataset
from fuelline.server.workers import handoff
from fuelline.server.workers.pool import WorkerPool

from support.processes import ServerProcess, wait_until
from support.worker_processes import handoff_folders
from support.workers import FakeUnits, FileSizeLimitedUnits, StartsUntilOrphaned, pool_with_a_unit_in_hand, start_pool

TIMEOUT = 60.0
PIPED = "decoded units come through the worker processes' pipes instead"


def decodes_right(pool: WorkerPool, source: FakeUnits, units: int) -> None:
    """Every unit comes back as the source decodes it here, read-only."""
    columns = source.column_specs(source.sources)
    futures = [pool.submit("train", u, columns) for u in range(units)]
    for u, future in enumerate(futures):
        got = future.result(TIMEOUT)
        want = FakeUnits.decode_unit(source, "train", u, columns)
        assert list(got) == list(want)
        for name in want:
            assert np.array_equal(got[name], want[name]) and not got[name].flags.writeable


# -- names -----------------------------------------------------------------------------------------
def test_files_a_dead_run_with_this_pid_left_under_the_names_a_pool_used_are_no_obstacle(pools: list) -> None:
    # Before incarnations, a pool named its files <pid>-<pool number>-<task>: a server restarted
    # with the pid of a dead run met that run's files under the very names it was about to use.
    directory = Path(handoff.shm_dir())
    left = [directory / f"{handoff.PREFIX}{os.getpid()}-{n}-{t}" for n in range(64) for t in range(4)]
    try:
        for path in left:
            path.write_bytes(b"left by a dead run that had this pid")
        decodes_right(start_pool(pools, FakeUnits(units=4), 2), FakeUnits(units=4), 4)
        assert not any(path.exists() for path in left)
    finally:
        for path in left:
            path.unlink(missing_ok=True)


def test_a_dead_incarnation_is_swept_whatever_its_pid_and_a_live_one_kept(pools: list, tmp_path: Path) -> None:
    # A folder named for this (live) pid whose lock nobody holds: a dead run's, pid reused.
    dead = tmp_path / f"{handoff.PREFIX}{os.getpid()}-deadrun0"
    dead.mkdir()
    (dead / handoff.LOCK).write_bytes(b"")
    for task in range(3):
        (dead / str(task)).write_bytes(b"x" * 100)
    live = handoff.Incarnation(str(tmp_path))
    Path(live.task_path(0)).write_bytes(b"being handed over")
    try:
        pool = start_pool(pools, FakeUnits(units=4), 2, handoff_dir=str(tmp_path))
        assert not dead.exists()
        assert Path(live.task_path(0)).exists()
        decodes_right(pool, FakeUnits(units=4), 4)
    finally:
        live.remove()
    pool.close()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(handoff.PREFIX)]


def test_a_sweep_judges_by_the_lock_not_the_pid(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, timeout=TIMEOUT, check=True)
    held_by_dead_pid = tmp_path / f"{handoff.PREFIX}{int(gone.stdout)}-held"
    held_by_dead_pid.mkdir()
    (held_by_dead_pid / handoff.LOCK).write_bytes(b"")
    (held_by_dead_pid / "0").write_bytes(b"x")
    # Its lock held by a process alive now (a pid taken over, say): not dead, whatever the pid says.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); sys.stdin.read()", str(held_by_dead_pid / handoff.LOCK)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert handoff.sweep_dead(str(tmp_path)) == 0 and (held_by_dead_pid / "0").exists()
    finally:
        holder.stdin.close()
        holder.wait(TIMEOUT)
    assert handoff.sweep_dead(str(tmp_path)) == 1 and not held_by_dead_pid.exists()


def test_a_folder_that_lost_its_lock_to_a_removal_is_removed_by_a_worker_of_its_pool(tmp_path: Path) -> None:
    # What one worker's removal leaves when another writes a file into the folder meanwhile: the
    # lock gone, the folder not. A sweep takes it for a folder being made (it never had a lock) and
    # keeps it a while; a worker of its pool knows it had one.
    folder = tmp_path / f"{handoff.PREFIX}{os.getpid()}-halfgone"
    folder.mkdir()
    (folder / "7").write_bytes(b"x" * 100)
    assert handoff.remove_if_dead(str(folder)) == 0 and folder.exists()
    assert handoff.remove_if_dead(str(folder), made=True) == 1 and not folder.exists()


def test_a_worker_busy_when_its_serving_process_is_killed_removes_the_pools_folder(tmp_path: Path) -> None:
    # The worker's reply to a task it was decoding finds the pipe broken (not the next read): it
    # used to exit at once there, leaving the pool's folder in /dev/shm.
    decoding = tmp_path / "decoding"
    source = FakeUnits(units=2, behaviour={0: ("until-orphaned", str(decoding))})
    _kill_the_server_and_see_its_folder_go(tmp_path, source, "busy decoding its unit", decoding)


def test_a_worker_still_starting_when_its_serving_process_is_killed_removes_the_pools_folder(tmp_path: Path) -> None:
    # Its "ready" finds the pipe broken: it used to die there with a traceback, leaving the folder.
    _kill_the_server_and_see_its_folder_go(tmp_path, StartsUntilOrphaned(units=2), "still starting")


def _kill_the_server_and_see_its_folder_go(tmp_path: Path, source: FakeUnits, worker: str, ready: Path | None = None) -> None:
    """A serving process of one worker (``pool_with_a_unit_in_hand``), killed once the file
    ``ready`` exists (by default once its pool has started), its worker ``worker``: the pool's
    folder must go with it."""
    directory, started = tmp_path / "handoff", tmp_path / "pool-started"
    directory.mkdir()
    server = multiprocessing.get_context("spawn").Process(target=pool_with_a_unit_in_hand,
                                                          args=(source, str(directory), str(started)))
    server.start()
    try:
        wait_until((ready or started).exists, TIMEOUT, f"the worker {worker}")
        assert len(handoff_folders(server.pid, str(directory))) == 1
    finally:
        server.kill()
        server.join(TIMEOUT)
    wait_until(lambda: not handoff_folders(server.pid, str(directory)), TIMEOUT,
               f"the pool's folder removed by its worker, {worker} when its server was killed")


# -- no room -------------------------------------------------------------------------------------
def test_a_worker_that_cannot_write_its_hand_off_file_sends_the_arrays_through_its_pipe(pools: list, caplog) -> None:
    # 10 000 rows a unit: 160 kB of arrays, past the 64 kB a worker's files may grow to here.
    source = FileSizeLimitedUnits(64 * 1024, units=6, rows=10_000)
    pool = start_pool(pools, source, 2)
    decodes_right(pool, source, 6)
    warnings = [r.getMessage() for r in caplog.records if PIPED in r.getMessage()]
    assert len(warnings) == 1, "said once, not once a unit"
    assert "File too large" in warnings[0]
    assert source.counters["workers_restarted"] == 0


def _mount_small_tmpfs(path: Path) -> bool:
    path.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                              capture_output=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def test_a_full_tmpfs_slows_units_down_and_fails_none(pools: list, tmp_path: Path, caplog) -> None:
    full = tmp_path / "shm"
    if not _mount_small_tmpfs(full):
        pytest.skip("mounting a 64 kB tmpfs needs root with CAP_SYS_ADMIN")
    try:
        source = FakeUnits(units=6, rows=10_000)  # 160 kB a unit: more than the whole tmpfs
        pool = start_pool(pools, source, 2, handoff_dir=str(full))
        decodes_right(pool, source, 6)
        warnings = [r.getMessage() for r in caplog.records if PIPED in r.getMessage()]
        assert len(warnings) == 1 and "No space left on device" in warnings[0]
        pool.close()
    finally:
        subprocess.run(["umount", "-l", str(full)], capture_output=True, timeout=TIMEOUT)


def test_a_server_whose_hand_off_directory_is_unusable_serves_through_the_pipes(tmp_path: Path, servers: list) -> None:
    dataset = tmp_path / "sample"
    write_sample_dataset(str(dataset), rows=2000, dim=4, files=2, row_group_rows=250)
    missing = tmp_path / "no-such-dir"
    env = {**os.environ, handoff.ENV_DIR: str(missing)}
    args = [sys.executable, "-m", "fuelline.server.cli", "serve", str(dataset), "--port", "0", "--workers", "2",
            "--batch-size", "64"]
    server = ServerProcess(args, tmp_path / "server.log", env)
    servers.append(server)
    with ServerDataStream(("sample_id", "features"), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        ids = [int(i) for b in s.get_epoch_iterator(as_dict=True) for i in b["sample_id"]]
    assert len(ids) == len(set(ids)) == 1600
    log = server.wait_log(PIPED)
    assert str(missing) in log and handoff.ENV_DIR in log
    assert server.terminate() == 0
