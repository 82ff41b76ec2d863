"""Batches placed in shared memory: on one host, a batch's arrays skip the socket.

A client that reads through its server's Unix socket may ask for it (``Hello.shm``). The server
then writes a batch's arrays into a *slab*: a file in its private socket folder (mode 700, on a
memory file system), which both processes map. What travels on the socket is the batch header
alone, with ``"m": {"slab": name, "r": region, "at": [offset of each array]}``. The client builds
its arrays on its mapping of the slab, and returns ``region`` (``Credit.released``) once the last
of them has been garbage-collected; until then the server writes nothing there. Such a batch
carries no checksum: its bytes cross no wire.

A slab's name is a plain file name (``SLAB_NAME``), never a path: the client opens it in the
folder of the socket it already reads, so a header cannot point it anywhere else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from fuelline.protocol.arrays import ArrayMeta
from fuelline.protocol.errors import ProtocolError

__all__ = ["ALIGN", "SLAB_NAME", "MAX_REGION", "Placement", "layout"]

# A server lays arrays it copies on cache lines; arrays gathered in a slab to begin with lie where
# the gather put them (a batch of several cut from one buffer): aligned to their dtype at least.
ALIGN = 64
SLAB_NAME = re.compile(r"slab-[0-9a-f]{1,32}-[0-9]{1,9}\Z")
MAX_REGION = 2**62  # region ids are server-wide counters; far below what msgpack carries


def layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of arrays of these sizes laid out one after another, each on ``ALIGN``; and the
    bytes they span."""
    offsets, at = [], 0
    for n in nbytes:
        offsets.append(at)
        at += -(-n // ALIGN) * ALIGN
    return offsets, at


@dataclass(frozen=True)
class Placement:
    """Where a batch's arrays lie: slab file name, region id, and each array's offset there."""

    slab: str
    region: int
    offsets: tuple[int, ...]

    def span(self, metas: Sequence[ArrayMeta]) -> int:
        """The bytes of the slab that the arrays reach: the end of the farthest one."""
        return max((at + m.nbytes for at, m in zip(self.offsets, metas)), default=0)

    def to_wire(self) -> dict[str, Any]:
        return {"slab": self.slab, "r": self.region, "at": list(self.offsets)}

    @classmethod
    def from_wire(cls, value: Any, metas: Sequence[ArrayMeta]) -> "Placement":
        """Validate a header's ``"m"`` against its arrays: a slab name, a region id, one offset
        per array, aligned to its dtype, no two arrays overlapping."""
        if not isinstance(value, dict) or set(value) != {"slab", "r", "at"}:
            raise ProtocolError(f"batch placement must be a map of slab, r and at, got {value!r:.120}")
        slab, region, offsets = value["slab"], value["r"], value["at"]
        if not isinstance(slab, str) or not SLAB_NAME.match(slab):
            raise ProtocolError(f"batch placement names slab {slab!r:.80}, which is not a slab's file name")
        if type(region) is not int or not 0 <= region < MAX_REGION:
            raise ProtocolError(f"batch placement region must be an int in [0, 2**62), got {region!r:.40}")
        if not isinstance(offsets, list) or len(offsets) != len(metas):
            raise ProtocolError(f"batch placement gives {len(offsets) if isinstance(offsets, list) else offsets!r:.40} "
                                f"offsets for {len(metas)} arrays")
        end = 0
        for at, meta in sorted(zip(offsets, metas), key=lambda p: p[0] if type(p[0]) is int else -1):
            if type(at) is not int or at < end or at % np.dtype(meta.dtype).itemsize:
                raise ProtocolError(f"array {meta.name!r}: offset {at!r:.40} in slab {slab} is negative, unaligned "
                                    f"or overlaps another array")
            end = at + meta.nbytes
        return cls(slab, region, tuple(offsets))
