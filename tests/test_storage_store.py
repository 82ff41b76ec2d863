"""The store and the disk cache in process: local paths read in place, S3 read through the cache
(fetches, hits, pickling, changed and corrupt objects, LRU eviction, background prefetch), one
fetch for two processes, and paths outside the dataset refused."""

from __future__ import annotations

import json
import logging
import os
import pickle
import select
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import xxhash

from fuelline.protocol import DataError
from fuelline.server.cache.disk import dataset_key
from fuelline.server.multimodal.manifest import Manifest, is_converted_dataset
from fuelline.server.multimodal.source import WindowSource
from fuelline.server.sources.parquet import ParquetSource
from fuelline.server.sources.storage import Store

from support.processes import wait_until
from support.s3 import S3Bucket, s3, s3_server, start_moto  # noqa: F401  (fixtures)
from support.storage import SOURCES, TIMEOUT, assert_same, cached_files


# -- the store and the cache, in process ----------------------------------------------------------
def test_local_paths_and_file_uris_are_read_in_place(sample_dataset: Path, tmp_path: Path) -> None:
    for dataset in (str(sample_dataset), sample_dataset.as_uri()):
        store = Store(dataset, cache_dir=str(tmp_path / "cache"))
        assert not store.remote
        files, dirs = store.list()
        assert not files and dirs == ["train", "val"]
        mm = store.open_local("train/part-00000.parquet")
        assert mm.size() == (sample_dataset / "train" / "part-00000.parquet").stat().st_size
        store.prefetch(["train/part-00000.parquet"])  # nothing to do
    assert not (tmp_path / "cache").exists()  # no copies of local files
    a = ParquetSource(str(sample_dataset), shuffle=False)
    b = ParquetSource(sample_dataset.as_uri(), shuffle=False)
    assert_same(list(a.iter_batches("val", 0, 0, 1, 0, SOURCES)), list(b.iter_batches("val", 0, 0, 1, 0, SOURCES)))
    assert a._splits["val"].files == [str(sample_dataset / "val" / f"part-0000{i}.parquet") for i in range(4)]


def test_window_source_and_manifest_read_s3(converted: Path, s3: S3Bucket, tmp_path: Path) -> None:
    uri = s3.upload(converted, "amigos")
    assert is_converted_dataset(uri) and not is_converted_dataset(s3.uri("elsewhere"))
    assert Manifest.load(uri) == Manifest.load(str(converted))
    remote = WindowSource(uri, cache_dir=str(tmp_path / "cache"), seed=1)
    # The start-up scan read the timestamps by range; only the probe of the served columns
    # decoded a recording, from the disk cache.
    assert remote.counters["remote_fetches"] == len(Manifest.load(str(converted)).modalities)
    local = WindowSource(str(converted), seed=1)
    sources = tuple(local.sources)
    assert remote.sources == local.sources and remote.info("train")["rows"] == local.info("train")["rows"]
    assert_same(list(local.iter_batches("train", 0, 0, 1, 0, sources)), list(remote.iter_batches("train", 0, 0, 1, 0, sources)))
    remote.close()


def test_cache_counts_fetches_then_hits_and_survives_pickling(sample_dataset: Path, s3: S3Bucket, tmp_path: Path) -> None:
    uri = s3.upload(sample_dataset, "sample")
    counters: Counter = Counter()
    store = Store(uri, cache_dir=str(tmp_path / "cache"), counters=counters)
    rel = "train/part-00001.parquet"
    original = (sample_dataset / rel).read_bytes()
    assert store.open_local(rel).read() == original
    assert store.open_local(rel).read() == original
    assert counters == Counter(cache_disk_misses=1, remote_fetches=1, remote_bytes=len(original), cache_disk_hits=1)
    sidecar = json.loads((tmp_path / "cache" / dataset_key(store) / "meta" / (rel + ".json")).read_text())
    assert sidecar["size"] == len(original) and sidecar["xxh3_64"] == xxhash.xxh3_64(original).hexdigest()
    assert sidecar["mtime_ns"] == store.stat(rel).mtime_ns

    # A worker's copy (pickled) shares the disk cache, not the threads.
    copy = pickle.loads(pickle.dumps(store))
    assert copy.open_local(rel).read() == original
    assert copy.counters["cache_disk_hits"] == 2 and copy.counters["remote_fetches"] == 1
    # The footer and a column read by range fetch nothing into the cache.
    with store.open("val/part-00000.parquet") as f:
        assert pq.read_metadata(f).num_rows == 500
    assert counters["remote_fetches"] == 1


def test_a_single_remote_parquet_file_is_a_dataset(sample_dataset: Path, s3: S3Bucket, tmp_path: Path) -> None:
    s3.upload(sample_dataset / "val" / "part-00002.parquet", "one/part.parquet")
    remote = ParquetSource(s3.uri("one/part.parquet"), cache_dir=str(tmp_path / "cache"), shuffle=False)
    local = ParquetSource(str(sample_dataset / "val" / "part-00002.parquet"), shuffle=False)
    assert remote.splits == ("train",) and remote.info("train")["files"] == 1
    assert_same(list(local.iter_batches("train", 0, 0, 1, 0, SOURCES)), list(remote.iter_batches("train", 0, 0, 1, 0, SOURCES)))
    assert remote.counters["remote_fetches"] == 1


