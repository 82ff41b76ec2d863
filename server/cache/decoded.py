"""Decoded units (recordings, row groups) kept in the serving process, shared by every client.

Each client's reader decodes whole blocks of units and keeps the rows of its own rank, so without
sharing, the W ranks of one job make a server decode every unit W times an epoch, and every epoch
decodes the data set again. ``DecodedUnits`` is the one place a reader asks for a unit: the first
asker's request is decoded, every later asker gets the same future (in flight or done), and
finished units stay in memory, least recently asked for evicted first, within a byte budget. A
data set whose decoded form fits the budget is decoded once for as long as the server runs.

Decoding is a pure function of (split, unit, columns), so a kept unit is exactly what decoding it
again would give; its arrays are made read-only, since every reader shares them.

A unit evicted from the budget may still be in a reader's hands (the block it gathers from). The
ranks of a job drift apart, and one that asks for the unit a moment later would decode it again,
while the arrays are still in memory. So an evicted unit is remembered by weak references to its
arrays: while a reader still holds them, a request gets those same arrays back, and the unit
counts against the budget again; once every reader has let them go, the memory is freed as
before and the next request decodes. This costs no memory: nothing is kept that a reader does not
hold anyway.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from typing import Callable, Hashable

import numpy as np

from fuelline.server.sources.counters import Counts

__all__ = ["DecodedUnits", "held_bytes"]


class _Slot(Future):
    """The future readers are given for a unit: it takes its decode's outcome (``take``), and
    cancelling it cancels the decode, or fails, as a pool's future does, once that has started.

    Only the decode refers to the slot (its callback), and the slot to the decode only until the
    outcome is in: no reference cycle, so an evicted unit's memory goes as soon as the last reader
    lets it go, not whenever the cyclic garbage collector next runs."""

    work: Future | None = None

    def cancel(self) -> bool:
        work = self.work
        if work is not None and not work.cancel():
            return False  # decoding or done: its outcome is on its way
        return super().cancel()

    def take(self, work: Future) -> None:
        """The decode's outcome (unless a reader cancelled this meanwhile)."""
        self.work = None
        try:
            if work.cancelled():
                super().cancel()
            elif (exc := work.exception()) is not None:
                self.set_exception(exc)
            else:
                self.set_result(work.result())
        except InvalidStateError:
            pass  # cancelled by a reader meanwhile


def held_bytes(arrays: dict) -> int:
    """The memory a decoded unit's arrays hold: each buffer they are views of, counted once. A
    unit's windows may be overlapping views of one grid (``fuelline.server.multimodal.grid``),
    which hold the grid's bytes, not the sum of the windows' sizes."""
    owners: dict[int, int] = {}
    for arr in arrays.values():
        if not isinstance(arr, np.ndarray):
            continue
        owner, obj = arr, arr.base
        while obj is not None:  # (through numpy's own wrappers, e.g. a sliding window's)
            if isinstance(obj, np.ndarray):
                owner = obj
            obj = getattr(obj, "base", None)
        owners[id(owner)] = owner.nbytes
    return sum(owners.values())


