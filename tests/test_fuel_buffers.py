"""A Fuel-style stream that refills one preallocated buffer per batch is served as it yielded each
batch: the server copies a batch when it reads it, so read-ahead, the shared pass, checksums and
zero-copy sends use bytes the stream can no longer overwrite. A stream that yields fresh arrays
may skip that copy (``fresh_arrays=True``)."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.server.sources.fuel import FuelStreamSource
from fuelline.server.sources.fuel_epochs import batch_digest

TIMEOUT = 30.0
BATCHES = 50
ROWS = 1024

# Values tell the call of get_epoch_iterator() and the step apart: a batch read again from a second
# call (rather than from the one shared pass) carries other values than the first call yielded.
STREAMS = """
import numpy as np
from fuelline.server import start_server

ROWS = {rows}

class Reusing:
    sources = ("x", "y")

    def __init__(self, batches):
        self.batches = batches
        self.calls = 0
        self.x = np.zeros((ROWS, 256), np.float32)
        self.y = np.zeros(ROWS, np.int64)

    def get_epoch_iterator(self, **kwargs):
        self.calls += 1
        for i in range(self.batches):
            self.x[:] = 1000 * self.calls + i
            self.y[:] = np.arange(ROWS) + 1000 * self.calls + i
            yield (self.x, self.y)

class SameEveryCall(Reusing):  # deterministic: a second call yields what the first did
    def get_epoch_iterator(self, **kwargs):
        self.calls = 0
        return super().get_epoch_iterator(**kwargs)

class Fresh(Reusing):
    def get_epoch_iterator(self, **kwargs):
        for x, y in super().get_epoch_iterator(**kwargs):
            yield (x.copy(), y.copy())

start_server({stream}, port=0, hwm=4{options})
"""


def serve(start_script, stream: str = f"Reusing({BATCHES})", options: str = ""):
    return start_script(STREAMS.format(rows=ROWS, stream=stream, options=options))


def assert_exactly_as_yielded(batches: list[tuple[np.ndarray, ...]], steps: list[int], call: int = 1) -> None:
    assert len(batches) == len(steps)
    for (x, y), i in zip(batches, steps):
        value = 1000 * call + i
        assert x.shape == (ROWS, 256) and np.all(x == value), f"step {i}: x holds {np.unique(x)[:5]}, not {value}"
        assert np.array_equal(y, np.arange(ROWS) + value), f"step {i}: y is not the stream's"


def read_epoch(port: int, local: bool, **kwargs: Any) -> list[tuple[np.ndarray, ...]]:
    with ServerDataStream(("x", "y"), port=port, host="127.0.0.1", hwm=4, timeout=TIMEOUT,
                          receive_timeout=TIMEOUT, local=local, **kwargs) as s:
        batches = list(s.get_epoch_iterator())
        where = s.transports[0]
    assert where.startswith("ipc://") == local, f"read through {where}"
    return batches


@pytest.mark.parametrize("local", [True, False], ids=["local-ipc", "tcp"])
def test_a_stream_that_reuses_its_buffers_is_served_as_it_yielded(start_script, local: bool) -> None:
    server = serve(start_script)
    assert_exactly_as_yielded(read_epoch(server.port, local), list(range(BATCHES)))


def test_without_checksums_a_reused_buffer_is_not_served_overwritten(start_script) -> None:
    """With nothing to catch it on arrival, a batch overwritten in the server would be wrong data."""
    server = serve(start_script, options=", checksum=False")
    assert_exactly_as_yielded(read_epoch(server.port, False, verify=False), list(range(BATCHES)))


@pytest.mark.parametrize("local", [True, False], ids=["local-ipc", "tcp"])
def test_a_rank_reading_later_gets_the_shared_pass_as_yielded(start_script, local: bool) -> None:
    server = serve(start_script)
    first = read_epoch(server.port, local, rank=0, world_size=2)
    later = read_epoch(server.port, local, rank=1, world_size=2)  # from the batches the pass holds
    assert_exactly_as_yielded(first, list(range(0, BATCHES, 2)))
    assert_exactly_as_yielded(later, list(range(1, BATCHES, 2)))  # call 1: not a second pass


def test_a_rank_that_reads_the_stream_again_gets_it_as_yielded(start_script) -> None:
    """Nothing held (buffer_mb=0): the later rank's batches come from a second pass of its own."""
    server = serve(start_script, stream=f"SameEveryCall({BATCHES})", options=", buffer_mb=0")
    first = read_epoch(server.port, False, rank=0, world_size=2)
    later = read_epoch(server.port, False, rank=1, world_size=2)
    assert_exactly_as_yielded(first, list(range(0, BATCHES, 2)))
    assert_exactly_as_yielded(later, list(range(1, BATCHES, 2)))


