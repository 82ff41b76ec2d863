"""Serving remote datasets (S3 on a real moto server) through the disk cache tier.

Served batches of an S3 dataset must be byte-identical to those of the same local dataset, cold
(fetching into --cache-dir) and warm (a second server on the same cache, fetching nothing), over
budget (evicting), and after a cached copy was corrupted (detected, reported, fetched again). Bad
URIs, credentials and endpoints fail ``fuelline serve`` with a message naming them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.server.multimodal.manifest import Manifest
from fuelline.server.sources.sample import write_sample_dataset

from support.s3 import S3Bucket, s3, s3_server, start_moto  # noqa: F401  (fixtures)
from support.storage import TIMEOUT, assert_same, cached_files


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


def _total(dataset: Path) -> int:
    return sum(p.stat().st_size for p in dataset.rglob("*.parquet"))


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
    # Windows at a 1 s hop are cut from the z-scored grids: those files are fetched whole, once
    # each (the start-up scan reads only the Parquet shards' timestamps, by range).
    files = {p.zgrid_file for r in Manifest.load(str(converted)).recordings for p in r.modalities.values()}
    assert counters["remote_fetches"] == counters["cache_disk_misses"] == len(files)
    assert counters["remote_bytes"] == sum((converted / f).stat().st_size for f in files)
    assert counters["cache_disk_corrupt"] == counters["cache_disk_evictions"] == 0
    cold.terminate()

    warm = start_serve(uri, "--batch-size", "16", "--seed", "2", "--cache-dir", str(cache))
    assert_same(read_split(local.endpoint, "train"), read_split(warm.endpoint, "train"))
    counters = storage_counters(warm.endpoint)
    assert counters["remote_fetches"] == counters["remote_bytes"] == counters["cache_disk_misses"] == 0
    assert counters["cache_disk_hits"] > 0


def test_a_remote_datasets_grid_files_are_opened_once_not_per_recording(
    converted: Path, s3: S3Bucket, tmp_path: Path
) -> None:
    """Each open of a disk-cache copy maps it afresh, and a fresh map faults in every page a window
    touches: a remote grid file is opened once, then its map is kept (a bounded number of them)."""
    from fuelline.server.multimodal.source import REMOTE_GRID_FILES, WindowSource

    src = WindowSource(s3.upload(converted, "amigos"), decoded_cache_mb=0, cache_dir=str(tmp_path / "cache"))
    files = {p.zgrid_file for _, r in src._splits["train"].recordings for p in r.modalities.values()}
    opened = []
    for epoch in range(3):
        for _ in src.iter_batches("train", epoch, 0, 1, 0, src.sources):
            pass
        counts = src.counters.snapshot()
        opened.append(counts.get("cache_disk_hits", 0) + counts.get("cache_disk_misses", 0))
    assert opened[0] == opened[1] == opened[2] == len(files) <= REMOTE_GRID_FILES, (opened, len(files))
    src.close()


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
