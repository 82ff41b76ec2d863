"""Malformed headers end in a typed ProtocolError: undecodable or oversized headers, wrong
versions and message types, missing fields, fields of the wrong type or range, stray frames.

Each bad message is made from a valid encoded one, its header unpacked, edited and repacked with
msgpack (support.wire_edits), so a test changes exactly one thing. ``expect`` checks the exact
class: a missing field reported as a version error would be a bug, too.
"""

from __future__ import annotations

import math

import msgpack
import pytest

from fuelline.protocol import (
    VERSION,
    Bye,
    Credit,
    EndOfEpoch,
    Error,
    Heartbeat,
    Hello,
    Limits,
    MessageTooLarge,
    ProtocolError,
    ProtocolVersionError,
    decode,
)

from support.wire_edits import CONTROL, DROP, HELLO, WELCOME, batch_frames, edited, expect, frames_of


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


def _name(value: object) -> str:
    """A parameter's test id, the same in every process that collects the tests (DROP's repr holds its address)."""
    return "DROP" if value is DROP else repr(value)


@pytest.mark.parametrize("version", [VERSION + 1, 0, -1, DROP, "1", None, True, 1.0, [1]], ids=_name)
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


@pytest.mark.parametrize("version", [VERSION + 1, 0, DROP, "9.9"], ids=_name)
def test_error_of_another_version_still_decodes(version):
    """Its layout never changes, so a client of any version learns why it was turned away."""
    msg = Error("version", "server speaks version 7", fatal=True)
    assert decode(edited(frames_of(msg), v=version)) == msg
    # Readable is not the same as unchecked: a broken Error is malformed whatever its version.
    expect(ProtocolError, edited(frames_of(msg), v=version, fatal="yes"))


@pytest.mark.parametrize("kind", ["nope", "Hello", "", DROP, 5, None, ["hello"]], ids=_name)
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
