"""``fuelline serve --workers N``: the batches are byte-identical for any N (and a source's copy in a
worker decodes as the source does); a worker killed mid-epoch is named, replaced and its unit
retried; SIGTERM or a killed server leaves no worker and no shared memory behind."""

from __future__ import annotations

import os
import pickle
import re
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.server.multimodal.source import WindowSource
from fuelline.server.sources.parquet import ParquetSource
from fuelline.server.sources.sample import write_sample_dataset

from support.processes import ServerProcess, wait_until
from support.worker_processes import TIMEOUT, alive, handoff_files, handoff_folders, worker_pids


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


# -- a source's copy in a worker process ---------------------------------------------------------
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
