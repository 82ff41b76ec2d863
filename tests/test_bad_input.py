"""Bad input gets a clear error naming the thing, on the side that can act on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zmq

from fuelline.client import ServerDataStream
from fuelline.protocol import Hello, RemoteError, decode, encode

TIMEOUT = 20.0


def run_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", "serve", *args, "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )


def test_missing_dataset_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    result = run_serve(str(missing))
    assert result.returncode == 2
    assert f"dataset {str(missing)!r} does not exist" in result.stderr


def test_directory_without_parquet_is_named(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no data here")
    result = run_serve(str(tmp_path))
    assert result.returncode == 2
    assert "holds no .parquet files" in result.stderr and str(tmp_path) in result.stderr


def test_shards_disagreeing_on_a_column_type_are_named(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": pa.array([1.0, 2.0], pa.float32())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": pa.array([1, 2], pa.int64())}), tmp_path / "b.parquet")
    result = run_serve(str(tmp_path))
    assert result.returncode == 2
    assert "b.parquet" in result.stderr and "column 'x' has type int64" in result.stderr


@pytest.fixture
def mixed_dataset(tmp_path: Path) -> Path:
    table = pa.table(
        {
            "x": pa.array(np.arange(100, dtype=np.float32)),
            "name": pa.array([f"row{i}" for i in range(100)]),
            "ragged": pa.array([[1] * (i % 3) for i in range(100)], pa.list_(pa.int32())),
        }
    )
    pq.write_table(table, tmp_path / "part.parquet", row_group_size=30)
    return tmp_path


def test_unservable_columns_are_named_and_the_rest_served(mixed_dataset: Path, start_serve) -> None:
    server = start_serve(mixed_dataset, "--batch-size", "10")
    log = server.wait_log("not serving column 'ragged'")
    assert "not serving column 'name' has type string" in log
    with ServerDataStream(endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        xs = np.concatenate([b[0] for b in s.get_epoch_iterator()])
        assert s.sources == ("x",)
    assert sorted(xs.tolist()) == list(range(100))
    with pytest.raises(RemoteError) as info:
        with ServerDataStream(("x", "name"), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
            next(iter(s.get_epoch_iterator()))
    assert info.value.code == "unknown-source"
    assert "cannot serve source 'name': column 'name' has type string" in str(info.value)


def test_unknown_source_is_named_and_server_keeps_serving(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset)
    with pytest.raises(RemoteError) as info:
        with ServerDataStream(("sample_id", "pixels"), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
            next(iter(s.get_epoch_iterator()))
    assert info.value.code == "unknown-source"
    assert "'pixels'" in str(info.value) and "sample_id" in str(info.value)
    assert server.endpoint in str(info.value)
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        assert len(list(s.get_epoch_iterator())) == 125


def test_client_of_another_protocol_version_is_told_and_others_are_served(
    sample_dataset: Path, start_serve, zmq_context: zmq.Context
) -> None:
    server = start_serve(sample_dataset)
    sock = zmq_context.socket(zmq.DEALER)
    sock.connect(f"tcp://{server.endpoint}")
    header = msgpack.unpackb(encode(Hello("old-client"))[0])
    header["v"] = 99
    sock.send(msgpack.packb(header))
    assert sock.poll(10_000), "no answer to a hello of another version"
    reply = decode(sock.recv_multipart())
    assert reply.TYPE == "error" and reply.code == "version"
    assert "protocol version 1" in reply.message and "version 99" in reply.message
    sock.close(linger=0)
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        ids = np.concatenate([b[0] for b in s.get_epoch_iterator()])
    assert len(ids) == 8000


@pytest.mark.parametrize("option,value,message", [
    ("--batch-size", "0", "--batch-size: must be >= 1"),
    ("--hwm", "-1", "--hwm: must be >= 1"),
    ("--heartbeat", "0", "--heartbeat: must be in (0, 3600]"),
])
def test_bad_options_are_named(sample_dataset: Path, option: str, value: str, message: str) -> None:
    result = run_serve(str(sample_dataset), option, value)
    assert result.returncode == 2
    assert message in result.stderr


def test_port_in_use_is_named(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset)
    result = subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", "serve", str(sample_dataset), "--port", str(server.port)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{server.port}" in result.stderr
