"""Remote datasets (S3 on a real moto server) and the disk cache tier.

Served batches of an S3 dataset must be byte-identical to those of the same local dataset, cold
(fetching into --cache-dir) and warm (a second server on the same cache, fetching nothing), over
budget (evicting), and after a cached copy was corrupted (detected, reported, fetched again).
"""

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

import numpy as np
import pyarrow.parquet as pq
import pytest
import xxhash

from fuelline.client import ServerDataStream
from fuelline.protocol import DataError
from fuelline.server.cache.disk import dataset_key
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.server.multimodal.manifest import Manifest, is_converted_dataset
from fuelline.server.multimodal.source import WindowSource
from fuelline.server.sources.parquet import ParquetSource
from fuelline.server.sources.sample import write_sample_dataset
from fuelline.server.sources.storage import Store

from support.processes import wait_until
from support.s3 import S3Bucket, s3, s3_server, start_moto  # noqa: F401  (fixtures)

TIMEOUT = 30.0
SOURCES = ("sample_id", "features", "label", "weight")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("remote-windows")
    synthesize(str(root / "raw"), 12, 10.0, 5, video_dim=4, drop=0.01, jitter_ms=0.3)
    convert(str(root / "raw"), str(root / "data"), val_fraction=0.3, seed=0, progress=False)
    return root / "data"


