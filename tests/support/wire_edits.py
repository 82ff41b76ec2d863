"""Bad wire messages made from valid ones: a valid message encoded, its header unpacked, edited
and repacked with msgpack, so a test changes exactly one thing; ``expect`` checks the exact
ProtocolError subclass that decoding raises."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from fuelline.protocol import (
    Batch,
    Bye,
    Credit,
    EndOfEpoch,
    Error,
    Heartbeat,
    Hello,
    ProtocolError,
    Welcome,
    decode,
    encode,
)

__all__ = [
    "CHECK", "CONTROL", "DROP", "DTYPE", "HELLO", "NAME", "NBYTES", "SHAPE", "WELCOME", "batch_frames", "edited",
    "edited_entry", "expect", "frames_of", "header_of", "with_header",
]

DROP = object()  # as an edit: remove the key
NAME, DTYPE, SHAPE, NBYTES, CHECK = range(5)  # fields of a batch header's array entry

HELLO = Hello("c", rank=1, world_size=2, sources=("x", "y"))
WELCOME = Welcome("s", 0, ("x",), {"x": {"dtype": "<f4", "shape": [2]}}, 10, 1.0)
CONTROL = [HELLO, WELCOME, Credit(3), EndOfEpoch(0, 1, 2), Heartbeat(), Error("bad-request", "no"), Bye("x")]


def frames_of(msg, **kw) -> list[bytes]:
    return [bytes(memoryview(f)) for f in encode(msg, **kw)]


def batch_frames(checksum: bool = True) -> list[bytes]:
    """x: 24 bytes of float32 (2, 3); y: 3 bytes of bool."""
    arrays = {"x": np.arange(6, dtype="<f4").reshape(2, 3), "y": np.array([True, False, True])}
    return frames_of(Batch(1, 2, 3, arrays), checksum=checksum)


def header_of(frames) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def with_header(frames, header: dict) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def edited(frames, **changes) -> list[bytes]:
    header = header_of(frames)
    for key, value in changes.items():
        if value is DROP:
            del header[key]
        else:
            header[key] = value
    return with_header(frames, header)


def edited_entry(frames, index: int, field: int, value) -> list[bytes]:
    header = header_of(frames)
    header["a"][index][field] = value
    return with_header(frames, header)


def expect(exc_type: type, frames, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames, **kw)
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    return info.value
