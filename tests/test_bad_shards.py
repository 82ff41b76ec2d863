"""Shards that are corrupt, of another schema, or gone mid-epoch: named, and either the server
stops (--on-bad-shard fail, the default) or it serves the rest and says what it left out (skip).
Never a silent short epoch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import RemoteError

TIMEOUT = 20.0


@pytest.fixture
def dataset(sample_dataset: Path, tmp_path: Path) -> Path:
    """A private copy of the sample dataset (train: 4 files of 2000 rows, ids 2000·i … 2000·i+1999)."""
    copy = tmp_path / "data"
    shutil.copytree(sample_dataset, copy)
    return copy


def ids_of(endpoint: str, **kw) -> tuple[list[int], list[str]]:
    with ServerDataStream(("sample_id",), endpoints=[endpoint], timeout=TIMEOUT, **kw) as s:
        ids = np.concatenate([b[0] for b in s.get_epoch_iterator()]).tolist()
        return ids, s.data_losses


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def serve_fails(dataset: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fuelline.server.cli", "serve", str(dataset), "--port", "0"],
                          capture_output=True, text=True, timeout=60)


def test_a_truncated_shard_stops_the_server_by_default_naming_it(dataset: Path) -> None:
    bad = dataset / "train" / "part-00002.parquet"
    truncate(bad)
    result = serve_fails(dataset)
    assert result.returncode == 2
    assert f"shard {bad}: not a readable Parquet file" in result.stderr


def test_with_skip_a_truncated_shard_is_left_out_and_reported(dataset: Path, start_serve) -> None:
    bad = dataset / "train" / "part-00002.parquet"
    truncate(bad)
    server = start_serve(dataset, "--on-bad-shard", "skip")
    assert "leaving out shard" in server.wait_log("leaving out")
    with ServerDataStream(endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        skipped = s.info["skipped_shards"]
    assert [x["file"] for x in skipped] == [str(bad)] and "not a readable Parquet file" in skipped[0]["reason"]
    ids, _ = ids_of(server.endpoint)
    assert sorted(ids) == list(range(4000)) + list(range(6000, 8000))


def test_with_skip_a_shard_of_another_schema_is_left_out(dataset: Path, start_serve) -> None:
    other = dataset / "train" / "part-00003.parquet"
    pq.write_table(pa.table({"sample_id": pa.array(["not", "numbers"])}), other)
    assert "column 'sample_id' has type string" in serve_fails(dataset).stderr
    server = start_serve(dataset, "--on-bad-shard", "skip")
    ids, _ = ids_of(server.endpoint)
    assert sorted(ids) == list(range(6000))


@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_a_shard_that_vanishes_mid_epoch(dataset: Path, start_serve, mode: str) -> None:
    server = start_serve(dataset, "--no-shuffle", "--batch-size", "100", "--hwm", "2", "--on-bad-shard", mode)
    gone = dataset / "train" / "part-00003.parquet"  # rows 6000-7999, read last in storage order
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], hwm=2, timeout=TIMEOUT) as s:
        it = s.get_epoch_iterator()
        ids = [int(x) for _ in range(5) for x in next(it)[0]]
        gone.unlink()
        if mode == "fail":
            with pytest.raises(RemoteError) as info:
                for batch in it:
                    ids += batch[0].tolist()
            assert info.value.code == "data" and str(gone) in str(info.value)
            assert sorted(ids) == list(range(len(ids)))  # everything before it arrived, in order
            return
        ids += [int(x) for batch in it for x in batch[0]]
        losses = s.data_losses
    assert sorted(ids) == list(range(6000))
    # Four row groups of 500 rows were left out, each named with its file and counted.
    assert len(losses) == 4 and all(str(gone) in m and "its 500 rows are left out" in m for m in losses)