@pytest.fixture(scope="module")
def bigger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Train files of about 0.5 MB each: a 1 MB cache holds only one or two of them."""
    out = tmp_path_factory.mktemp("remote-big") / "sample"
    write_sample_dataset(str(out), rows=30_000, dim=24, files=4, row_group_rows=2_500)
    return out


def read_split(endpoint: str, split: str = "train", epochs: int = 1) -> list[dict[str, np.ndarray]]:
    with ServerDataStream(endpoints=[endpoint], split=split, timeout=TIMEOUT) as s:
        return [b for _ in range(epochs) for b in s.get_epoch_iterator(as_dict=True)]


def storage_counters(endpoint: str) -> dict[str, int]:
    """The disk-cache counters of a server, as its welcome to a new client tells them."""
    with ServerDataStream(endpoints=[endpoint], timeout=TIMEOUT) as s:
        return dict(s.info["storage"]["counters"])


def assert_same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
            assert x[k].tobytes() == y[k].tobytes(), k


def _total(dataset: Path) -> int:
    return sum(p.stat().st_size for p in dataset.rglob("*.parquet"))


def cached_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob("*/data/**/*") if p.is_file())


def cached_bytes(cache: Path) -> int:
    """Bytes of the copies in ``cache`` now. A server still serving may finish or drop a fetch
    between the listing and the stat: such a file is no longer held."""
    total = 0
    for path in cached_files(cache):
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass
    return total


# -- serving ------------------------------------------------------------------------------------
def test_converted_dataset_from_s3_is_served_as_from_disk_cold_then_warm(
    converted: Path, s3: S3Bucket, start_serve, tmp_path: Path
) -> None:
    uri = s3.upload(converted, "amigos")
    cache = tmp_path / "cache"
    local = start_serve(converted, "--batch-size", "16", "--seed", "2")
    cold = start_serve(uri, "--batch-size", "16", "--seed", "2", "--cache-dir", str(cache), "--prefetch", "2")
    for split in ("train", "val"):
        assert_same(read_split(local.endpoint, split, epochs=2), read_split(cold.endpoint, split, epochs=2))
    counters = storage_counters(cold.endpoint)
    files = len({p.file for r in Manifest.load(str(converted)).recordings for p in r.modalities.values()})
    assert counters["remote_fetches"] == counters["cache_disk_misses"] == files
    assert counters["remote_bytes"] == sum(p.stat().st_size for p in converted.rglob("*.parquet"))
    assert counters["cache_disk_corrupt"] == counters["cache_disk_evictions"] == 0
    cold.terminate()

    warm = start_serve(uri, "--batch-size", "16", "--seed", "2", "--cache-dir", str(cache))
    assert_same(read_split(local.endpoint, "train"), read_split(warm.endpoint, "train"))
    counters = storage_counters(warm.endpoint)
    assert counters["remote_fetches"] == counters["remote_bytes"] == counters["cache_disk_misses"] == 0
    assert counters["cache_disk_hits"] > 0


def test_parquet_dataset_from_s3_with_the_endpoint_in_the_uri(
    sample_dataset: Path, s3: S3Bucket, start_serve, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3.upload(sample_dataset, "sample")
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # only the URI says where the server is
    uri = s3.uri("sample", query=True)
    local = start_serve(sample_dataset, "--batch-size", "100")
    remote = start_serve(uri, "--batch-size", "100", "--cache-dir", str(tmp_path / "cache"), "--workers", "0")
    for split in ("train", "val"):
        assert_same(read_split(local.endpoint, split), read_split(remote.endpoint, split))
    with ServerDataStream(endpoints=[remote.endpoint], timeout=TIMEOUT) as s:
        storage = s.info["storage"]
    assert storage["dataset"] == s3.uri("sample") and "endpoint_override" not in json.dumps(storage)
    assert storage["counters"]["remote_fetches"] == 8


def test_worker_processes_share_the_disk_cache(sample_dataset: Path, s3: S3Bucket, start_serve, tmp_path: Path) -> None:
    uri = s3.upload(sample_dataset, "sample")
    local = start_serve(sample_dataset, "--batch-size", "100")
    remote = start_serve(uri, "--batch-size", "100", "--cache-dir", str(tmp_path / "cache"), "--workers", "2", "--prefetch", "2")
    for split in ("train", "val"):
        assert_same(read_split(local.endpoint, split, epochs=2), read_split(remote.endpoint, split, epochs=2))
    counters = storage_counters(remote.endpoint)
    # The serving process prefetches, the workers decode: each file crossed the network once (at
    # most: the workers' counts are merged on another thread than the prefetchers' counts).
    assert 0 < counters["remote_fetches"] <= 8 and counters["remote_bytes"] <= _total(sample_dataset), counters
    assert len(cached_files(tmp_path / "cache")) == 8 and counters["cache_disk_hits"] > 0


def test_over_budget_evicts_and_serves_the_same(bigger: Path, s3: S3Bucket, start_serve, tmp_path: Path) -> None:
    uri = s3.upload(bigger, "big")
    cache = tmp_path / "cache"
    local = start_serve(bigger, "--batch-size", "500", "--shuffle-block", "2")
    remote = start_serve(uri, "--batch-size", "500", "--shuffle-block", "2", "--cache-dir", str(cache), "--cache-mb", "1")
    assert_same(read_split(local.endpoint, epochs=2), read_split(remote.endpoint, epochs=2))
    counters = storage_counters(remote.endpoint)
    assert counters["cache_disk_evictions"] > 0, counters
    assert counters["remote_fetches"] > 4  # train files were fetched again after being evicted
    # Copies in use while a trim runs are kept, so the cache may hold a few over budget for a
    # while, never the whole split (the exact budget is checked in process, below).
    train = sum(p.stat().st_size for p in (bigger / "train").glob("*.parquet"))
    assert cached_bytes(cache) < train


def test_a_corrupt_cached_copy_is_reported_and_fetched_again(
    sample_dataset: Path, s3: S3Bucket, start_serve, tmp_path: Path
) -> None:
    uri = s3.upload(sample_dataset, "sample")
    cache = tmp_path / "cache"
    first = start_serve(uri, "--batch-size", "100", "--cache-dir", str(cache))
    expected = read_split(first.endpoint, "val")
    first.terminate()
    victim = next(p for p in cached_files(cache) if p.parent.name == "val")
    data = bytearray(victim.read_bytes())
    data[100:108] = bytes(b ^ 0xFF for b in data[100:108])  # same size, other bytes
    victim.write_bytes(bytes(data))

    second = start_serve(uri, "--batch-size", "100", "--cache-dir", str(cache))
    assert_same(expected, read_split(second.endpoint, "val"))
    text = second.wait_log(r"WARNING .*corrupt", timeout=10.0)
    assert f"{uri}/val/{victim.name}" in text
    counters = storage_counters(second.endpoint)
    assert counters["cache_disk_corrupt"] == 1 and counters["remote_fetches"] == 1


def test_inspect_reads_an_s3_dataset(converted: Path, s3: S3Bucket, tmp_path: Path) -> None:
    uri = s3.upload(converted, "amigos")

    def inspect(dataset: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "fuelline.server.cli", "inspect", dataset, "--json", "--cache-dir", str(tmp_path / "c")],
            capture_output=True, text=True, timeout=60, check=True,
        )
        return json.loads(out.stdout)

    local, remote = inspect(str(converted)), inspect(uri)
    assert remote.pop("dataset") == uri and local.pop("dataset") == str(converted)
    assert remote == local


# -- errors -------------------------------------------------------------------------------------
def serve_error(dataset: str, tmp_path: Path, timeout: float = 60.0) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", "serve", dataset, "--port", "0", "--cache-dir", str(tmp_path / "c")],
        capture_output=True, text=True, timeout=timeout,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    return out.stderr


def test_bad_uris_fail_with_a_message_naming_them(s3: S3Bucket, tmp_path: Path) -> None:
    err = serve_error("s3://no-such-bucket-here/data", tmp_path)
    assert "s3://no-such-bucket-here/data" in err and "bucket 'no-such-bucket-here' does not exist" in err
    err = serve_error(s3.uri("nothing/here"), tmp_path)
    assert f"{s3.uri('nothing/here')}' does not exist" in err
    err = serve_error("nosuchscheme://bucket/data", tmp_path)
    assert "nosuchscheme://bucket/data" in err and "cannot open its filesystem" in err
    # Credentials in a URI are never shown.
    err = serve_error(f"s3://AKEY:ASECRET@{s3.name}/nothing?endpoint_override={s3.server.endpoint}&scheme=http", tmp_path)
    assert "ASECRET" not in err and f"s3://{s3.name}/nothing" in err


def test_bad_credentials_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    strict = start_moto(tmp_path / "moto-strict.log", {"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # checks keys
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-key")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-secret")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{strict.endpoint}")
        err = serve_error("s3://bucket/data", tmp_path)
        assert "s3://bucket/data/manifest.json" in err and "ACCESS_DENIED" in err
    finally:
        strict.proc.kill()
        strict.proc.wait(10)


def test_an_unreachable_endpoint_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    err = serve_error("s3://bucket/data?endpoint_override=127.0.0.1:1&scheme=http&region=us-east-1", tmp_path)
    assert "s3://bucket/data/manifest.json" in err and "connect" in err.lower()


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
