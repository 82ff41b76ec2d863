"""Fuzzing the decoder: whatever frames a peer sends, only ProtocolError ever escapes, and
``peek_type`` reads a message's type (of any version) or answers None.

Hypothesis draws random frames, any msgpack header, one value of a valid header replaced, and
valid batches with bytes flipped, the header cut or frames dropped.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fuelline.protocol import VERSION, WIRE_DTYPES, ProtocolError, decode, peek_type

from support.wire_edits import CONTROL, HELLO, batch_frames, edited, frames_of, header_of, with_header

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
