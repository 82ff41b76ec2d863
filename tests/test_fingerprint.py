"""The sequence fingerprint: a position continues only on a server that serves the same sequence.

A server killed and restarted with another seed, a checkpoint resumed on a server with another
batch size, or two servers of one reader that differ would otherwise deliver repeated and missing
samples without a word. Each case must raise ``FingerprintMismatch`` naming the part that differs,
before any batch of that server is handed out; the same files on two mounts must still agree.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from fuelline.client import ServerDataStream
from fuelline.protocol import Batch, FingerprintMismatch, Hello, ProtocolError, Welcome, decode, encode
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.server.multimodal.source import WindowSource
from fuelline.server.multimodal.stages import band_power
from fuelline.server.sources.parquet import ParquetSource

TIMEOUT = 20.0
ROWS = 8000  # the train split of the sample dataset: sample ids 0 … 7999
ARGS = ("--batch-size", "100", "--hwm", "2")


def epoch(endpoints: list[str]) -> list[list[int]]:
    """One whole epoch as lists of sample ids, one per batch."""
    with ServerDataStream(("sample_id",), endpoints=endpoints, timeout=TIMEOUT) as s:
        return [ids.tolist() for (ids,) in s.get_epoch_iterator()]


def restart(start_serve, dataset: Path, port: int, *options: str):
    """A server on the port a killed one held (retried while the port is still being released)."""
    deadline = time.monotonic() + 30.0
    while True:
        try:
            return start_serve(dataset, *options, "--port", str(port))
        except RuntimeError:  # it exited at once: the port was not free yet
            if time.monotonic() > deadline:
                raise


def read_across_a_restart(start_serve, dataset: Path, *restart_options: str):
    """Read 10 batches from a server, kill -9 it, restart it on the same port with
    ``restart_options`` and read on. Returns the batches delivered, the error that ended the
    reading (or None), the stream's state at the end and the restarted server."""
    first = start_serve(dataset, *ARGS, "--seed", "0")
    got: list[list[int]] = []
    error: FingerprintMismatch | None = None
    with ServerDataStream(("sample_id",), endpoints=[first.endpoint], hwm=2, heartbeat=0.2, timeout=TIMEOUT) as s:
        it = s.get_epoch_iterator()
        got += [next(it)[0].tolist() for _ in range(10)]
        first.kill()
        second = restart(start_serve, dataset, first.port, *restart_options)
        try:
            got += [batch[0].tolist() for batch in it]
        except FingerprintMismatch as exc:
            error = exc
        state = s.state_dict()
    return got, error, state, second


def test_a_server_restarted_with_another_seed_is_refused_naming_seed_and_delivers_nothing(
    sample_dataset: Path, start_serve
) -> None:
    expected = epoch([start_serve(sample_dataset, *ARGS, "--seed", "0").endpoint])
    got, error, _, second = read_across_a_restart(start_serve, sample_dataset, *ARGS, "--seed", "1")
    assert error is not None, "the restarted server's other sequence was served silently"
    assert error.differences == ["seed"]
    endpoint = f"tcp://127.0.0.1:{second.port}"
    assert f"seed is '0' in what {endpoint} served before and '1' at {endpoint} now" in str(error)
    # The client did reach the new server, and nothing it sent was delivered: every batch
    # delivered is the old sequence's batch at that position (the new seed orders rows otherwise).
    second.wait_log("from epoch 0 batch")
    assert 10 <= len(got) < len(expected)
    assert got == expected[: len(got)]


def test_a_server_restarted_with_the_same_options_continues_exactly_under_the_same_fingerprint(
    sample_dataset: Path, start_serve
) -> None:
    expected = epoch([start_serve(sample_dataset, *ARGS, "--seed", "0").endpoint])
    got, error, state, second = read_across_a_restart(start_serve, sample_dataset, *ARGS, "--seed", "0")
    assert error is None
    assert got == expected  # no repeats, no gaps, same order
    assert sorted(x for batch in got for x in batch) == list(range(ROWS))
    assert int(second.wait_log(r"from epoch 0 batch \d+").rsplit("batch ", 1)[1].split()[0]) > 0
    assert state["fingerprint"]["seed"] == "0" and state["fingerprint"]["batch_size"] == "100"


