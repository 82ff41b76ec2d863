"""Round trips through the wire format: encode -> (bytes | zmq frames) -> decode -> equal.

Equality of arrays is checked bit for bit (NaN payloads and -0.0 included) against the input
converted to little-endian, because the format promises the exact bytes, not just the values.
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from fuelline.protocol import (
    VERSION,
    Batch,
    Bye,
    Credit,
    EndOfEpoch,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Welcome,
    decode,
    encode,
    peek_type,
)

DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
]
# Every multi-byte dtype again in big-endian, which must arrive little-endian.
BIG_ENDIAN = [np.dtype(d).newbyteorder(">").str for d in DTYPES if np.dtype(d).itemsize > 1]

SHAPES = [(), (0,), (0, 5), (3, 0), (1,), (7,), (2, 3), (2, 3, 4), (1, 1, 1, 1)]


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Deterministic values that use the whole byte range of the dtype (negative, large...)."""
    dt = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        raw = raw % 2
    return raw.view(dt).reshape(shape)


def assert_wire_equal(got: np.ndarray, sent: np.ndarray) -> None:
    """Same shape, same little-endian dtype, same bytes; C-contiguous, little-endian, writable."""
    want = sent.astype(sent.dtype.newbyteorder("<"))
    assert got.shape == sent.shape
    assert got.dtype.str == want.dtype.str
    assert got.dtype.str[0] in "<|"
    assert got.flags.c_contiguous
    assert got.flags.writeable
    assert got.tobytes() == want.tobytes()


def roundtrip(msg, **kw):
    """Encode, copy every frame into `bytes` (as a socket would), decode."""
    return decode([bytes(memoryview(f)) for f in encode(msg, **kw)])


# --- control messages -----------------------------------------------------------------------

