"""Malformed input: every way a peer can break the wire format ends in a typed ProtocolError.

Each bad message is made from a valid encoded one, its header unpacked, edited and repacked with
msgpack, so a test changes exactly one thing. ``expect`` checks the exact class: a missing field
reported as a version error would be a bug, too.
"""

from __future__ import annotations

import math
import tracemalloc

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings, strategies as st

from fuelline.protocol import (
    VERSION,
    WIRE_DTYPES,
    Batch,
    Bye,
    ChecksumMismatch,
    Credit,
    EndOfEpoch,
    Error,
    Heartbeat,
    Hello,
    Limits,
    MessageTooLarge,
    ProtocolError,
    ProtocolVersionError,
    Welcome,
    decode,
    encode,
    peek_type,
)

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


def test_valid_batch_decodes():
    """The baseline the edits below start from is itself valid."""
    msg = decode(batch_frames())
    assert list(msg.arrays) == ["x", "y"] and msg.arrays["y"].tolist() == [True, False, True]


# --- the header -----------------------------------------------------------------------------

def test_empty_frame_list():
    expect(ProtocolError, [])

@pytest.mark.parametrize("raw", [b"", b"\xc1", b"\x83\xa1v", bytes(range(256)), b"\xde\xff\xff", b"\x93\x01\x02"])
def test_undecodable_header(raw):
    expect(ProtocolError, [raw])


@pytest.mark.parametrize("value", [[1, 2], "hello", None, 1, 2.5, b"\x00"])
def test_header_not_a_map(value):
    expect(ProtocolError, [msgpack.packb(value, use_bin_type=True)])


def test_deeply_nested_header_is_refused_before_anything_recurses_into_it():
    # 1000 levels fit msgpack's own limit and 2 KB, but repr() of it would blow Python's stack.
    nested: object = 0
    for _ in range(1000):
        nested = [nested]
    err = expect(ProtocolError, edited(frames_of(Hello("deep")), pad=nested))
    assert "nested deeper than" in str(err)
    shallow: object = 0
    for _ in range(10):
        shallow = [shallow]
    assert decode(edited(frames_of(Hello("ok")), pad=shallow)) == Hello("ok")  # unknown keys are ignored


def test_header_size_limit_is_exact():
    frames = frames_of(Hello("c" * 100))
    size = len(frames[0])
    assert decode(frames, limits=Limits(max_header_bytes=size)) == Hello("c" * 100)
    expect(MessageTooLarge, frames, limits=Limits(max_header_bytes=size - 1))
    expect(MessageTooLarge, edited(frames, pad="z" * 70_000))  # the default limit is 64 KiB


@pytest.mark.parametrize("version", [VERSION + 1, 0, -1, DROP, "1", None, True, 1.0, [1]], ids=repr)
def test_wrong_version(version):
    """Only the integer VERSION is this protocol; True and 1.0 merely compare equal to it."""
    err = expect(ProtocolVersionError, edited(frames_of(Credit(1)), v=version))
    want = None if version is DROP else version
    assert type(err.got) is type(want) and err.got == want
    assert err.expected == VERSION


@pytest.mark.parametrize("kind", [m.TYPE for m in CONTROL if not isinstance(m, Error)] + ["batch"])
def test_wrong_version_on_every_message_but_error(kind):
    frames = batch_frames() if kind == "batch" else frames_of(next(m for m in CONTROL if m.TYPE == kind))
    expect(ProtocolVersionError, edited(frames, v=VERSION + 1))


@pytest.mark.parametrize("version", [VERSION + 1, 0, DROP, "9.9"], ids=repr)
def test_error_of_another_version_still_decodes(version):
    """Its layout never changes, so a client of any version learns why it was turned away."""
    msg = Error("version", "server speaks version 7", fatal=True)
    assert decode(edited(frames_of(msg), v=version)) == msg
    # Readable is not the same as unchecked: a broken Error is malformed whatever its version.
    expect(ProtocolError, edited(frames_of(msg), v=version, fatal="yes"))


