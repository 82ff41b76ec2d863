"""Memory for the server's copies of a Fuel stream's batches, used again once nothing holds it.

A Fuel stream's batches are copied as they are read (``fuelline.server.sources.fuel``) and held
by the shared pass, up to its budget, for ranks that start late or reconnect. Each copy of a 3 MB
batch used to be new memory: with the pass holding a few hundred MB, the allocator mapped fresh
pages for every copy, and the kernel's page faults and zeroing cost three times the copy itself
(0.45 ms a 3 MB copy against 0.16 ms into memory already mapped, on 2 cores). The copies now go
into buffers kept here, and a buffer is written again only when nothing else refers to it: not
the pass, not a session's memory tier, not a zero-copy send still queued in ZeroMQ (every one of
them holds the array, or a view or buffer export of it, and so a reference to the buffer).

The buffers kept are bounded by bytes. Past the bound, idle buffers of other sizes are let go,
and if every buffer is in use a copy gets plain new memory, as before: nothing waits for memory.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import numpy as np

__all__ = ["RecycledBuffers"]

PAGE = 4096


def _refs(kept: list[np.ndarray]) -> list[int]:
    """The reference count of each buffer in ``kept``, as this function sees it."""
    return [sys.getrefcount(buf) for buf in kept]


# What ``_refs`` counts of a buffer only its list holds (the list's slot, the loop's name and
# getrefcount's argument, on this interpreter): measured, not assumed.
_IDLE_REFS = _refs([np.empty(1, np.uint8)])[0]


class RecycledBuffers:
    """Byte buffers by size, handed out again once idle; at most ``limit`` bytes kept.

    Args:
        limit: bytes of buffers kept, in use or idle. 0 keeps none (every request is new memory).
    """

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0 bytes, got {limit}")
        self.limit = limit
        self.kept = 0  # bytes of the buffers in ``_by_size``
        self.reused = 0  # requests served from a kept buffer
        self.fresh = 0  # requests that got new memory
        self._by_size: OrderedDict[int, list[np.ndarray]] = OrderedDict()  # least recently used size first
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised C-contiguous array of ``shape`` and ``dtype``."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < PAGE or dtype.hasobject:
            return np.empty(shape, dtype)  # (small: the allocator reuses its own memory well)
        size = -(-nbytes // PAGE) * PAGE
        with self._lock:
            buf = self._take(size)
            if buf is None:
                self.fresh += 1
        if buf is None:
            return np.empty(shape, dtype)
        return buf[:nbytes].view(dtype).reshape(shape)

    def _take(self, size: int) -> np.ndarray | None:
        kept = self._by_size.get(size)
        if kept is not None:
            self._by_size.move_to_end(size)
            for i, refs in enumerate(_refs(kept)):
                if refs == _IDLE_REFS:
                    buf = kept.pop(i)
                    kept.append(buf)  # (the oldest handed out are the likeliest idle: looked at first)
                    self.reused += 1
                    return buf
        if self.kept + size > self.limit:
            self._let_go(self.kept + size - self.limit)
            if self.kept + size > self.limit:
                return None
        buf = np.empty(size, np.uint8)
        self._by_size.setdefault(size, []).append(buf)
        self.kept += size
        self.fresh += 1
        return buf

    def _let_go(self, nbytes: int) -> None:
        """Forget idle buffers, of the least recently asked sizes first, until ``nbytes`` went."""
        for size in list(self._by_size):
            kept = self._by_size[size]
            idle = [i for i, refs in enumerate(_refs(kept)) if refs == _IDLE_REFS]
            for i in reversed(idle[: -(-nbytes // size)]):
                del kept[i]
                self.kept -= size
                nbytes -= size
            if not kept:
                del self._by_size[size]
            if nbytes <= 0:
                return

    def clear(self) -> None:
        """Forget every buffer (those in use stay valid: their users hold them)."""
        with self._lock:
            self._by_size.clear()
            self.kept = 0