MESSAGES = [
    Hello("client-7", rank=2, world_size=4, split="val", sources=("x", "y"), stream=3, epoch=5,
          cursor=17, credit=32, heartbeat=0.25),
    Hello("c"),
    Hello("c", heartbeat=3600),
    Welcome("sess-1", 3, ("x", "y"), {"x": {"dtype": "<f4", "shape": [28, 28]}, "y": {"dtype": None, "shape": None}},
            batches_per_epoch=100, heartbeat=2.0, info={"rows": 60000, "splits": ["train", "val"], "seed": 1.5}),
    Welcome("s", 0, (), {}, None, 1),
    Welcome("s", 1, (), {}, 4, 1.0, fingerprint={"seed": "0", "files": "4 files #0123456789abcdef",
                                                  "stages": "", "x" * 64: "y" * 256}),
    Credit(1),
    Credit(2**40),
    EndOfEpoch(stream=1, epoch=2, batches=3),
    Heartbeat(),
    Error(ErrorCode.UNKNOWN_SOURCE, "no source 'z' (have: x, y)", fatal=False),
    Error(ErrorCode.INTERNAL, ""),
    Bye("server shutdown"),
    Bye(),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_control_message_roundtrip_field_by_field(msg):
    frames = encode(msg)
    assert len(frames) == 1, "only a Batch carries frames after the header"
    got = decode(frames)
    assert type(got) is type(msg)
    for f in dataclasses.fields(msg):
        value, sent = getattr(got, f.name), getattr(msg, f.name)
        assert value == sent, f.name
        assert type(value) is type(sent), f"{f.name}: {type(value)} != {type(sent)}"
    assert got == msg
    assert decode([bytes(frames[0])]) == msg


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_header_carries_version_and_type(msg):
    """The version travels in every header, so a peer can refuse a mismatch before reading on."""
    header = msgpack.unpackb(encode(msg)[0])
    assert header["v"] == VERSION
    assert header["t"] == msg.TYPE
    assert peek_type(encode(msg)) == msg.TYPE


def test_a_welcome_fingerprint_is_optional_on_the_wire():
    """A peer that predates the fingerprint sends no key (read as None) and ignores the key it
    does not know, so the version stays the same."""
    fp = {"seed": "0"}
    header = msgpack.unpackb(encode(Welcome("s", 0, (), {}, None, 1, fingerprint=fp))[0])
    assert header["v"] == VERSION and header["fingerprint"] == fp
    del header["fingerprint"]
    assert decode([msgpack.packb(header)]).fingerprint is None


# --- batches: dtypes, shapes, layouts -------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES + BIG_ENDIAN)
def test_batch_roundtrip_every_dtype_and_shape(dtype, shape):
    arr = sample(dtype, shape)
    got = roundtrip(Batch(stream=1, epoch=2, seq=3, arrays={"x": arr}))
    assert (got.stream, got.epoch, got.seq, got.checksum) == (1, 2, 3, "xxh3_64")
    assert list(got.arrays) == ["x"]
    assert_wire_equal(got.arrays["x"], arr)


def _layouts() -> dict[str, np.ndarray]:
    base = sample("float64", (6, 8), seed=1)
    return {
        "step-slice": base[::2, 1::3],
        "negative-step": base[::-1],
        "transpose": base.T,
        "fortran": np.asfortranarray(sample("int32", (5, 4, 3), seed=2)),
        "column": base[:, 2],
        "big-endian-transpose": sample(">u4", (3, 5), seed=3).T,
        "big-endian-f16-slice": sample(">f2", (9,), seed=4)[::4],
        "broadcast": np.broadcast_to(np.arange(3, dtype=np.int16), (4, 3)),
        "0d-view": base[2, 3, ...],
        "empty-slice": base[3:3, ::2],
    }


@pytest.mark.parametrize("name", list(_layouts()))
def test_batch_roundtrip_non_contiguous_and_big_endian(name):
    arr = _layouts()[name]
    got = roundtrip(Batch(0, 0, 0, {name: arr})).arrays[name]
    assert_wire_equal(got, arr)
    np.testing.assert_array_equal(got, arr)  # equal in value, whatever the input layout


def test_encode_sends_contiguous_little_endian_arrays_without_copy():
    """The zero-copy promise on the sending side; a layout that needs fixing is copied once."""
    arr = sample("<f4", (4, 5))
    assert np.shares_memory(encode(Batch(0, 0, 0, {"x": arr}))[1], arr)
    swapped = arr.astype(">f4")
    assert not np.shares_memory(encode(Batch(0, 0, 0, {"x": swapped}))[1], swapped)


def test_batch_keeps_array_order_and_checksum_setting():
    names = ["zeta", "alpha", "mid", "b", "a"]
    arrays = {n: sample(d, (i + 1, 2), seed=i) for i, (n, d) in enumerate(zip(names, ["u1", "f8", "bool", "i2", ">i8"]))}
    for checksum, algo in ((True, "xxh3_64"), (False, None)):
        got = roundtrip(Batch(5, 6, 7, arrays), checksum=checksum)
        assert list(got.arrays) == names
        assert got.checksum == algo
        for n in names:
            assert_wire_equal(got.arrays[n], arrays[n])
    assert [e[0] for e in msgpack.unpackb(encode(Batch(0, 0, 0, arrays))[0])["a"]] == names


def test_batch_with_no_arrays_roundtrips():
    got = roundtrip(Batch(1, 1, 1, {}))
    assert got.arrays == {} and (got.stream, got.epoch, got.seq) == (1, 1, 1)


def test_decoded_arrays_from_bytes_are_writable():
    """Bytes are read-only; the decoder must hand back arrays a user may modify in place."""
    arrays = {f"a{i}": sample(d, s, seed=i) for i, (d, s) in enumerate(
        [("f4", ()), ("i8", (0,)), ("u1", (3, 0)), ("bool", (4,)), ("f2", (2, 3))])}
    got = decode([bytes(memoryview(f)) for f in encode(Batch(0, 0, 0, arrays))])
    for name, arr in got.arrays.items():
        assert arr.flags.writeable, name
        arr[...] = 0  # must not raise
        assert not arr.any()


# --- over a real socket ---------------------------------------------------------------------

@pytest.fixture(params=["inproc", "tcp"])
def pair(request):
    """A connected PAIR of sockets; closed with linger=0 and the context terminated after."""
    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        if request.param == "inproc":
            rx.bind("inproc://fuelline-roundtrip")
            tx.connect("inproc://fuelline-roundtrip")
        else:
            port = rx.bind_to_random_port("tcp://127.0.0.1")
            tx.connect(f"tcp://127.0.0.1:{port}")
        yield tx, rx
    finally:
        tx.close(linger=0)
        rx.close(linger=0)
        ctx.term()


def send_recv(pair, frames) -> list[zmq.Frame]:
    tx, rx = pair
    assert tx.poll(5000, zmq.POLLOUT), "peer never connected"
    tx.send_multipart(frames, copy=False)
    assert rx.poll(5000), "nothing arrived within 5 s"
    return rx.recv_multipart(copy=False)


def _socket_batch() -> dict[str, np.ndarray]:
    arrays = {d: sample(d, (3, 4), seed=i) for i, d in enumerate(DTYPES)}
    arrays["big"] = sample("<f4", (300, 100), seed=99)  # above pyzmq's zero-copy send threshold
    arrays["big-endian"] = sample(">i8", (5,), seed=98)
    arrays["scalar"] = sample("<f8", (), seed=97)
    arrays["empty"] = sample("<i4", (0, 5))
    return arrays


def test_batch_over_zmq_roundtrips_writable_and_zero_copy(pair):
    arrays = _socket_batch()
    expected = {n: a.copy() for n, a in arrays.items()}  # inproc may hand back the sender's memory
    frames = send_recv(pair, encode(Batch(9, 8, 7, arrays)))
    assert all(isinstance(f, zmq.Frame) for f in frames)
    got = decode(frames)
    assert (got.stream, got.epoch, got.seq) == (9, 8, 7)
    assert list(got.arrays) == list(arrays)
    for (name, arr), frame in zip(got.arrays.items(), frames[1:]):
        assert_wire_equal(arr, expected[name])
        if arr.size == 0:
            continue
        # Zero copy: the array lives in the received frame's own buffer...
        frame_addr = np.frombuffer(frame.buffer, np.uint8).__array_interface__["data"][0]
        assert arr.__array_interface__["data"][0] == frame_addr, name
        # ...so a write through the array shows in the frame.
        before = bytes(frame)
        flat = arr.reshape(-1)
        if arr.dtype.kind == "b":
            flat[0] = not flat[0]
        else:
            flat.view(np.uint8)[0] ^= 0xFF
        assert bytes(frame) != before and bytes(frame) == arr.tobytes(), name


def test_control_messages_over_zmq(pair):
    for msg in MESSAGES:
        frames = send_recv(pair, encode(msg))
        assert peek_type(frames) == msg.TYPE
        assert decode(frames) == msg


# --- property-based -------------------------------------------------------------------------

def _any_array() -> st.SearchStrategy[np.ndarray]:
    shapes = array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)
    plain = st.sampled_from(DTYPES + BIG_ENDIAN).flatmap(lambda d: arrays(np.dtype(d), shapes))
    # Some arrays also go through a layout change the encoder must undo.
    layout = st.sampled_from(["as-is", "transpose", "reverse", "fortran"])

    def apply(arr: np.ndarray, how: str) -> np.ndarray:
        if how == "transpose":
            return arr.T
        if how == "reverse" and arr.ndim:
            return arr[::-1]
        if how == "fortran":
            return np.asfortranarray(arr)
        return arr

    return st.builds(apply, plain, layout)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrs=st.lists(_any_array(), min_size=0, max_size=4),
    seq=st.integers(0, 2**63 - 1),
    checksum=st.booleans(),
)
def test_batch_roundtrip_property(arrs, seq, checksum):
    batch = {f"s{i}": a for i, a in enumerate(arrs)}
    got = roundtrip(Batch(0, 1, seq, batch), checksum=checksum)
    assert got.seq == seq
    assert list(got.arrays) == list(batch)
    for name, arr in batch.items():
        assert_wire_equal(got.arrays[name], arr)
