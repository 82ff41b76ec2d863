"""Array frames: which dtypes travel, how an array's header entry is checked, checksums.

An array travels as one raw frame holding its bytes in C order, little-endian, and one entry in
the batch header: ``[name, dtype, shape, nbytes, checksum]``. The receiver rebuilds it with
``np.frombuffer`` on the received frame, so a large array is never copied on its way in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from fuelline.protocol.errors import ChecksumMismatch, MessageTooLarge, ProtocolError

__all__ = [
    "WIRE_DTYPES", "ArrayMeta", "Limits", "DEFAULT_LIMITS", "CHECKSUMS", "Checksummed", "wire_array", "checksum",
    "copy_with_checksum",
]

# The dtypes that may cross the wire, by their numpy ``dtype.str``. Nothing with object,
# structured or datetime fields: a header can only ever describe plain numbers.
WIRE_DTYPES = frozenset(
    ["|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8"]
)

# Checksum algorithms a batch header may name. xxh3 runs at ~25 GB/s, CRC32 (zlib) at ~5: on
# a loopback stream of 3 MB batches, checking with xxh3 costs about a fifth of the throughput,
# with CRC32 it cost half (each end makes one more pass over every byte).
CHECKSUMS = ("xxh3_64",)

# Bytes copied, then hashed, at a time by ``copy_with_checksum``. Each block's copy and hash let go
# of the interpreter lock, and in a server the serving loop takes it each time: a hand-off costs
# far more than the cache a smaller block would save. A Fuel stream's 3 MB batches into shared
# memory, on 2 cores: 5.1 GB/s in 256 KiB blocks, 6.2 in 1 MiB, 8.4 in one block. Alone, 8 MiB
# blocks copy and hash large arrays within 10 % of 1 MiB ones (the block is still in L3 when it is
# hashed, where a whole 200 MB array would not be).
COPY_BLOCK = 8 * 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """Hard limits on what a decoder accepts; anything above them is refused unread."""

    max_header_bytes: int = 64 * 1024
    max_arrays: int = 256
    max_ndim: int = 32
    max_array_bytes: int = 2**31
    max_batch_bytes: int = 2**32
    # Valid headers nest 4 deep (header → "a" → entry → shape). msgpack unpacks up to 1024 levels,
    # but repr() and == recurse in C and raise RecursionError, not ProtocolError, near 1000.
    max_header_depth: int = 16

    def __post_init__(self) -> None:
        for name in (
            "max_header_bytes", "max_arrays", "max_ndim", "max_array_bytes", "max_batch_bytes", "max_header_depth"
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class ArrayMeta:
    """One array's entry in a batch header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int | None

    def to_wire(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.nbytes, self.checksum]

    @classmethod
    def from_wire(cls, entry: Any, limits: Limits) -> "ArrayMeta":
        """Validate one header entry; every field is checked before anything is allocated."""
        if not isinstance(entry, list) or len(entry) != 5:
            raise ProtocolError(f"array entry must be [name, dtype, shape, nbytes, checksum], got {entry!r:.200}")
        name, dtype, shape, nbytes, check = entry
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"array name must be a non-empty string, got {name!r:.100}")
        if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:  # a list/map is unhashable
            raise ProtocolError(f"array {name!r}: dtype {dtype!r:.40} is not one of {sorted(WIRE_DTYPES)}")
        if not isinstance(shape, list) or len(shape) > limits.max_ndim:
            raise ProtocolError(f"array {name!r}: shape must be a list of at most {limits.max_ndim} dims")
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ProtocolError(f"array {name!r}: shape {shape!r:.200} must hold non-negative ints")
        # Python ints: a hostile shape cannot overflow this product.
        expected = math.prod(shape) * np.dtype(dtype).itemsize
        if expected > limits.max_array_bytes:
            raise MessageTooLarge(
                f"array {name!r}: {expected} bytes exceeds the limit of {limits.max_array_bytes}"
            )
        if type(nbytes) is not int or nbytes != expected:
            raise ProtocolError(
                f"array {name!r}: nbytes {nbytes!r:.40} disagrees with dtype {dtype} x shape {tuple(shape)} = {expected}"
            )
        if check is not None and (type(check) is not int or not 0 <= check < 2**64):
            raise ProtocolError(f"array {name!r}: checksum must be a uint64 or nil")
        return cls(name, dtype, tuple(shape), nbytes, check)


def checksum(buf: Any) -> int:
    """The xxh3-64 digest of a buffer, as an unsigned int."""
    return xxhash.xxh3_64_intdigest(buf)