def test_a_changed_remote_object_is_fetched_again(s3: S3Bucket, tmp_path: Path) -> None:
    s3.put("blobs/a.bin", b"first version")
    cache = str(tmp_path / "cache")
    assert Store(s3.uri("blobs"), cache_dir=cache).open_local("a.bin").read() == b"first version"
    s3.put("blobs/a.bin", b"second version, longer")
    again = Store(s3.uri("blobs"), cache_dir=cache)
    assert again.open_local("a.bin").read() == b"second version, longer"
    assert again.counters["remote_fetches"] == 1 and again.counters["cache_disk_hits"] == 0


def test_corruption_is_found_on_first_use_in_a_process(s3: S3Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    payload = os.urandom(300_000)
    s3.put("blobs/b.bin", payload)
    cache = str(tmp_path / "cache")
    first = Store(s3.uri("blobs"), cache_dir=cache)
    assert first.open_local("b.bin").read() == payload
    path = first._disk().data_path("b.bin")
    with open(path, "r+b") as f:
        f.seek(1234)
        f.write(b"\0\1\2\3")
    fresh = Store(s3.uri("blobs"), cache_dir=cache)  # as a new process: checks the checksum
    with caplog.at_level(logging.WARNING, logger="fuelline.server"):
        assert fresh.open_local("b.bin").read() == payload
    assert fresh.counters["cache_disk_corrupt"] == 1 and fresh.counters["remote_fetches"] == 1
    assert any(s3.uri("blobs/b.bin") in r.getMessage() and path in r.getMessage() for r in caplog.records)
    # Truncated: caught by the size check even where the checksum was already verified.
    os.truncate(path, 10)
    assert fresh.open_local("b.bin").read() == payload
    assert fresh.counters["cache_disk_corrupt"] == 2


def test_lru_eviction_under_budget_and_a_file_bigger_than_the_budget(
    s3: S3Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for name in "abcd":
        s3.put(f"blobs/{name}.bin", bytes([ord(name)]) * 40_000)
    s3.put("blobs/huge.bin", b"h" * 150_000)
    store = Store(s3.uri("blobs"), cache_dir=str(tmp_path / "cache"), cache_mb=0.1)  # 100 kB: two files
    kept = store.open_local("a.bin")  # mapped, then evicted below: the map stays good
    store.open_local("b.bin")
    store.open_local("a.bin")  # a is now more recent than b
    store.open_local("c.bin")  # evicts b, the least recently used
    cache = store._disk()
    assert not os.path.exists(cache.data_path("b.bin")) and os.path.exists(cache.data_path("a.bin"))
    assert store.counters["cache_disk_evictions"] == 1
    with caplog.at_level(logging.WARNING, logger="fuelline.server"):
        assert store.open_local("huge.bin").read() == b"h" * 150_000
        store.open_local("huge.bin")
    assert sum("bigger than the whole --cache-mb" in r.getMessage() for r in caplog.records) == 1
    assert not os.path.exists(cache.data_path("a.bin"))  # evicted for the huge one
    assert kept.read() == b"a" * 40_000


def test_prefetch_runs_in_the_background_and_coalesces(sample_dataset: Path, s3: S3Bucket, tmp_path: Path) -> None:
    uri = s3.upload(sample_dataset, "sample")
    source = ParquetSource(uri, cache_dir=str(tmp_path / "cache"), shuffle_block=4)
    try:
        units = list(range(len(source.unit_rows("train"))))
        source.prefetch_units("train", units)
        source.prefetch_units("train", units)  # the same again, while the first are under way
        wait_until(lambda: source.counters["remote_fetches"] == 4, TIMEOUT, "four train files prefetched")
        wait_until(lambda: not source.store._inflight, TIMEOUT, "prefetch threads idle")
        assert source.counters["cache_disk_hits"] == 0  # prefetching is not a use
        list(source.iter_batches("train", 0, 0, 1, 0, SOURCES))
        assert source.counters["remote_fetches"] == 4 and source.counters["cache_disk_hits"] == len(units)
    finally:
        source.close()


FETCHER = textwrap.dedent(
    """
    import json, sys, xxhash
    from fuelline.server.sources.storage import Store
    store = Store(sys.argv[1], cache_dir=sys.argv[2])
    print("ready", flush=True)
    sys.stdin.readline()  # go
    data = store.open_local("big.bin").read()
    print(json.dumps({"counters": dict(store.counters), "xxh3": xxhash.xxh3_64(data).hexdigest()}), flush=True)
    """
)


def _line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"process {proc.pid} said nothing within {timeout}s"
    return proc.stdout.readline()


def test_two_processes_fetch_a_file_once(s3: S3Bucket, tmp_path: Path) -> None:
    payload = os.urandom(24 << 20)
    s3.put("blobs/big.bin", payload)
    script = tmp_path / "fetch.py"
    script.write_text(FETCHER)
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen([sys.executable, str(script), s3.uri("blobs"), str(cache)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert _line(p, TIMEOUT).strip() == "ready"
        for p in procs:  # both start fetching now
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(_line(p, 120.0)) for p in procs]
        for p in procs:
            assert p.wait(TIMEOUT) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert all(r["xxh3"] == xxhash.xxh3_64(payload).hexdigest() for r in results)
    assert sum(r["counters"].get("remote_fetches", 0) for r in results) == 1
    assert sorted(r["counters"].get("cache_disk_hits", 0) for r in results) == [0, 1]
    assert [p.name for p in cached_files(cache)] == ["big.bin"]
    assert not list(cache.glob("*/data/*.tmp-*"))


def test_paths_outside_the_dataset_are_refused(s3: S3Bucket, tmp_path: Path) -> None:
    store = Store(s3.uri("blobs"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="not a path inside the dataset"):
        store.open_local("../other/x.bin")
    with pytest.raises(DataError, match="no such file"):
        store.open_local("missing.bin")
