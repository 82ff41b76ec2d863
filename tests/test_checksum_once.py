"""Checksums taken where a batch's bytes are read anyway: a Fuel stream's shared pass digests each
array once, and the batch is sent with those digests as its checksums. What the client checks is
then the bytes the stream yielded, and a frame changed on the way is still caught."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest
import xxhash
import zmq

from fuelline.protocol import Batch, ChecksumMismatch, Credit, Hello, decode, encode
from fuelline.protocol.arrays import Checksummed, wire_array
from fuelline.server.serving.server import Server
from fuelline.server.sources.fuel import FuelStreamSource

from support.wire_edits import header_of


class Counting:
    """A deterministic Fuel-style stream of two sources."""

    sources = ("x", "label")

    def get_epoch_iterator(self, **kwargs: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for i in range(6):
            yield np.arange(i, i + 3000, dtype="<f4").reshape(30, 100), np.full(30, i, dtype="<i8")


def first_batch(source: FuelStreamSource, sources: tuple[str, ...] = ("x", "label")) -> dict[str, np.ndarray]:
    batches = source.iter_batches("train", 0, 0, 1, 0, sources)
    try:
        return next(batches)
    finally:
        batches.close()


def test_a_batch_is_sent_with_the_checksums_of_the_bytes_the_stream_yielded() -> None:
    source = FuelStreamSource(Counting())
    try:
        arrays = first_batch(source)
        arrays["x"][0, 0] = -1.0  # changed after the stream yielded it, before it is encoded
        frames = encode(Batch(0, 0, 0, arrays))
    finally:
        source.close()
    # The checksum is the one taken when the batch was read, so the change is caught on arrival
    # rather than delivered as if it were the stream's.
    with pytest.raises(ChecksumMismatch, match="'x'"):
        decode(frames)


def test_the_checksums_a_batch_is_sent_with_are_those_of_its_bytes() -> None:
    source = FuelStreamSource(Counting())
    try:
        arrays = first_batch(source, ("label", "x"))
    finally:
        source.close()
    assert isinstance(arrays, Checksummed) and list(arrays) == ["label", "x"]
    frames = encode(Batch(0, 0, 0, arrays))
    entries = header_of(frames)["a"]
    assert [e[0] for e in entries] == ["label", "x"]
    assert [e[4] for e in entries] == [xxhash.xxh3_64_intdigest(bytes(memoryview(f))) for f in frames[1:]]
    got = decode(frames)
    assert np.array_equal(got.arrays["x"], np.arange(3000, dtype="<f4").reshape(30, 100))


@pytest.mark.parametrize("how", ["big-endian", "strided"])
def test_a_known_checksum_is_not_used_for_an_array_that_is_copied_on_its_way(how: str) -> None:
    """A copy's bytes may differ from the array's (a byte swap): they are read for its checksum."""
    base = np.arange(24, dtype="<f4").reshape(4, 6)
    value = base.astype(">f4") if how == "big-endian" else base[:, ::2]
    meta, flat = wire_array("x", value, with_checksum=True, known=12345)
    assert meta.checksum == xxhash.xxh3_64_intdigest(flat.tobytes()) != 12345
    frames = encode(Batch(0, 0, 0, Checksummed({"x": value}, {"x": 12345})))
    assert np.array_equal(decode(frames).arrays["x"], value)


def test_a_frame_changed_on_the_wire_from_a_served_fuel_stream_is_caught(zmq_context: zmq.Context) -> None:
    source = FuelStreamSource(Counting())
    server = Server(source, port=0, hwm=4, heartbeat=5.0)
    endpoint = server.start()
    sock = zmq_context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(encode(Hello("fuel-0", sources=("x", "label"), credit=2, heartbeat=5.0)))
        received: list[list[bytes]] = []
        while len(received) < 2:
            assert sock.poll(10_000), "no batch from the server within 10 s"
            frames = sock.recv_multipart()
            if header_of(frames)["t"] == "batch":
                received.append(frames)
                sock.send_multipart(encode(Credit(1)))
        for seq, frames in enumerate(received):
            assert decode(frames).arrays["label"][0] == seq  # as sent, it checks out
            x = bytearray(frames[1])
            x[1234] ^= 0x01
            with pytest.raises(ChecksumMismatch, match="'x'"):
                decode([frames[0], bytes(x), frames[2]])
    finally:
        sock.close(linger=0)
        server.stop()
        server.join(10)
        source.close()