class DecodedUnits:
    """Futures of decoded units by key, within ``budget_bytes`` of finished results.

    Counters: ``cache_decoded_hits`` (a request served by a unit kept or in flight, or evicted and
    still held by a reader), ``cache_decoded_misses`` (a request that had it decoded),
    ``cache_decoded_evictions``, ``cache_decoded_revived`` (of the hits, units evicted and still held).
    A failed or cancelled decode is not kept: the next request tries again.
    """

    def __init__(self, budget_bytes: int, counters: Counts) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget = budget_bytes
        self.counters = counters
        self._lock = threading.Lock()
        self._units: OrderedDict[Hashable, Future] = OrderedDict()
        self._sizes: dict[Hashable, int] = {}  # finished units only
        self._held = 0
        # Evicted units, by weak references to their arrays (see the module's docstring).
        self._evicted: dict[Hashable, dict[str, weakref.ref]] = {}

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held

    def __len__(self) -> int:
        with self._lock:
            return len(self._units)

    def get(self, key: Hashable, decode: Callable[[], Future]) -> Future:
        """The future of unit ``key``: the one kept or in flight, else one that ``decode()``'s
        outcome is passed on to. Cancelling it cancels the decode; once that has started, it
        cannot be cancelled (as a pool's own future).

        ``decode()`` (a pool's submit) is called without the lock held: a thread pool that shuts
        down cancels its queued futures under its own lock, and their callbacks take this one.

        Raises:
            whatever ``decode()`` raises (a pool already shut down); the unit is not kept.
        """
        with self._lock:
            kept = self._units.get(key)
            if kept is not None and not kept.cancelled():
                self._units.move_to_end(key)
                self.counters.add("cache_decoded_hits")
                return kept
            revived = self._revive(key)
            if revived is not None:
                self.counters.add("cache_decoded_hits")
                return revived
            slot = _Slot()
            self._units[key] = slot
            self._units.move_to_end(key)
            self.counters.add("cache_decoded_misses")
        try:
            work = decode()
        except BaseException as exc:
            with self._lock:
                if self._units.get(key) is slot:
                    del self._units[key]
            try:
                slot.set_exception(exc)  # (for any reader that was handed the slot meanwhile)
            except InvalidStateError:
                pass  # (one cancelled it)
            raise
        slot.work = work
        if slot.cancelled():
            work.cancel()  # (a reader cancelled it before it had its decode)
        slot.add_done_callback(lambda f: self._finished(key, f))
        work.add_done_callback(slot.take)
        return slot

    def _finished(self, key: Hashable, future: Future) -> None:
        failed = future.cancelled() or future.exception() is not None
        size = 0
        if not failed:
            arrays = future.result()
            for arr in arrays.values():
                if isinstance(arr, np.ndarray):
                    arr.setflags(write=False)  # shared by every reader from now on
            size = held_bytes(arrays)
        with self._lock:
            if self._units.get(key) is not future:
                return  # replaced meanwhile (it had been cancelled and asked for again)
            if failed:
                del self._units[key]
                return
            self._sizes[key] = size
            self._held += size
            self._evict()

    def _evict(self) -> None:
        """Drop finished units, least recently asked for first, until the rest fit the budget."""
        if self._held <= self.budget:
            return
        for key in list(self._units):
            if self._held <= self.budget:
                break
            size = self._sizes.pop(key, None)
            if size is None:
                continue  # still decoding: whoever waits for it holds it
            arrays = self._units.pop(key).result()
            self._held -= size
            self.counters.add("cache_decoded_evictions")
            if all(isinstance(a, np.ndarray) for a in arrays.values()):
                self._evicted[key] = {name: weakref.ref(a) for name, a in arrays.items()}
        if len(self._evicted) > 4 * len(self._units) + 64:  # (the dead ones, now and then)
            self._evicted = {k: refs for k, refs in self._evicted.items() if all(r() is not None for r in refs.values())}

    def _revive(self, key: Hashable) -> Future | None:
        """An evicted unit whose arrays a reader still holds, kept again (the lock held)."""
        refs = self._evicted.pop(key, None)
        if refs is None:
            return None
        arrays = {name: ref() for name, ref in refs.items()}
        if any(a is None for a in arrays.values()):
            return None  # every reader let it go: freed
        future: Future = Future()
        future.set_result(arrays)
        size = held_bytes(arrays)
        self._units[key] = future
        self._sizes[key] = size
        self._held += size
        self.counters.add("cache_decoded_revived")
        self._evict()  # (others make room; this one is the most recent)
        return future

    def clear(self) -> None:
        with self._lock:
            self._units.clear()
            self._sizes.clear()
            self._evicted.clear()
            self._held = 0
