"""Sixteen clients at once against one server: each gets its exact share, none starves, and the
server's memory stays within what flow control promises (DESIGN.md, Sharding and Flow control).

Run with ``pytest -s`` to see the per-client throughput spread; speed is reported, never asserted
(two shared cores make it a measure of the box, not of the server).
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from fuelline.client import ServerDataStream
from fuelline.server.sources.parquet import ParquetSource
from fuelline.server.sources.sample import expected_features

from support.processes import RssSampler

WORLD = 16
BATCH = 64
HWM = 4
ROWS = 8000  # train rows of the sample_dataset fixture, sample_id 0..7999
DIM = 8  # its features per row
ROW_BYTES = 8 + 4 * DIM + 8 + 4  # sample_id int64, features float32[8], label int64, weight float32




class RankReader(threading.Thread):
    """One DDP rank's reader: connects, waits for the others, then reads one epoch and times it."""

    def __init__(self, endpoint: str, rank: int, start_together: threading.Barrier) -> None:
        super().__init__(name=f"rank-{rank}", daemon=True)
        self.endpoint = endpoint
        self.rank = rank
        self.start_together = start_together
        self.batches: list[dict[str, np.ndarray]] = []
        self.announced: int | None = None
        self.seconds = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with ServerDataStream(
                endpoints=[self.endpoint], rank=self.rank, world_size=WORLD, hwm=HWM,
                timeout=20.0, receive_timeout=20.0,
            ) as stream:
                self.announced = stream.batches_per_epoch  # connected and welcomed before the clock starts
                self.start_together.wait()
                start = time.perf_counter()
                for batch in stream.get_epoch_iterator(as_dict=True):
                    self.batches.append(batch)
                self.seconds = time.perf_counter() - start
        except BaseException as exc:  # handed to the test's thread, which asserts on it
            self.error = exc
            self.start_together.abort()  # the others must not wait for a rank that is gone

    @property
    def ids(self) -> np.ndarray:
        return np.concatenate([b["sample_id"] for b in self.batches])

    @property
    def rows_per_s(self) -> float:
        return len(self.ids) / self.seconds if self.seconds else 0.0


@pytest.mark.timeout(90)
def test_sixteen_ranks_at_once_get_exact_disjoint_shares_in_bounded_memory(
    sample_dataset: Path, start_serve
) -> None:
    server = start_serve(sample_dataset, "--batch-size", str(BATCH), "--hwm", str(HWM))
    rss = RssSampler(server.proc.pid)
    start_together = threading.Barrier(WORLD, timeout=30.0)
    readers = [RankReader(server.endpoint, rank, start_together) for rank in range(WORLD)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 60.0
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    rss_peak = rss.stop()

    assert all(not r.is_alive() for r in readers), (
        f"ranks {[r.rank for r in readers if r.is_alive()]} did not finish their epoch in 60s: starved"
    )
    errors = {r.rank: r.error for r in readers if r.error is not None}
    assert not errors, f"ranks failed: {errors}"
    assert server.proc.poll() is None, f"the server died:\n{server.log()[-3000:]}"

    # Sharding: equal batch counts, as announced; every row once, padding the only duplication.
    per_rank = -(-ROWS // WORLD)
    expected_batches = -(-per_rank // BATCH)
    counts = {r.rank: len(r.batches) for r in readers}
    assert set(counts.values()) == {expected_batches}, f"batches per rank: {counts}"
    assert all(r.announced == expected_batches for r in readers)
    assert all(len(r.ids) == per_rank for r in readers)
    everything = np.concatenate([r.ids for r in readers])
    assert np.array_equal(np.unique(everything), np.arange(ROWS)), "some sample_id never arrived"
    assert len(everything) - ROWS == WORLD * per_rank - ROWS, "rows repeated beyond the wrap-around padding"
    if WORLD * per_rank == ROWS:
        shares = [set(r.ids.tolist()) for r in readers]
        assert sum(len(s) for s in shares) == len(set().union(*shares)) == ROWS, "shares overlap"

    # Correct values, not only the right ids: features are a function of sample_id, labels on disk.
    table = pq.read_table(sample_dataset / "train", columns=["sample_id", "label"])
    labels = dict(zip(table["sample_id"].to_pylist(), table["label"].to_pylist()))
    for reader in readers:
        for b in reader.batches:
            assert np.array_equal(b["features"], expected_features(b["sample_id"], DIM))
            assert b["label"].tolist() == [labels[i] for i in b["sample_id"].tolist()]

    # Throughput spread: reported, not asserted; a starved rank would show as a zero here.
    speeds = sorted(r.rows_per_s for r in readers)
    print(
        f"\n{WORLD} ranks, {per_rank} rows each in batches of {BATCH}, hwm {HWM}: rows/s per rank "
        f"min {speeds[0]:,.0f}, median {statistics.median(speeds):,.0f}, max {speeds[-1]:,.0f}; "
        f"epoch seconds {min(r.seconds for r in readers):.3f}..{max(r.seconds for r in readers):.3f}"
    )
    assert speeds[0] > 0, "a rank received nothing"

    # Memory: each session holds at most hwm batches prepared and hwm in flight (2 × hwm × batch
    # bytes) plus its reader's decoded row groups (memory_per_client, which the server also logs),
    # so the server stays under
    #     baseline + clients × (2 × hwm × batch × row bytes + memory_per_client) + 64 MB
    # where 64 MB is the slack for per-thread allocator arenas and stacks of 16 producer threads.
    batch_bytes = BATCH * ROW_BYTES
    reader_bytes = ParquetSource(str(sample_dataset), batch_size=BATCH).memory_per_client("train")
    bound = WORLD * (2 * HWM * batch_bytes + reader_bytes) / 2**20 + 64
    print(
        f"server RSS: {rss.baseline:.0f} MB before, {rss_peak:.0f} MB peak (+{rss_peak - rss.baseline:.0f} MB; "
        f"bound +{bound:.0f} MB = {WORLD} x (2 x {HWM} x {batch_bytes} B + {reader_bytes / 1e6:.2f} MB) + 64 MB)"
    )
    assert rss_peak - rss.baseline < bound, f"server RSS rose {rss_peak - rss.baseline:.0f} MB, over +{bound:.0f} MB"