@pytest.mark.parametrize("kind", ["nope", "Hello", "", DROP, 5, None, ["hello"]], ids=repr)
def test_unknown_message_type(kind):
    expect(ProtocolError, edited(frames_of(Credit(1)), t=kind))


@pytest.mark.parametrize(
    "msg, field",
    [(HELLO, "client_id"), (WELCOME, "session"), (WELCOME, "batches_per_epoch"), (WELCOME, "heartbeat"),
     (Credit(1), "n"), (EndOfEpoch(0, 0, 0), "batches"), (Error("c", "m"), "code"), (Error("c", "m"), "message")],
    ids=lambda x: x if isinstance(x, str) else type(x).__name__,
)
def test_missing_required_field(msg, field):
    expect(ProtocolError, edited(frames_of(msg), **{field: DROP}))


@pytest.mark.parametrize("field", ["stream", "epoch", "seq", "a"])
def test_batch_missing_required_field(field):
    expect(ProtocolError, edited(batch_frames(), **{field: DROP}))


def test_missing_optional_fields_take_defaults():
    assert decode([msgpack.packb({"v": VERSION, "t": "hello", "client_id": "c"})]) == Hello("c")


BAD_FIELDS = [
    (HELLO, "rank", "1"), (HELLO, "rank", True), (HELLO, "rank", 1.0), (HELLO, "rank", -1),
    (HELLO, "rank", 2), (HELLO, "rank", 7), (HELLO, "world_size", 0), (HELLO, "client_id", ""),
    (HELLO, "client_id", b"c"), (HELLO, "split", None), (HELLO, "credit", -1), (HELLO, "epoch", None),
    (HELLO, "sources", ["x", "x"]), (HELLO, "sources", ["x", ""]), (HELLO, "sources", "xy"),
    (HELLO, "heartbeat", math.nan), (HELLO, "heartbeat", 0), (HELLO, "heartbeat", 0.0),
    (HELLO, "heartbeat", math.inf), (HELLO, "heartbeat", -1.0), (HELLO, "heartbeat", 3601), (HELLO, "heartbeat", True),
    (Credit(1), "n", -1), (Credit(1), "n", 0), (Credit(1), "n", True), (Credit(1), "n", "1"), (Credit(1), "n", 1.5),
    (EndOfEpoch(0, 0, 0), "batches", -1), (EndOfEpoch(0, 0, 0), "epoch", True),
    (WELCOME, "schema", {"y": {}}), (WELCOME, "sources", ["x", "x"]), (WELCOME, "heartbeat", math.nan),
    (WELCOME, "batches_per_epoch", -1), (WELCOME, "batches_per_epoch", False), (WELCOME, "info", [1]),
    (WELCOME, "fingerprint", ["seed", "0"]), (WELCOME, "fingerprint", {"seed": 0}),
    (WELCOME, "fingerprint", {"seed": None}), (WELCOME, "fingerprint", {"": "0"}),
    (WELCOME, "fingerprint", {"seed": "0" * 257}), (WELCOME, "fingerprint", {"k" * 65: "0"}),
    (WELCOME, "fingerprint", {f"part{i}": "0" for i in range(65)}),
    (Error("c", "m"), "fatal", 1), (Error("c", "m"), "code", ""), (Error("c", "m"), "message", None),
    (Bye(), "reason", 5),
]


@pytest.mark.parametrize("msg, field, value", BAD_FIELDS, ids=lambda x: repr(x)[:20])
def test_field_with_wrong_type_or_range(msg, field, value):
    expect(ProtocolError, edited(frames_of(msg), **{field: value}))


@pytest.mark.parametrize("field, value", [("seq", True), ("stream", -1), ("epoch", "0"), ("seq", 2.0)])
def test_batch_field_with_wrong_type(field, value):
    expect(ProtocolError, edited(batch_frames(), **{field: value}))