def copy_with_checksum(value: Any, out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """A C-contiguous copy of an array (same dtype and shape) and the xxh3-64 of its bytes.

    ``out``, if given, is where the copy is written: a C-contiguous array of the same dtype and
    shape (a ValueError otherwise).

    The copy is hashed block by block right after each block is written, while it is still in
    cache: one pass over memory where copying and then checksumming would make two. The digest
    is the one ``checksum`` gives of the copy's bytes (xxh3's streaming and one-shot forms agree).
    """
    src = np.asarray(value)
    if out is None:
        out = np.empty(src.shape, src.dtype)
    elif out.shape != src.shape or out.dtype != src.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out is {out.dtype}{out.shape}, not a C-contiguous {src.dtype}{src.shape}")
    dst = out.reshape(-1).view(np.uint8)
    h = xxhash.xxh3_64()
    if src.flags.c_contiguous:
        flat = src.reshape(-1).view(np.uint8)
        for start in range(0, dst.size, COPY_BLOCK):
            block = dst[start:start + COPY_BLOCK]
            block[...] = flat[start:start + COPY_BLOCK]
            h.update(block.data)
    elif src.ndim:
        # Strided: whole rows of the leading axis at a time, about a block's worth.
        rows = max(1, COPY_BLOCK // max(1, out[0].nbytes))
        for start in range(0, len(out), rows):
            block = out[start:start + rows]
            block[...] = src[start:start + rows]
            h.update(block.reshape(-1).view(np.uint8).data)
    return out, h.intdigest()


class Checksummed(dict[str, Any]):
    """Arrays by name, with ``checksums[name]``: the xxh3-64 of an array's bytes in C order,
    taken where they were last read anyway (a source that digests what it holds), so that
    encoding them need not read every byte once more. An array without an entry is checksummed
    when it is encoded; one that is not sent straight from its own memory (see ``wire_array``)
    always is."""

    __slots__ = ("checksums",)

    def __init__(self, arrays: Any = (), checksums: dict[str, int] | None = None) -> None:
        super().__init__(arrays)
        self.checksums: dict[str, int] = dict(checksums or {})

    def subset(self, names: Any) -> "Checksummed":
        """The arrays ``names``, in that order, with their checksums."""
        sums = self.checksums
        return Checksummed({n: self[n] for n in names}, {n: sums[n] for n in names if n in sums})


def wire_array(name: str, value: Any, with_checksum: bool, known: int | None = None) -> tuple[ArrayMeta, np.ndarray]:
    """Turn a value into (header entry, 1-d uint8 view of its bytes) without copying if it can.

    Non-contiguous arrays are made C-contiguous and big-endian ones little-endian (one copy);
    every other array is sent straight from its own memory. ``known`` is the checksum of that
    memory's bytes, taken by the caller; it is used only for an array sent straight from its
    own memory (the bytes of a copy may differ: a byte swap), else the bytes are read for it.
    """
    arr = np.asarray(value)
    dtype = arr.dtype
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and np.little_endian is False):
        arr = arr.astype(dtype.newbyteorder("<"))
    if arr.dtype.str not in WIRE_DTYPES:
        raise TypeError(
            f"source {name!r}: dtype {arr.dtype} cannot be served; use one of bool, int8-64, uint8-64, float16/32/64"
        )
    if not arr.flags.c_contiguous:
        # (np.ascontiguousarray would also turn a 0-d array into 1-d, so only when needed.)
        arr = np.ascontiguousarray(arr)
    flat = arr.reshape(-1).view(np.uint8)
    check = None
    if with_checksum:
        check = known if known is not None and arr is value else checksum(flat)
    meta = ArrayMeta(
        name=name,
        dtype=arr.dtype.str,
        shape=tuple(int(d) for d in arr.shape),
        nbytes=int(arr.nbytes),
        checksum=check,
    )
    return meta, flat


def rebuild_array(meta: ArrayMeta, frame: Any, verify: bool) -> np.ndarray:
    """Rebuild an array on a received frame, checked against its header entry."""
    buf = memoryview(frame)
    if buf.nbytes != meta.nbytes:
        raise ProtocolError(
            f"array {meta.name!r}: frame holds {buf.nbytes} bytes, header says {meta.nbytes}"
        )
    if buf.ndim != 1 or buf.format not in ("B", "b", "c"):
        buf = buf.cast("B")
    if verify and meta.checksum is not None and checksum(buf) != meta.checksum:
        raise ChecksumMismatch(f"array {meta.name!r}: checksum mismatch over {meta.nbytes} bytes")
    arr = np.frombuffer(buf, dtype=np.dtype(meta.dtype))
    if meta.dtype == "|b1" and arr.size and arr.view(np.uint8).max() > 1:
        raise ProtocolError(f"array {meta.name!r}: bool frame holds bytes other than 0 and 1")
    if not arr.flags.writeable:
        # Only read-only inputs (bytes) land here; frames received from zmq are writable.
        arr = arr.copy()
    return arr.reshape(meta.shape)