def test_a_saved_position_resumed_on_another_batch_size_is_refused_naming_batch_size(
    sample_dataset: Path, start_serve
) -> None:
    a = start_serve(sample_dataset, "--batch-size", "100")
    with ServerDataStream(("sample_id",), endpoints=[a.endpoint], timeout=TIMEOUT) as s:
        it = s.get_epoch_iterator()
        taken = [x for _ in range(5) for x in next(it)[0].tolist()]
        state = s.state_dict()
    assert state["fingerprint"]["batch_size"] == "100"
    b = start_serve(sample_dataset, "--batch-size", "50")
    with ServerDataStream(("sample_id",), endpoints=[b.endpoint], timeout=TIMEOUT) as s:
        s.load_state_dict(state)
        with pytest.raises(FingerprintMismatch) as info:
            next(s.get_epoch_iterator())
    assert info.value.differences == ["batch_size"]
    assert f"batch_size is '100' in the saved position and '50' at tcp://127.0.0.1:{b.port}" in str(info.value)
    # A stream already reading from that server refuses the position at once.
    with ServerDataStream(("sample_id",), endpoints=[b.endpoint], timeout=TIMEOUT) as s:
        next(s.get_epoch_iterator())
        with pytest.raises(FingerprintMismatch, match="batch_size"):
            s.load_state_dict(state)
    # On a server of the same sequence, the position continues: nothing taken comes again.
    with ServerDataStream(("sample_id",), endpoints=[start_serve(sample_dataset, "--batch-size", "100").endpoint],
                          timeout=TIMEOUT) as s:
        s.load_state_dict(state)
        rest = [x for (ids,) in s.get_epoch_iterator() for x in ids.tolist()]
    assert sorted(taken + rest) == list(range(ROWS))


def test_a_position_saved_in_order_1_is_refused_by_an_order_2_server_naming_the_option_and_resumes_on_order_1(
    sample_dataset: Path, start_serve
) -> None:
    """Order 2 moves rows to other positions: a position saved on a server of order 1 must not
    continue on one of order 2 (repeats and gaps), and the error says how to serve order 1."""
    old = start_serve(sample_dataset, "--batch-size", "100", "--order-version", "1")
    whole_v1 = epoch([old.endpoint])
    with ServerDataStream(("sample_id",), endpoints=[old.endpoint], timeout=TIMEOUT) as s:
        it = s.get_epoch_iterator()
        taken = [next(it)[0].tolist() for _ in range(5)]
        state = s.state_dict()
    assert taken == whole_v1[:5] and state["fingerprint"]["order"] == "1"
    new = start_serve(sample_dataset, "--batch-size", "100")
    whole_v2 = epoch([new.endpoint])
    assert sorted(x for b in whole_v2 for x in b) == list(range(ROWS)) and whole_v2 != whole_v1
    with ServerDataStream(("sample_id",), endpoints=[new.endpoint], timeout=TIMEOUT) as s:
        s.load_state_dict(state)
        with pytest.raises(FingerprintMismatch) as info:
            next(s.get_epoch_iterator())
    assert info.value.differences == ["order"]
    assert f"order is '1' in the saved position and '2' at tcp://127.0.0.1:{new.port}" in str(info.value)
    assert "`fuelline serve --order-version 1` serves order 1" in str(info.value)
    again = start_serve(sample_dataset, "--batch-size", "100", "--order-version", "1")
    with ServerDataStream(("sample_id",), endpoints=[again.endpoint], timeout=TIMEOUT) as s:
        s.load_state_dict(state)
        rest = [ids.tolist() for (ids,) in s.get_epoch_iterator()]
    assert taken + rest == whole_v1