@pytest.mark.parametrize("msg", [Credit(1), Heartbeat(), Error("c", "m"), Bye()], ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("extra", [[b"x"], [b""], [b"a", b"b"]])
def test_extra_frames_on_a_control_message(msg, extra):
    expect(ProtocolError, frames_of(msg) + extra)


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


# --- fuzzing: only ProtocolError ever escapes -----------------------------------------------

def decode_or_protocol_error(frames, verify: bool = True):
    """A message or None; any exception other than ProtocolError fails the test."""
    try:
        msg = decode(frames, verify=verify)
    except ProtocolError:
        return None
    assert peek_type(frames) == msg.TYPE
    return msg


LEAVES = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=6) | st.sampled_from(sorted(WIRE_DTYPES) + ["hello", "batch", "xxh3_64", "x", VERSION])
)
MSGPACK_VALUES = st.recursive(
    LEAVES, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4),
    max_leaves=10,
)
VALID = [frames_of(m) for m in CONTROL] + [batch_frames(), batch_frames(checksum=False)]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(frames=st.lists(st.binary(max_size=40), min_size=1, max_size=4), verify=st.booleans())
def test_fuzz_random_frames(frames, verify):
    decode_or_protocol_error(frames, verify)
    assert peek_type(frames) is None or isinstance(peek_type(frames), str)


@FUZZ
@given(header=MSGPACK_VALUES, rest=st.lists(st.binary(max_size=24), max_size=3))
def test_fuzz_any_msgpack_header(header, rest):
    decode_or_protocol_error([msgpack.packb(header, use_bin_type=True), *rest])


@FUZZ
@given(data=st.data(), value=MSGPACK_VALUES)
def test_fuzz_one_header_value_replaced(data, value):
    """Any plain value in any place of a valid header: what a hostile peer controls."""
    frames = data.draw(st.sampled_from(VALID))
    header = header_of(frames)
    where = data.draw(st.sampled_from(sorted(header) + ["new-key"] + (["entry"] * 3 if "a" in header else [])))
    if where == "entry":
        header["a"][data.draw(st.integers(0, 1))][data.draw(st.integers(0, 4))] = value
    else:
        header[where] = value
    decode_or_protocol_error(with_header(frames, header))


@FUZZ
@given(
    mutations=st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), max_size=6),
    cut=st.none() | st.integers(0, 2**16),
    keep=st.lists(st.booleans(), min_size=3, max_size=3),
    verify=st.booleans(),
)
def test_fuzz_mutated_batch(mutations, cut, keep, verify):
    frames = batch_frames()
    head = bytearray(frames[0])
    for pos, byte in mutations:
        head[pos % len(head)] = byte
    if cut is not None:
        head = head[: cut % (len(head) + 1)]
    mutated = [f for f, k in zip([bytes(head), *frames[1:]], keep) if k]
    decode_or_protocol_error(mutated, verify)
    assert peek_type(mutated) is None or isinstance(peek_type(mutated), str)


# --- peek_type ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "frames",
    [[], [b""], [b"\xc1"], [b"\x91" * 5000 + b"\xc0"], [msgpack.packb([1, 2])], [msgpack.packb({"t": 5})],
     [msgpack.packb({"t": None, "v": 1})], [msgpack.packb({"t": "x" * 70_000})], [bytes(range(256))] * 3],
    ids=["none", "empty", "c1", "deep", "list", "t-int", "t-nil", "oversized", "bytes"],
)
def test_peek_type_returns_none_on_garbage(frames):
    assert peek_type(frames) is None


def test_peek_type_reads_the_type_of_any_version():
    """A server peeks to answer a Hello of another version with an Error it can read."""
    assert peek_type(edited(frames_of(HELLO), v=VERSION + 1)) == "hello"
    assert peek_type(edited(frames_of(HELLO), t="unknown")) == "unknown"
