"""A session's slabs: the shared memory its batches are placed in (``fuelline.protocol.placement``).

A slab is a file in the server's private socket folder, created with mode 600, its pages reserved
at once (``posix_fallocate``: a full /dev/shm refuses a new slab here, rather than killing a
process that writes into it later), and mapped by the server and by its client. Batches are laid
one after another in a slab; a slab whose batches the client has all released is used again, so
its pages stay mapped on both sides.

Two ways in:

- ``carve``: the producer thread's gathers build their batches in a slab to begin with
  (``fuelline.server.sources.buffers``), so a row is copied once, from the decoded unit into the
  memory the client maps; ``place`` then finds the batch there and copies nothing.
- ``place`` of arrays from elsewhere (a batch that is a view of a decoded unit, a Fuel stream's
  arrays) copies them into a slab.

Each has a slab of its own open at a time. A gather's slab is closed to new batches only when the
next gather needs room, and by then every batch of the one before has been placed (a source yields
a gather's batches one by one, and the producer places each before it asks for the next), so no
slab is reused while a batch built in it waits to be placed.

Nor is a slab reused while any array built in it is still held in this process: a Fuel stream's
shared pass keeps the batches it copied into a slab (``fuelline.server.sources.fuel``) for the
other ranks and for reconnects. Every such array refers to the slab's mapping, so the mapping's
reference count says whether one is left.

The session holds at most ``max_slabs``; a batch that finds no room, or a slab that cannot be made,
goes over the socket as before, so a client that keeps every batch it is given makes the server
fall back, not grow. Nor is a slab made that would leave less than a quarter of its file system
free (``KEEP_FREE``): /dev/shm is shared with the worker processes' hand-off files and with every
other program on the host, and many local clients of large batches must not fill it.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from fuelline.protocol import WIRE_DTYPES, ArrayMeta
from fuelline.protocol.placement import ALIGN, Placement, layout

__all__ = ["SessionSlabs", "Placed"]

log = logging.getLogger("fuelline.server")

GRAIN = 1 << 20  # slab sizes are rounded up to this
KEEP_FREE = 0.25  # of the slab folder's file system, left free by new slabs
_REGIONS = itertools.count()  # region ids, unique in the server: a stale release frees nothing


class Placed(NamedTuple):
    """A batch lent to the client: its arrays' header entries, where they lie, and whether they
    were built there (so they are not the producer's to keep: the slab is reused once released)."""

    metas: list[ArrayMeta]
    placement: Placement
    in_place: bool


@dataclass(eq=False)
class _Slab:
    name: str
    path: str
    map: mmap.mmap
    base: int  # the address of the server's mapping
    fill: int = 0  # bytes laid out so far
    open: bool = False  # batches are still being laid out in it
    regions: set[int] = field(default_factory=set)  # batches lent to the client

    @property
    def size(self) -> int:
        return len(self.map)


def _map_refs(slab: _Slab) -> int:
    return sys.getrefcount(slab.map)


# What ``_map_refs`` counts of a slab no array in this process is built in (measured, not assumed).
_UNHELD = _map_refs(_Slab("", "", mmap.mmap(-1, mmap.PAGESIZE), 0))


def _unheld(slab: _Slab) -> bool:
    """No array in this process lies in the slab (any that does holds its mapping)."""
    return _map_refs(slab) == _UNHELD


class SessionSlabs:
    """Args:
        folder: the server's socket folder (on a memory file system).
        tag: hex, unique to the session: its slabs are ``slab-<tag>-<n>``.
        max_slabs: slabs at most, in use and free together.
    """

    def __init__(self, folder: str, tag: str, max_slabs: int, keep_free: float = KEEP_FREE) -> None:
        self.folder, self.tag, self.max_slabs, self.keep_free = folder, tag, max_slabs, keep_free
        self.placed = 0  # batches placed in shared memory
        self.built_in_place = 0  # of which gathered there to begin with (nothing copied)
        self.passed = 0  # batches that found no room and went over the socket
        self._lock = threading.Lock()
        self._slabs: list[_Slab] = []
        self._free: list[_Slab] = []
        self._open: dict[str, _Slab] = {}  # "gather" and "copy": the slab each lays batches in
        self._lent: dict[int, _Slab] = {}
        self._names = 0  # slabs ever made: the next one's number
        self._closed = False
        self._refused = False  # a slab could not be made: no more tries for this session

    # -- the producer thread ---------------------------------------------------------------------
    def carve(self, specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray] | None:
        """Uninitialised arrays of these shapes and dtypes, side by side in a slab; None where
        there is no room (the gather then builds them in ordinary memory)."""
        got = self._lay("gather", [int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in specs])
        if got is None:
            return None
        slab, offsets = got
        return [np.ndarray(shape, dtype, buffer=slab.map, offset=at) for (shape, dtype), at in zip(specs, offsets)]

    def place(self, arrays: Mapping[str, Any]) -> Placed | None:
        """The arrays' header entries and placement, lent to the client until it releases them:
        where they lie already, or copied into a slab. None where they must go over the socket."""
        values = [(name, np.asarray(a)) for name, a in arrays.items()]
        if any(a.dtype.str not in WIRE_DTYPES for _, a in values):
            return None  # (big-endian or unservable: encode converts it, or says why)
        slab, offsets = self._where(values)
        in_place = slab is not None
        if slab is None:
            got = self._lay("copy", [a.nbytes for _, a in values])
            if got is None:
                self.passed += 1
                return None
            slab, offsets = got
            for (_, a), at in zip(values, offsets):
                np.copyto(np.ndarray(a.shape, a.dtype, buffer=slab.map, offset=at), a, casting="no")
        region = next(_REGIONS)
        with self._lock:
            if self._closed:
                return None
            slab.regions.add(region)
            self._lent[region] = slab
        self.placed += 1
        self.built_in_place += in_place
        metas = [ArrayMeta(name, a.dtype.str, tuple(int(d) for d in a.shape), int(a.nbytes), None) for name, a in values]
        return Placed(metas, Placement(slab.name, region, tuple(offsets)), in_place)

    def holds(self, arrays: Mapping[str, Any]) -> bool:
        """Whether any of these arrays lies in one of the slabs (memory the client may be lent)."""
        with self._lock:
            slabs = list(self._slabs)
        for a in arrays.values():
            if isinstance(a, np.ndarray) and a.size:
                at = a.__array_interface__["data"][0]
                if any(s.base <= at < s.base + s.size for s in slabs):
                    return True
        return False

    # -- the serving loop ------------------------------------------------------------------------
    def release(self, regions: tuple[int, ...]) -> None:
        """The client no longer holds these regions' batches (ids it was not lent are ignored:
        a session's own releases are all it can free)."""
        with self._lock:
            for region in regions:
                slab = self._lent.pop(region, None)
                if slab is not None:
                    slab.regions.discard(region)
                    self._free_if_done(slab)

    @property
    def lent(self) -> int:
        return len(self._lent)

    def close(self) -> None:
        """Remove the slab files. Mappings go with the last reference to them: the producer may
        still be writing into one, and the client's hold its batches' pages."""
        with self._lock:
            self._closed = True
            slabs, self._slabs = self._slabs, []
            self._free.clear()
            self._lent.clear()
            self._open.clear()
        for slab in slabs:
            self._unlink(slab.path)

    # -- inside ------------------------------------------------------------------------------------
    def _where(self, values: list[tuple[str, np.ndarray]]) -> tuple[_Slab | None, list[int]]:
        """The slab all these arrays lie in, C-contiguous, and their offsets there; else None."""
        with self._lock:
            slab = self._open.get("gather")
        if slab is None or not values:
            return None, []
        offsets = []
        for _, a in values:
            at = a.__array_interface__["data"][0] - slab.base
            if not a.flags.c_contiguous or not 0 <= at <= slab.size - a.nbytes or at % max(1, a.itemsize):
                return None, []
            offsets.append(at)
        # Two names for the same memory (a source that serves one array twice) are copied apart:
        # a client refuses overlapping arrays.
        spans = sorted(zip(offsets, (a.nbytes for _, a in values)))
        if any(at + n > nxt for (at, n), (nxt, _) in zip(spans, spans[1:])):
            return None, []
        return slab, offsets

    def _lay(self, stream: str, sizes: list[int]) -> tuple[_Slab, list[int]] | None:
        """Room for arrays of these sizes in the ``stream``'s open slab, or a slab opened for them."""
        relative, need = layout(sizes)
        with self._lock:
            if self._closed:
                return None
            slab = self._open.get(stream)
            if slab is None or slab.fill + need > slab.size:
                if slab is not None:
                    slab.open = False
                    self._free_if_done(slab)
                    del self._open[stream]
                slab = self._take(need)
                if slab is None:
                    return None
                slab.open, slab.fill = True, 0
                self._open[stream] = slab
            start = slab.fill
            slab.fill += -(-need // ALIGN) * ALIGN
        return slab, [start + r for r in relative]

    def _free_if_done(self, slab: _Slab) -> None:
        if not slab.open and not slab.regions and not self._closed and slab in self._slabs:
            self._free.append(slab)

    def _take(self, need: int) -> _Slab | None:
        """A free slab of at least ``need`` bytes, or a new one (with the lock held)."""
        fits = [s for s in self._free if s.size >= need and _unheld(s)]
        if fits:
            slab = min(fits, key=lambda s: s.size)
            self._free.remove(slab)
            return slab
        if self._refused:
            return None
        if len(self._slabs) >= self.max_slabs:
            unheld = [s for s in self._free if _unheld(s)]
            if not unheld:
                return None
            # At the cap, a free slab too small for this batch makes way for one that fits.
            victim = min(unheld, key=lambda s: s.size)
            self._free.remove(victim)
            self._slabs.remove(victim)
            self._unlink(victim.path)
        n = self._names
        self._names += 1
        made = self._make(n, need)
        if made is not None:
            self._slabs.append(made)
        return made

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def _make(self, n: int, need: int) -> _Slab | None:
        name = f"slab-{self.tag}-{n}"
        path = os.path.join(self.folder, name)
        size = max(GRAIN, -(-need // GRAIN) * GRAIN)
        try:
            fs = os.statvfs(self.folder)
        except OSError as exc:
            self._refuse(path, size, exc)
            return None
        free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
        if free - size < self.keep_free * total:
            self._refuse(path, size, OSError(
                f"it would leave {max(0, free - size) >> 20} MB of the {total >> 20} MB there free, under "
                f"{self.keep_free:.0%}"))
            return None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            self._refuse(path, size, exc)
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            self._unlink(path)
            self._refuse(path, size, exc)
            return None
        finally:
            os.close(fd)
        return _Slab(name, path, mapping, ctypes.addressof(ctypes.c_char.from_buffer(mapping)))

    def _refuse(self, path: str, size: int, exc: OSError) -> None:
        self._refused = True
        log.warning("cannot make a shared-memory slab of %d MB at %s (%s): this client's batches go through "
                    "the socket", size >> 20, path, exc.strerror or exc)