def test_a_stream_of_fresh_arrays_is_served_without_the_copy(start_script) -> None:
    server = serve(start_script, stream=f"Fresh({BATCHES})", options=", fresh_arrays=True")
    first = read_epoch(server.port, False, rank=0, world_size=2)
    later = read_epoch(server.port, True, rank=1, world_size=2)
    assert_exactly_as_yielded(first, list(range(0, BATCHES, 2)))
    assert_exactly_as_yielded(later, list(range(1, BATCHES, 2)))


# -- in the server's process: what is copied, and what is not -----------------------------------
class Kept:
    """Keeps every array it yields, so the test can tell whether a served batch is one of them."""

    sources = ("x",)

    def __init__(self, reuse: bool) -> None:
        self.reuse = reuse
        self.buffer = np.zeros((64, 100), np.float32)
        self.yielded: list[np.ndarray] = []

    def get_epoch_iterator(self, **kwargs: Any) -> Iterator[tuple[np.ndarray]]:
        for i in range(6):
            array = self.buffer if self.reuse else np.empty((64, 100), np.float32)
            array[:] = i
            self.yielded.append(array)
            yield (array,)


def served(source: FuelStreamSource) -> list[np.ndarray]:
    batches = source.iter_batches("train", 0, 0, 1, 0, ("x",))
    try:
        return [b["x"] for b in batches]
    finally:
        batches.close()


def test_by_default_a_batch_is_the_servers_own_copy() -> None:
    stream = Kept(reuse=True)
    source = FuelStreamSource(stream)
    try:
        got = served(source)
        copied = source.buffer_stats["copied"]
    finally:
        source.close()
    assert [float(x[0, 0]) for x in got] == [0, 1, 2, 3, 4, 5] and all(np.all(x == x[0, 0]) for x in got)
    assert not any(np.shares_memory(x, stream.buffer) for x in got)
    assert copied == 6 * stream.buffer.nbytes


def test_fresh_arrays_are_served_from_the_streams_own_memory() -> None:
    stream = Kept(reuse=False)
    source = FuelStreamSource(stream, fresh_arrays=True)
    try:
        got = served(source)
        copied = source.buffer_stats["copied"]
    finally:
        source.close()
    assert len(got) == 6 and all(np.shares_memory(x, y) for x, y in zip(got, stream.yielded))
    assert copied == 0


def test_fresh_arrays_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="fresh_arrays"):
        FuelStreamSource(Kept(reuse=False), fresh_arrays="yes")


ODD = {
    "empty": np.zeros((0, 7), np.float32),
    "scalar": np.array(3.5),
    "bool": np.arange(999) % 3 == 0,
    "strided": np.arange(400_000, dtype=np.int64).reshape(800, 500)[:, ::3],
    "big-endian": np.arange(70_001, dtype=">f8"),
    "large": np.random.default_rng(0).random((300, 3001), dtype=np.float32),  # in 64 KiB blocks: many, a ragged last
}


@pytest.mark.parametrize("block", [None, 64 * 1024], ids=["default-blocks", "64KiB-blocks"])
@pytest.mark.parametrize("name", list(ODD))
def test_a_copied_batch_has_the_digest_and_checksums_of_the_batch(name: str, block: int | None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is checksummed as it is made; those checksums must be the ones of its bytes,
    whether an array is copied in one block or in many (a ragged last one among them)."""
    from fuelline.protocol import arrays
    from fuelline.protocol.arrays import checksum, copy_with_checksum

    if block is not None:
        monkeypatch.setattr(arrays, "COPY_BLOCK", block)
    value = ODD[name]
    copy, check = copy_with_checksum(value)
    assert copy.flags.c_contiguous and copy.dtype == value.dtype and np.array_equal(copy, value)
    assert not np.shares_memory(copy, value)
    assert check == checksum(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
    # The shared pass's digest of the copy, with the checksums taken as it was made, is the batch's.
    digest, arrays = batch_digest({"x": copy}, {"x": check})
    assert digest == batch_digest({"x": value})[0] and arrays.checksums == {"x": check}
