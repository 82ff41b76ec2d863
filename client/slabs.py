"""The client's side of batches placed in shared memory (``fuelline.protocol.placement``).

A batch's arrays are built on this process's mapping of the server's slab, with no copy. They
share one *lease*, a ctypes view of the batch's region of the mapping, which numpy keeps as their
base. When the last array (or anything built on one: a slice, ``torch.from_numpy``) is
garbage-collected, the lease goes too, and its region id is queued in ``released`` for the next
Credit: only then does the server write into that region again. A mapping outlives its file
(the server unlinks a session's slabs when the session ends), so a batch the user keeps stays
valid after its server is gone.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections import OrderedDict, deque
from typing import Any, Sequence

import numpy as np

from fuelline.protocol import ArrayMeta, ProtocolError
from fuelline.protocol.placement import Placement

__all__ = ["ClientSlabs", "SlabUnavailable"]


class SlabUnavailable(ProtocolError):
    """A slab a batch names cannot be mapped here (gone with its session, or out of reach)."""


class ClientSlabs:
    """The slabs of one server's folder, mapped as batches name them.

    Args:
        folder: the folder of the server's Unix socket, where its slabs are.
    """

    MAPPED = 64  # slabs kept mapped for batches to come (a lease keeps its own mapping alive)

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.released: deque[int] = deque()  # region ids whose batches are gone (appended from any thread)
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._session = ""  # the session whose slabs are mapped (the tag in their names)
        self._lease_types: dict[int, type] = {}

    def take_released(self) -> tuple[int, ...]:
        """The region ids released so far, for a Credit (at most its limit; the rest wait)."""
        out: list[int] = []
        while self.released and len(out) < 4096:
            out.append(self.released.popleft())
        return tuple(out)

    def arrays(self, metas: Sequence[ArrayMeta], placement: Placement) -> dict[str, np.ndarray]:
        """The batch's arrays, on the slab's mapping.

        Raises:
            SlabUnavailable: the slab cannot be opened or mapped.
            ProtocolError: the arrays reach past the end of the slab.
        """
        mapping = self._map(placement.slab)
        span = placement.span(metas)
        if span > len(mapping):
            raise ProtocolError(f"batch placed in slab {placement.slab} reaches byte {span}, past its end at {len(mapping)}")
        lease = self._lease_type(span).from_buffer(mapping)
        weakref.finalize(lease, self.released.append, placement.region)
        out = {}
        for meta, at in zip(metas, placement.offsets):
            dtype = np.dtype(meta.dtype)
            arr = np.frombuffer(lease, dtype=dtype, count=meta.nbytes // dtype.itemsize, offset=at)
            if meta.dtype == "|b1" and arr.size and arr.view(np.uint8).max() > 1:
                raise ProtocolError(f"array {meta.name!r}: bool bytes other than 0 and 1 in slab {placement.slab}")
            out[meta.name] = arr.reshape(meta.shape)
        return out

    def _lease_type(self, span: int) -> Any:
        # A subclass, not the ctypes array type itself: only a class of ours takes a weakref.
        lease = self._lease_types.get(span)
        if lease is None:
            if len(self._lease_types) > 256:
                self._lease_types.clear()
            lease = self._lease_types[span] = type("Lease", (ctypes.c_char * max(1, span),), {})
        return lease

    def _map(self, name: str) -> mmap.mmap:
        mapping = self._maps.get(name)
        if mapping is not None:
            self._maps.move_to_end(name)
            return mapping
        session = name.split("-")[1]
        if session != self._session:
            # A new session (a reconnect, a seek): the last one's slabs are gone from the folder,
            # and their memory goes back to the system once no batch of theirs is held.
            self._maps.clear()
            self._session = session
        path = os.path.join(self.folder, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                if not size:
                    raise SlabUnavailable(f"slab {path} is empty")
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError as exc:
            raise SlabUnavailable(f"cannot map slab {path}: {exc.strerror or exc}") from None
        self._maps[name] = mapping
        if len(self._maps) > self.MAPPED:
            self._maps.popitem(last=False)  # (unmapped once no lease holds it)
        return mapping
