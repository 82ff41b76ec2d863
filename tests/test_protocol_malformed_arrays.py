"""Malformed batch arrays end in a typed ProtocolError: bad entries, dtypes, shapes and sizes, frames
that disagree with their header, size limits, and bad checksums and bool frames.

Each bad message is made from a valid encoded one, its header unpacked, edited and repacked with
msgpack (support.wire_edits), so a test changes exactly one thing. ``expect`` checks the exact
class: a missing field reported as a version error would be a bug, too.
"""

from __future__ import annotations

import tracemalloc

import pytest
import xxhash

from fuelline.protocol import ChecksumMismatch, Limits, MessageTooLarge, ProtocolError, decode

from support.wire_edits import (
    CHECK,
    DROP,
    DTYPE,
    NAME,
    NBYTES,
    SHAPE,
    batch_frames,
    edited,
    edited_entry,
    expect,
    header_of,
    with_header,
)

# --- array entries --------------------------------------------------------------------------

@pytest.mark.parametrize(
    "dtype", ["|O", "<M8[ns]", "V8", ">i4", "<c8", "<U1", "float32", "", None, 5, ["<f4"], {"<f4": 1}], ids=repr
)
def test_unknown_dtype(dtype):
    expect(ProtocolError, edited_entry(batch_frames(), 0, DTYPE, dtype))


@pytest.mark.parametrize(
    "shape", [[-1, -6], [2.0, 3], ["2", 3], [True, 3], [2, [3]], [None], "6", 6, None, {"0": 6}], ids=repr
)
def test_bad_shape(shape):
    expect(ProtocolError, edited_entry(batch_frames(), 0, SHAPE, shape))


def test_too_many_dims():
    frames = edited_entry(batch_frames(), 0, SHAPE, [6] + [1] * 32)  # 33 dims, right byte count
    expect(ProtocolError, frames)
    assert decode(edited_entry(batch_frames(), 0, SHAPE, [6] + [1] * 31)).arrays["x"].ndim == 32
    expect(ProtocolError, batch_frames(), limits=Limits(max_ndim=1))


@pytest.mark.parametrize("entry", ["x", None, ["x", "<f4", [2, 3], 24], ["x", "<f4", [2, 3], 24, None, 0]], ids=repr)
def test_entry_not_five_fields(entry):
    header = header_of(batch_frames())
    header["a"][0] = entry
    expect(ProtocolError, with_header(batch_frames(), header))


@pytest.mark.parametrize("name", ["", 5, None, b"x", ["x"]], ids=repr)
def test_bad_array_name(name):
    expect(ProtocolError, edited_entry(batch_frames(), 0, NAME, name))


@pytest.mark.parametrize("nbytes", [25, 23, 0, -24, 24.0, "24", None, [24]], ids=repr)
def test_nbytes_disagrees_with_dtype_and_shape(nbytes):
    expect(ProtocolError, edited_entry(batch_frames(), 0, NBYTES, nbytes))


def test_nbytes_bool_is_not_an_int():
    frames = edited_entry(edited_entry(batch_frames()[:2] + [b"\x01"], 1, SHAPE, [1]), 1, CHECK, None)
    assert decode(edited_entry(frames, 1, NBYTES, 1)).arrays["y"].tolist() == [True]
    expect(ProtocolError, edited_entry(frames, 1, NBYTES, True))  # True == 1, but is no byte count


@pytest.mark.parametrize("cut", [lambda f: f[:-1], lambda f: f + b"\x00", lambda f: b""], ids=["short", "long", "empty"])
def test_frame_length_disagrees_with_nbytes(cut):
    frames = batch_frames()
    expect(ProtocolError, [frames[0], cut(frames[1]), frames[2]])


@pytest.mark.parametrize("shape", [[2**40], [2**62, 2**62], [2**64 - 1] * 32], ids=["2**40", "overflow", "32-huge-dims"])
def test_huge_array_refused_without_allocating(shape):
    frames = edited_entry(batch_frames(), 0, SHAPE, shape)
    frames = edited_entry(frames, 0, NBYTES, 4 * 2**40)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        expect(MessageTooLarge, frames)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse a header"


def test_array_and_batch_byte_limits():
    frames = batch_frames()  # arrays of 24 and 3 bytes
    assert decode(frames, limits=Limits(max_array_bytes=24, max_batch_bytes=27)).seq == 3
    expect(MessageTooLarge, frames, limits=Limits(max_array_bytes=23))
    expect(MessageTooLarge, frames, limits=Limits(max_batch_bytes=26))


def test_more_frames_than_max_arrays():
    frames = batch_frames()
    assert decode(frames, limits=Limits(max_arrays=2)).seq == 3
    expect(MessageTooLarge, frames, limits=Limits(max_arrays=1))
    # Counted before the header is even read:
    expect(MessageTooLarge, [b"\xc1"] * 300)


def test_frame_count_disagrees_with_header():
    expect(ProtocolError, batch_frames()[:-1])
    expect(ProtocolError, batch_frames() + [b""])


def test_duplicate_array_names():
    expect(ProtocolError, edited_entry(batch_frames(), 1, NAME, "x"))


# --- checksums and bool frames --------------------------------------------------------------

@pytest.mark.parametrize("pos", [0, 11, 23])
def test_flipped_byte_is_a_checksum_mismatch(pos):
    frames = batch_frames()
    data = bytearray(frames[1])
    data[pos] ^= 0x40
    bad = [frames[0], bytes(data), frames[2]]
    expect(ChecksumMismatch, bad)
    msg = decode(bad, verify=False)  # the caller chose not to look; the bytes come as they are
    assert msg.arrays["x"].tobytes() == bytes(data)


@pytest.mark.parametrize("check", [-1, "abc", 1.5, True, [1]], ids=repr)
def test_bad_checksum_value(check):
    expect(ProtocolError, edited_entry(batch_frames(), 0, CHECK, check))


def test_checksum_without_algorithm():
    expect(ProtocolError, edited(batch_frames(), ck=None))
    assert decode(edited(batch_frames(checksum=False), ck=DROP)).checksum is None


@pytest.mark.parametrize("algo", ["crc32", "XXH3_64", "", 5, ["xxh3_64"], {"xxh3_64": 1}], ids=repr)
def test_unknown_checksum_algorithm(algo):
    expect(ProtocolError, edited(batch_frames(), ck=algo))


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("checksum", [True, False])
def test_bool_frame_holding_2(checksum, verify):
    frames = batch_frames(checksum=checksum)
    bad = b"\x01\x02\x01"
    if checksum:  # a matching checksum, so the bool check itself must catch it
        frames = edited_entry(frames, 1, CHECK, xxhash.xxh3_64_intdigest(bad))
    expect(ProtocolError, [frames[0], frames[1], bad], verify=verify)