def test_storage_order_is_the_same_in_every_order_version_and_so_is_its_fingerprint(sample_dataset: Path) -> None:
    v1, v2 = (ParquetSource(str(sample_dataset), shuffle=False, order_version=v, batch_size=100) for v in (1, 2))
    assert v1.fingerprint("train") == v2.fingerprint("train")
    assert v2.fingerprint("train")["order"] == "1"
    batches = [[b["sample_id"].tolist() for b in src.iter_batches("train", 0, 0, 1, 0, ("sample_id",))] for src in (v1, v2)]
    assert batches[0] == batches[1]


def test_a_state_without_a_fingerprint_pins_nothing(sample_dataset: Path, start_serve) -> None:
    a = start_serve(sample_dataset, "--batch-size", "100", "--seed", "0")
    with ServerDataStream(("sample_id",), endpoints=[a.endpoint], timeout=TIMEOUT) as s:
        next(s.get_epoch_iterator())
        state = s.state_dict()
    del state["fingerprint"]  # as an older client saved it: nothing to check a server against
    b = start_serve(sample_dataset, "--batch-size", "100", "--seed", "1")
    with ServerDataStream(("sample_id",), endpoints=[b.endpoint], timeout=TIMEOUT) as s:
        s.load_state_dict(state)
        assert len(list(s.get_epoch_iterator())) == ROWS // 100 - 1
        assert s.state_dict()["fingerprint"]["seed"] == "1"  # held to the server's from then on


def test_two_servers_on_copies_of_a_dataset_in_different_folders_agree(
    sample_dataset: Path, tmp_path: Path, start_serve
) -> None:
    copies = [tmp_path / "mount-a" / "data", tmp_path / "mount-b" / "elsewhere"]
    for copy in copies:
        shutil.copytree(sample_dataset, copy)  # copy2: sizes and modification times kept
    servers = [start_serve(copy, *ARGS, "--seed", "3").endpoint for copy in copies]
    with ServerDataStream(("sample_id",), endpoints=servers, timeout=TIMEOUT) as s:
        ids = [x for (batch,) in s.get_epoch_iterator() for x in batch.tolist()]
        assert s.info["storage"]["dataset"] == str(copies[0])
    assert sorted(ids) == list(range(ROWS))


def test_two_servers_of_one_reader_with_other_seeds_are_refused_naming_seed(
    sample_dataset: Path, start_serve
) -> None:
    a = start_serve(sample_dataset, *ARGS, "--seed", "3").endpoint
    b = start_serve(sample_dataset, *ARGS, "--seed", "4").endpoint
    with ServerDataStream(("sample_id",), endpoints=[a, b], timeout=TIMEOUT) as s:
        with pytest.raises(FingerprintMismatch) as info:
            next(s.get_epoch_iterator())
    assert info.value.differences == ["seed"]
    assert f"seed is '3' at tcp://{a} and '4' at tcp://{b}" in str(info.value)


def test_hundreds_of_skipped_shards_keep_the_welcome_small(sample_dataset: Path, tmp_path: Path, start_serve) -> None:
    dataset = tmp_path / "data"
    shutil.copytree(sample_dataset, dataset)
    for i in range(400):
        (dataset / "train" / f"broken-{i:04d}.parquet").write_bytes(b"not a parquet file")
    server = start_serve(dataset, "--on-bad-shard", "skip")
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        info = s.info
        ids = [x for (batch,) in s.get_epoch_iterator() for x in batch.tolist()]
    assert sorted(ids) == list(range(ROWS))
    assert info["skipped_shards_count"] == 400
    assert [x["file"] for x in info["skipped_shards"]] == [str(dataset / "train" / f"broken-{i:04d}.parquet")
                                                          for i in range(5)]
    assert info["skipped_shards_more"].startswith("395 more")
    assert server.log().count("leaving out shard") == 400  # the log names every one


