"""A user's stages on a plain Parquet dataset: ``fuelline serve DATASET --stage mod:fn`` serves
what the stages return (they may add, replace and drop arrays), every batch exactly once, with
the stages named in the fingerprint; a stage that returns what cannot be served is refused at
start-up, and one that changes its output's shape later is an error naming the stages.

Real ``fuelline serve`` processes, stages written by the test into a module on PYTHONPATH, real
clients; the ``ParquetSource`` checks run in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import DataError, FingerprintMismatch, RemoteError
from fuelline.server.sources.parquet import ParquetSource
from fuelline.server.sources.sample import expected_features

from support.processes import ServerProcess

TIMEOUT = 20.0
ROWS = 8000  # train rows of the sample_dataset fixture
DIM = 8  # and the width of its features

STAGES = '''
import numpy as np


def summed(batch):
    """Replaces the features by their row sums (float64), keeps sample_id, adds its double."""
    return {"sample_id": batch["sample_id"], "total": batch["features"].astype(np.float64).sum(axis=1),
            "twice": batch["sample_id"] * 2}


def as_text(batch):
    return {"sample_id": batch["sample_id"], "name": np.array([str(i) for i in batch["sample_id"]])}


def grows(batch):
    """Two columns at the start-up probe (two rows), three afterwards."""
    width = 2 if len(batch["sample_id"]) == 2 else 3
    return {"sample_id": batch["sample_id"], "wide": np.zeros((len(batch["sample_id"]), width), np.float32)}
'''


@pytest.fixture
def stage_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "stages"
    folder.mkdir()
    (folder / "pq_stages.py").write_text(textwrap.dedent(STAGES))
    monkeypatch.syspath_prepend(str(folder))
    return folder


def serve(servers: list, tmp_path: Path, folder: Path, dataset: Path, *options: str) -> ServerProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "fuelline.server.cli", "serve", str(dataset), "--port", "0", "--batch-size", "500",
            *options]
    servers.append(ServerProcess(args, tmp_path / f"server-{len(servers)}.log", env=env))
    return servers[-1]


@pytest.mark.parametrize("workers", ["0", "1"])  # row groups decoded by threads, or by a worker process
def test_a_stage_on_parquet_serves_what_it_returns_every_row_once(
        sample_dataset: Path, servers: list, tmp_path: Path, stage_module: Path, workers: str) -> None:
    server = serve(servers, tmp_path, stage_module, sample_dataset, "--stage", "pq_stages:summed", "--workers", workers)
    with ServerDataStream(None, host="127.0.0.1", port=server.port, timeout=TIMEOUT, receive_timeout=TIMEOUT) as stream:
        assert sorted(stream.sources) == ["sample_id", "total", "twice"]
        assert stream.info["stages"] == ["pq_stages:summed"]
        batches = list(stream.get_epoch_iterator(as_dict=True))
    ids = np.concatenate([b["sample_id"] for b in batches])
    assert np.array_equal(np.sort(ids), np.arange(ROWS))
    for b in batches:
        assert b["total"].dtype == np.float64 and b["twice"].dtype == np.int64
        want = expected_features(b["sample_id"], DIM).astype(np.float64).sum(axis=1)
        np.testing.assert_allclose(b["total"], want, rtol=1e-6)
        assert np.array_equal(b["twice"], b["sample_id"] * 2)


def test_a_position_saved_with_a_stage_is_refused_by_a_server_without_it(
        sample_dataset: Path, servers: list, tmp_path: Path, stage_module: Path) -> None:
    staged = serve(servers, tmp_path, stage_module, sample_dataset, "--stage", "pq_stages:summed")
    with ServerDataStream(("sample_id",), host="127.0.0.1", port=staged.port, timeout=TIMEOUT,
                          receive_timeout=TIMEOUT) as stream:
        next(stream.get_epoch_iterator())
        state = stream.state_dict()
    plain = serve(servers, tmp_path, stage_module, sample_dataset)
    with ServerDataStream(("sample_id",), host="127.0.0.1", port=plain.port, timeout=TIMEOUT,
                          receive_timeout=TIMEOUT) as stream:
        stream.load_state_dict(state)
        with pytest.raises(FingerprintMismatch, match="stages"):
            next(stream.get_epoch_iterator())


def test_a_stage_returning_what_cannot_be_served_is_refused_at_start_naming_it(
        sample_dataset: Path, stage_module: Path) -> None:
    import pq_stages  # the module the fixture wrote

    with pytest.raises(DataError, match=r"stages pq_stages:as_text: 'name' .* not one number or fixed-shape array"):
        ParquetSource(str(sample_dataset), batch_size=500, stages=[pq_stages.as_text])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stage_module), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "fuelline.server.cli", "serve", str(sample_dataset), "--port", "0",
                             "--stage", "pq_stages:as_text"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode != 0 and "pq_stages:as_text" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]


def test_a_stage_whose_output_changes_shape_fails_the_reader_naming_it(
        sample_dataset: Path, servers: list, tmp_path: Path, stage_module: Path) -> None:
    server = serve(servers, tmp_path, stage_module, sample_dataset, "--stage", "pq_stages:grows")
    with ServerDataStream(None, host="127.0.0.1", port=server.port, timeout=TIMEOUT, receive_timeout=TIMEOUT) as stream:
        assert stream.schema["wide"]["shape"] == [2]
        with pytest.raises(RemoteError, match=r"stages pq_stages:grows returned 'wide' with shape \(500, 3\)"):
            next(stream.get_epoch_iterator())
