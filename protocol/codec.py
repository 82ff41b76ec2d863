"""Encoding messages to frames and decoding frames to messages.

Frame layout of every message::

    frame 0   header: msgpack map {"v": VERSION, "t": type, <fields of the message>}
    frame 1…  Batch only: one frame per array, its raw bytes (C order, little-endian), in the
              order of the header's "a" list: [[name, dtype, shape, nbytes, checksum], ...]
              and "ck": the checksum algorithm ("xxh3_64") or nil.

Decoding checks, before anything is allocated: the header size, msgpack string/array/map sizes,
the nesting depth, the version (an Error is readable from any version), the message type, every
field, the array count, and per array dtype × shape == nbytes == frame length, then the checksum.
A Batch placed in shared memory (``fuelline.protocol.placement``) is its header alone, with "m":
where its arrays lie; only a connection that asked for it (``decode``'s ``place``) accepts one.
Nothing is unpickled; a header can only hold plain msgpack values. Keys a message does not
have are ignored, so an optional field (``Welcome.fingerprint``) travels without a new version:
a peer that predates it reads the rest of the message as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

from fuelline.protocol.arrays import (
    CHECKSUMS,
    DEFAULT_LIMITS,
    ArrayMeta,
    Checksummed,
    Limits,
    MessageTooLarge,
    rebuild_array,
    wire_array,
)
from fuelline.protocol.errors import ProtocolError, ProtocolVersionError
from fuelline.protocol.messages import (
    MESSAGE_TYPES,
    VERSION,
    Batch,
    Error,
    Hello,
    Message,
    Welcome,
)
from fuelline.protocol.placement import Placement

__all__ = ["encode", "encode_placed", "decode", "encode_header", "peek_type", "Place"]

# What builds a placed batch's arrays on the receiving side: (the batch's stream, its arrays'
# header entries, their placement) → arrays by name. It raises ProtocolError for a slab it cannot map.
Place = Callable[[int, list[ArrayMeta], Placement], dict[str, np.ndarray]]

# Fields that msgpack carries as lists but the dataclasses hold as tuples.
_TUPLE_FIELDS = {(Hello, "sources"), (Welcome, "sources")}


def encode_header(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def encode(msg: Message, *, checksum: bool = True) -> list[Any]:
    """Encode a message as a list of frames for ``socket.send_multipart(frames, copy=False)``.

    Array frames are views of the arrays' own memory (no copy unless an array is not
    C-contiguous or not little-endian), so the arrays must not change until the send is done.
    A Batch whose arrays are ``Checksummed`` is sent with the checksums they carry.
    """
    header: dict[str, Any] = {"v": VERSION, "t": msg.TYPE}
    frames: list[Any] = []
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(msg, Batch) and f.name == "arrays":
            entries = []
            known = value.checksums if isinstance(value, Checksummed) else {}
            for name, arr in value.items():
                meta, flat = wire_array(name, arr, with_checksum=checksum, known=known.get(name))
                entries.append(meta.to_wire())
                frames.append(flat)
            header["a"] = entries
        elif isinstance(msg, Batch) and f.name == "checksum":
            header["ck"] = CHECKSUMS[0] if checksum else None
        else:
            header[f.name] = [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value
    return [encode_header(header), *frames]


def encode_placed(msg: Batch, metas: Sequence[ArrayMeta], placement: Placement) -> list[Any]:
    """A Batch whose arrays were written into shared memory: its header alone (no checksums),
    naming where they lie. ``msg.arrays`` is not read."""
    header = {"v": VERSION, "t": Batch.TYPE, "stream": msg.stream, "epoch": msg.epoch, "seq": msg.seq,
              "a": [m.to_wire() for m in metas], "ck": None, "m": placement.to_wire()}
    return [encode_header(header)]


def _unpack_header(frame: Any, limits: Limits) -> dict[str, Any]:
    size = memoryview(frame).nbytes
    if size > limits.max_header_bytes:
        raise MessageTooLarge(f"header of {size} bytes exceeds the limit of {limits.max_header_bytes}")
    try:
        header = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_header_bytes,
            max_bin_len=limits.max_header_bytes,
            max_array_len=limits.max_header_bytes,
            max_map_len=limits.max_header_bytes,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of types for bad input; all mean the same
        raise ProtocolError(f"undecodable header ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    _check_depth(header, limits.max_header_depth)
    return header


def _check_depth(header: dict[str, Any], limit: int) -> None:
    """Refuse deep nesting before anything recurses into the header (error messages repr it)."""
    level: list[Any] = [header]
    for _ in range(limit):
        children = (c for v in level for c in (v.values() if isinstance(v, dict) else v))
        level = [c for c in children if isinstance(c, (dict, list))]
        if not level:
            return
    raise ProtocolError(f"header nested deeper than {limit} levels")


def batch_checksums(frames: Sequence[Any]) -> tuple[int | None, ...]:
    """The checksum of each array in an encoded Batch (None where it was encoded without)."""
    header = _unpack_header(frames[0], DEFAULT_LIMITS)
    return tuple(entry[4] for entry in header.get("a", ()))


def peek_type(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> str | None:
    """The message type named by a header, or None if it cannot be read. Never raises."""
    try:
        t = _unpack_header(frames[0], limits).get("t")
    except (ProtocolError, IndexError):
        return None
    return t if isinstance(t, str) else None


def decode(
    frames: Sequence[Any], *, limits: Limits = DEFAULT_LIMITS, verify: bool = True, place: Place | None = None
) -> Message:
    """Decode frames (bytes, memoryviews or zmq Frames) into a message.

    ``place`` builds the arrays of a batch placed in shared memory; without it, such a batch is
    refused (a connection that did not ask for shared memory).

    Raises:
        ProtocolVersionError: the header carries another version (except for Error messages).
        MessageTooLarge: something exceeds ``limits``.
        ChecksumMismatch: ``verify`` and an array's bytes disagree with its checksum.
        ProtocolError: anything else malformed; the message says what.
    """
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) > limits.max_arrays + 1:
        raise MessageTooLarge(f"{len(frames)} frames exceed the limit of {limits.max_arrays + 1}")
    header = _unpack_header(frames[0], limits)
    cls, kind = _message_class(header, len(frames))
    placed = cls is Batch and "m" in header
    kwargs = _fields(cls, kind, header)
    if placed:
        if place is None:
            raise ProtocolError("batch placed in shared memory, which this connection did not ask for")
        kwargs["arrays"], kwargs["checksum"] = _place_arrays(header, kwargs.get("stream"), limits, place)
    elif cls is Batch:
        kwargs["arrays"], kwargs["checksum"] = _decode_arrays(header, frames[1:], limits, verify)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"invalid {kind}: {exc}") from None


def _message_class(header: dict[str, Any], frames: int) -> tuple[type, str]:
    """The message type a header names (and its name), once its version and frame count fit it."""
    kind = header.get("t")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    version = header.get("v")
    # type() too: True and 1.0 compare equal to 1 but are not version 1 on the wire.
    if cls is not Error and (type(version) is not int or version != VERSION):
        raise ProtocolVersionError(version, VERSION)
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r:.40}")
    if (cls is not Batch or "m" in header) and frames != 1:
        raise ProtocolError(f"{kind} message carries {frames - 1} unexpected frames")
    return cls, kind  # type: ignore[return-value]


def _fields(cls: type, kind: str, header: dict[str, Any]) -> dict[str, Any]:
    """The header's values of the message's fields (a batch's arrays and checksum aside)."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in ("arrays", "checksum") and cls is Batch:
            continue
        if f.name in header:
            value = header[f.name]
            if (cls, f.name) in _TUPLE_FIELDS and isinstance(value, list):
                value = tuple(value)
            kwargs[f.name] = value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{kind} header lacks field {f.name!r}")
    return kwargs


def _metas(header: dict[str, Any], count: int | None, limits: Limits) -> list[ArrayMeta]:
    entries = header.get("a")
    if not isinstance(entries, list):
        raise ProtocolError("batch header lacks its array list 'a'")
    if count is not None and len(entries) != count:
        raise ProtocolError(f"batch header lists {len(entries)} arrays but {count} frames follow")
    if len(entries) > limits.max_arrays:
        raise MessageTooLarge(f"{len(entries)} arrays exceed the limit of {limits.max_arrays}")
    metas = [ArrayMeta.from_wire(e, limits) for e in entries]
    if len({m.name for m in metas}) != len(metas):
        raise ProtocolError("batch names an array twice")
    total = sum(m.nbytes for m in metas)
    if total > limits.max_batch_bytes:
        raise MessageTooLarge(f"batch of {total} bytes exceeds the limit of {limits.max_batch_bytes}")
    return metas


def _place_arrays(
    header: dict[str, Any], stream: Any, limits: Limits, place: Place
) -> tuple[dict[str, np.ndarray], None]:
    if header.get("ck") is not None:
        raise ProtocolError("a batch placed in shared memory carries no checksums")
    if type(stream) is not int:
        raise ProtocolError(f"invalid batch: stream {stream!r:.40}")
    metas = _metas(header, None, limits)
    if any(m.checksum is not None for m in metas):
        raise ProtocolError("a batch placed in shared memory carries no checksums")
    placement = Placement.from_wire(header["m"], metas)
    return place(stream, metas, placement), None


def _decode_arrays(
    header: dict[str, Any], frames: Sequence[Any], limits: Limits, verify: bool
) -> tuple[dict[str, np.ndarray], str | None]:
    algo = header.get("ck")
    if algo is not None and algo not in CHECKSUMS:
        raise ProtocolError(f"unknown checksum algorithm {algo!r:.40}")
    metas = _metas(header, len(frames), limits)
    if algo is None and any(m.checksum is not None for m in metas):
        raise ProtocolError("array checksums given without a checksum algorithm")
    arrays = {m.name: rebuild_array(m, fr, verify) for m, fr in zip(metas, frames)}
    return arrays, algo