def test_a_batch_sent_before_its_welcome_is_never_delivered(zmq_context: zmq.Context) -> None:
    """A peer that breaks the order (Welcome first, then batches) would have its batches handed
    out before its fingerprint was checked; the client refuses it instead."""
    router = zmq_context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    with ServerDataStream(("x",), endpoints=[f"127.0.0.1:{port}"], timeout=5.0) as s:
        it = s.get_epoch_iterator()  # connects and says Hello
        assert router.poll(5000), "no Hello within 5 s"
        rid, *frames = router.recv_multipart()
        hello = decode(frames)
        assert isinstance(hello, Hello)
        batch = Batch(hello.stream, 0, 0, {"x": np.zeros(3, dtype="<f4")})
        welcome = Welcome("s", hello.stream, ("x",), {"x": {"dtype": "<f4", "shape": []}}, 1, 1.0,
                          fingerprint={"seed": "0"})
        router.send_multipart([rid, *encode(batch)])
        router.send_multipart([rid, *encode(welcome)])
        with pytest.raises(ProtocolError, match="before its Welcome"):
            next(it)


def test_parquet_fingerprint_holds_what_orders_rows_and_nothing_else(sample_dataset: Path, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere"
    shutil.copytree(sample_dataset, copy)
    base = ParquetSource(str(sample_dataset)).fingerprint("train")
    assert set(base) >= {"files", "footers", "seed", "batch_size", "shuffle", "shuffle_block", "split"}
    assert all(isinstance(v, str) and len(v) <= 256 for v in base.values())
    same = [ParquetSource(str(copy)), ParquetSource(str(sample_dataset), workers=1, prefetch=2, decoded_cache_mb=0,
                                                      cache_mb=1, worker_timeout=5.0)]
    for source in same:
        assert source.fingerprint("train") == base
    assert base["order"] == "2"
    for options, part in [({"seed": 1}, "seed"), ({"batch_size": 32}, "batch_size"), ({"shuffle_block": 2}, "shuffle_block"),
                          ({"order_version": 1}, "order")]:
        assert _differences(base, ParquetSource(str(sample_dataset), **options).fingerprint("train")) == [part]
    assert ParquetSource(str(sample_dataset)).fingerprint("val")["split"] == "val"
    touched = copy / "train" / "part-00001.parquet"
    stat = touched.stat()
    os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5 * 10**9))  # copied without its times
    assert ParquetSource(str(copy)).fingerprint("train") == base  # the same content: the same sequence


def test_window_fingerprint_holds_windowing_stages_and_data(tmp_path: Path) -> None:
    synthesize(str(tmp_path / "raw"), 4, 12.0, 7, video_dim=4)
    convert(str(tmp_path / "raw"), str(tmp_path / "data"), val_fraction=0.25, seed=0, progress=False)
    shutil.copytree(tmp_path / "data", tmp_path / "copy")
    base = WindowSource(str(tmp_path / "data")).fingerprint("train")
    assert WindowSource(str(tmp_path / "copy"), decoded_cache_mb=0, prefetch=3).fingerprint("train") == base
    for options, part in [
        ({"window": 1.0}, "window"), ({"hop": 0.5}, "hop"), ({"max_gap": 0}, "max_gap"),
        ({"normalize": "none"}, "grids normalize"), ({"stages": [band_power]}, "stage_code stages"),
        ({"seed": 9}, "seed"),
    ]:
        assert _differences(base, WindowSource(str(tmp_path / "data"), **options).fingerprint("train")) == part.split()
    staged = WindowSource(str(tmp_path / "data"), stages=[band_power]).fingerprint("train")
    assert staged["stages"] == "fuelline.server.multimodal.stages:band_power"
    # Another conversion of the same recordings (another split seed) is another dataset.
    convert(str(tmp_path / "raw"), str(tmp_path / "other"), val_fraction=0.5, seed=1, progress=False)
    assert "manifest" in _differences(base, WindowSource(str(tmp_path / "other")).fingerprint("train"))


def _differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(k for k in {*a, *b} if a.get(k) != b.get(k))
