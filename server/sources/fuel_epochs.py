"""One pass over a Fuel-style stream per (split, epoch), shared by every rank and reconnect.

A Fuel stream's ``get_epoch_iterator()`` may draw a new order on every call (a shuffle from a
``numpy.random.RandomState``). So the server calls it once per (split, epoch), the *shared pass*,
and hands its batches out to every session that reads the epoch, whatever its rank or when it
(re)connects: all of them see one order.

The buffer. Batches of a shared pass are held (as ``to_arrays`` made them: the server's own copy
of what the stream yielded, or the stream's arrays where it promised fresh ones; with an xxh3
digest taken as they were read: of each array's bytes, which are also the checksums the batch is
sent with, and of those with the arrays' names, dtypes and shapes) until the buffer passes
``budget`` bytes; then batches are let go in this order:

1. batches no live reader can need: below the slowest reader's next batch, and not a batch a
   reader may still want as padding (padding wraps to an epoch's first batches, so a rank r may
   want any of batches 0..r until the epoch's length is known);
2. batches no live reader needs, looked up rank by rank;
3. any batch, oldest epoch and lowest index first: a rank this far behind the others is logged,
   once per epoch, and reads what it lost again (below).

Once every rank of the world reads the pass, the batches all of them have read are held only up
to an eighth of the budget and ``PASSED_BATCHES`` batches: for a session that reconnects behind its
rank's place (what a session sent over a socket last is also in its memory tier). A rank that has
not started yet keeps the whole budget for its batches.

A batch that was let go, or whose arrays changed since (a stream that broke its promise of fresh
arrays), is read again by a private pass of that reader: a new ``get_epoch_iterator()`` whose
every batch is checked against the digests of the shared pass. A stream that gives another batch
the second time (not deterministic) is refused with a DataError that says why and what to raise,
never served in another order. Passes forgotten for room (more than ``MAX_EPOCHS`` per split) leave the digests of
their first batches, so that a later pass over the same epoch is checked against them too.
"""

from __future__ import annotations

import bisect
import logging
import threading
from array import array
from collections import OrderedDict
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import xxhash

from fuelline.protocol import DataError
from fuelline.protocol.arrays import Checksummed, checksum

__all__ = ["SharedEpochs", "batch_digest"]

log = logging.getLogger("fuelline.server")

ENTRY_OVERHEAD = 256  # bytes counted per held batch besides its arrays, so tiny batches are bounded too
MAX_EPOCHS = 8  # passes kept per split (their iterators, digests and held batches)
FORGOTTEN_DIGESTS = 8  # digests of a forgotten pass's first batches, kept to check a later pass
MAX_FORGOTTEN = 4096  # forgotten passes remembered that way
LOCK_WAIT = 1.0  # seconds a close waits for a stream a session is reading
SCAN = 4096  # held batches looked at, per pass, for ones no reader needs (step 2)
# Once a whole world reads a pass, batches every rank has read take at most 1/PASSED_SHARE of the
# budget. Holding the whole budget of them cost more than it saved: a pass that held 256 MB of 3 MB
# batches wrote each new copy to memory touched for the first time (1.3 ms a copy, against 0.16
# ms into a buffer used again), and short epochs never got past it.
PASSED_SHARE = 8
# and at most this many of them: a local client's batches are copied into its shared memory, and a
# slab is not used again while the pass holds a batch there (``fuelline.server.serving.slabs``).
PASSED_BATCHES = 16


def batch_digest(arrays: dict[str, np.ndarray], known: Mapping[str, int] | None = None) -> tuple[int, Checksummed]:
    """xxh3-64 of a batch's names, dtypes, shapes and bytes, and the batch with the xxh3-64 of
    each array's bytes: the one read of its bytes here serves as its checksums on the wire too.

    Args:
        arrays: the batch; known: checksums of some of its arrays, taken as they were copied.

    Returns:
        (digest, the same arrays as a ``Checksummed``).
    """
    known = known or {}
    sums = {n: known[n] if n in known else checksum(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            for n, a in arrays.items()}
    h = xxhash.xxh3_64()
    for name, a in arrays.items():
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0{sums[name]}\0".encode())
    return h.intdigest(), Checksummed(arrays, sums)


class _Entry:
    __slots__ = ("arrays", "digest", "nbytes")

    def __init__(self, arrays: dict[str, np.ndarray], digest: int) -> None:
        self.arrays = arrays
        self.digest = digest
        self.nbytes = sum(a.nbytes for a in arrays.values()) + ENTRY_OVERHEAD


class Reader:
    """One session's place in an epoch: rank ``rank`` of ``world``, about to take slot ``slot``
    (its ``slot``-th batch of the epoch)."""

    def __init__(self, pass_: "_Pass", rank: int, world: int, slot: int) -> None:
        self.pass_ = pass_
        self.rank, self.world, self.slot = rank, world, slot
        self.private: Iterator | None = None  # a second pass of its own, checked against the shared one
        self.private_next = 0

    def next_index(self) -> int:
        return self.rank + self.slot * self.world

    def pad_limit(self, total: int | None) -> int:
        """The highest batch this reader may still want as padding, -1 for none."""
        if total is None:
            return self.rank  # (padding index (r - length) mod world is at most r)
        if total == 0:
            return -1
        last = -(-total // self.world) - 1
        g = self.rank + last * self.world
        return g % total if self.slot <= last and g >= total else -1

    def needs(self, g: int, total: int | None) -> bool:
        if g >= self.next_index() and (g - self.rank) % self.world == 0 and (total is None or g < total):
            return True
        return g <= self.rank if total is None else g == self.pad_limit(total)


class _Pass:
    """The shared pass over one (split, epoch) and the batches of it held."""

    def __init__(self, split: str, epoch: int, expected: array | None) -> None:
        self.split, self.epoch = split, epoch
        self.iterator: Iterator | None = None
        self.read = 0  # batches the shared pass has taken from the stream
        self.total: int | None = None  # its length, once it ended
        self.failed: tuple[int, str] | None = None  # (batch, why): the stream failed there
        self.digests = array("Q")
        self.expected = expected  # digests of an earlier, forgotten pass's first batches
        self.held: dict[int, _Entry] = {}
        self.keys: list[int] = []  # of ``held``, ascending
        self.readers: set[Reader] = set()
        self.used = 0  # when last read (SharedEpochs' clock)
        self.warned_behind = False

    def drop(self, g: int) -> int:
        entry = self.held.pop(g, None)
        if entry is None:
            return 0
        del self.keys[bisect.bisect_left(self.keys, g)]
        return entry.nbytes


class SharedEpochs:
    """The shared passes of one ``FuelStreamSource``.

    Args:
        open_epoch: ``split -> iterator`` (calls the stream's ``get_epoch_iterator()``).
        to_arrays: ``(batch, index, mine) -> {source: array}``, called under the split's lock as
            soon as the stream yields; raises DataError. A ``Checksummed`` result's checksums are
            kept. ``mine``: the batch is the one the calling reader asked for (not one it read
            past on another rank's behalf).
        locks: per split, the lock every call into that split's stream holds (streams are not
            required to be thread-safe).
        budget: bytes of batches held at most.
    """

    def __init__(
        self, open_epoch: Callable[[str], Iterator], to_arrays: Callable[[Any, int, bool], dict[str, np.ndarray]],
        locks: dict[str, threading.Lock], budget: int,
    ) -> None:
        self._open = open_epoch
        self._to_arrays = to_arrays
        self._stream_locks = locks
        self.budget = budget
        self._lock = threading.Lock()  # guards everything below; never held while a stream runs
        self._passes: OrderedDict[tuple[str, int], _Pass] = OrderedDict()
        self._forgotten: OrderedDict[tuple[str, int], array] = OrderedDict()
        self._clock = 0
        self.held_bytes = 0
        self.peak_bytes = 0
        self._warned_changed = False

    # -- readers -----------------------------------------------------------------------------
    def reader(self, split: str, epoch: int, rank: int, world: int, slot: int) -> Reader:
        forgotten = None
        with self._lock:
            p = self._passes.get((split, epoch))
            if p is None:
                p = _Pass(split, epoch, self._forgotten.pop((split, epoch), None))
                self._passes[(split, epoch)] = p
                forgotten = self._forget_old(split)
            r = Reader(p, rank, world, slot)
            p.readers.add(r)
        if forgotten is not None:
            self._close_iterator(forgotten.iterator, split)
            forgotten.iterator = None
        return r

    def release(self, reader: Reader) -> None:
        with self._lock:
            reader.pass_.readers.discard(reader)
        self._close_private(reader)

    def total(self, reader: Reader) -> int | None:
        return reader.pass_.total

    def get(self, reader: Reader, g: int) -> dict[str, np.ndarray] | None:
        """Batch ``g`` of the reader's epoch (all sources), or None past the epoch's end."""
        p = reader.pass_
        while True:
            with self._lock:
                self._clock += 1
                p.used = self._clock
                entry = p.held.get(g)
                if entry is None:
                    if p.total is not None and g >= p.total:
                        return None
                    if p.failed is not None and g >= p.failed[0]:
                        raise DataError(p.failed[1])
                    private = g < p.read
            if entry is not None:
                digest, arrays = batch_digest(entry.arrays)
                if digest == entry.digest:
                    return arrays  # (with the checksums just taken: what is sent is what was checked)
                self._changed(p, g, entry)
                private = True
            if private:
                return self._read_privately(reader, g)
            got = self._pull(p, g)
            if got is not None:
                return got

    # -- the shared pass ---------------------------------------------------------------------
    def _pull(self, p: _Pass, g: int) -> dict[str, np.ndarray] | None:
        """Take the shared pass's next batch; returns it if it is batch ``g``."""
        with self._stream_locks[p.split]:
            with self._lock:
                if p.read > g or p.total is not None or p.failed is not None:
                    return None  # another reader took it meanwhile: look again
                i = p.read
            try:
                if p.iterator is None:
                    p.iterator = iter(self._open(p.split))
                batch = next(p.iterator)
            except StopIteration:
                with self._lock:
                    p.total, p.iterator = i, None
                return None
            except Exception as exc:
                # The pass cannot go on (a generator that raised is finished): the other readers
                # hear why rather than meet a short epoch. This reader reports it as raised.
                with self._lock:
                    p.failed = (i, f"the stream raised {type(exc).__name__} at batch {i} of the epoch: {exc}")
                raise
            try:
                arrays = self._to_arrays(batch, i, i == g)
            except DataError as exc:
                with self._lock:
                    p.failed = (i, str(exc))
                raise
            digest, arrays = batch_digest(arrays, getattr(arrays, "checksums", None))
            with self._lock:
                if p.expected is not None and i < len(p.expected) and p.expected[i] != digest:
                    p.failed = (i, self._not_deterministic(p, i, "the pass this server forgot for room"))
                    raise DataError(p.failed[1])
                p.digests.append(digest)
                p.read = i + 1
                entry = _Entry(arrays, digest)
                p.held[i] = entry
                p.keys.append(i)
                self.held_bytes += entry.nbytes
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
                self._trim_passed(p)
                if self.held_bytes > self.budget:
                    self._make_room(p, i)
        return arrays if i == g else None

    def _read_privately(self, reader: Reader, g: int) -> dict[str, np.ndarray]:
        """Batch ``g`` (read by the shared pass, no longer held) from a pass of the reader's own,
        every batch checked against the shared pass's digest."""
        p = reader.pass_
        if reader.private is None or reader.private_next > g:
            self._close_private(reader)
            log.info(
                "split %r, epoch %d: batch %d is no longer held for rank %d of %d; reading the stream again "
                "from the epoch's start for it", p.split, p.epoch, g, reader.rank, reader.world,
            )
            with self._stream_locks[p.split]:
                reader.private = iter(self._open(p.split))
            reader.private_next = 0
        while True:
            i = reader.private_next
            with self._stream_locks[p.split]:
                try:
                    batch = next(reader.private)
                except StopIteration:
                    raise DataError(self._not_deterministic(p, i, f"a pass that ended after {i} batches")) from None
                # (Under the lock: another pass's next() may refill a buffer this batch shares.)
                arrays = self._to_arrays(batch, i, i == g)
            reader.private_next = i + 1
            with self._lock:
                want = p.digests[i]
            digest, checked = batch_digest(arrays, getattr(arrays, "checksums", None))
            if digest != want:
                raise DataError(self._not_deterministic(p, i, "its first pass"))
            if i == g:
                return checked

    def _close_private(self, reader: Reader) -> None:
        it, reader.private = reader.private, None
        self._close_iterator(it, reader.pass_.split)

    def _close_iterator(self, it: Iterator | None, split: str) -> None:
        """Close an iterator left part-way now, not whenever the collector gets to it; but never
        wait long behind a stream a session is reading (a stuck one would hold this forever)."""
        close = getattr(it, "close", None)
        if close is None:
            return
        lock = self._stream_locks[split]
        if lock.acquire(timeout=LOCK_WAIT):
            try:
                close()
            except Exception:
                log.debug("closing an epoch iterator of split %r failed", split, exc_info=True)
            finally:
                lock.release()

    def _not_deterministic(self, p: _Pass, i: int, other: str) -> str:
        return (
            f"split {p.split!r}, epoch {p.epoch}: the stream's get_epoch_iterator() gave a different batch {i} "
            f"than {other} did (its order is not the same on every call: a shuffle drawn from a "
            f"RandomState, say), and the batches a rank needed were no longer held; serving them "
            f"would give this rank another order than the others. Read an epoch with all ranks "
            f"together, or hold more: FuelStreamSource(stream, buffer_mb=...) (now "
            f"{self.budget // 2**20} MB)"
        )

    def _changed(self, p: _Pass, g: int, entry: _Entry) -> None:
        with self._lock:
            if p.held.get(g) is entry:
                self.held_bytes -= p.drop(g)
            warn, self._warned_changed = not self._warned_changed, True
        if warn:
            log.warning(
                "split %r, epoch %d: batch %d changed after the stream yielded it (written to since: a "
                "stream served with fresh_arrays=True that reuses its arrays?); such batches are read "
                "again for the ranks that need them", p.split, p.epoch, g,
            )

    # -- room --------------------------------------------------------------------------------
    def _trim_passed(self, p: _Pass) -> None:
        """Hold at most ``PASSED_SHARE`` of the budget in batches every rank has read already,
        once a whole world reads the pass: they are kept only for a session that reconnects
        behind its rank's place, and what the sessions sent last is in their memory tiers."""
        readers = list(p.readers)
        worlds = {r.world for r in readers}
        if len(worlds) != 1 or len({r.rank for r in readers}) != next(iter(worlds)):
            return  # (a rank not reading yet will want its batches: the budget holds them)
        low = min(r.next_index() for r in readers)
        pad = max(r.pad_limit(p.total) for r in readers)
        lo = bisect.bisect_right(p.keys, pad)
        hi = bisect.bisect_left(p.keys, low)
        passed = sum(p.held[g].nbytes for g in p.keys[lo:hi])
        allowed = self.budget // PASSED_SHARE
        while lo < hi and (passed > allowed or hi - lo > PASSED_BATCHES):
            dropped = p.drop(p.keys[lo])
            passed -= dropped
            self.held_bytes -= dropped
            hi -= 1

    def _make_room(self, fresh: _Pass, i: int) -> None:
        """Let batches go, in the order the module docstring gives, until under budget; batch
        ``i`` of ``fresh``, just read and in its reader's hands, goes last."""
        passes = sorted(self._passes.values(), key=lambda q: q.used)
        for stage in (self._drop_passed, self._drop_unneeded):
            for p in passes:
                if stage(p):
                    return
        for p in passes:
            if self._drop_needed(p, fresh, i):
                return
        self.held_bytes -= fresh.drop(i)  # (larger than the whole budget on its own)

    def _drop_passed(self, p: _Pass) -> bool:
        """1: what is below every reader and past every padding candidate. True: under budget."""
        readers = list(p.readers)
        low = min((r.next_index() for r in readers), default=None)
        pad = max((r.pad_limit(p.total) for r in readers), default=-1)
        lo = bisect.bisect_right(p.keys, pad)
        hi = len(p.keys) if low is None else bisect.bisect_left(p.keys, low)
        while lo < hi and self.held_bytes > self.budget:
            self.held_bytes -= p.drop(p.keys[lo])
            hi -= 1
        return self.held_bytes <= self.budget

    def _drop_unneeded(self, p: _Pass) -> bool:
        """2: what no reader needs, rank by rank. True: under budget."""
        readers = list(p.readers)
        for g in [g for g in p.keys[:SCAN] if not any(r.needs(g, p.total) for r in readers)]:
            self.held_bytes -= p.drop(g)
            if self.held_bytes <= self.budget:
                return True
        return False

    def _drop_needed(self, p: _Pass, fresh: _Pass, i: int) -> bool:
        """3: what a reader far behind needs (told once a pass); batch ``i`` of ``fresh`` kept.
        True: under budget."""
        while p.keys and self.held_bytes > self.budget:
            g = p.keys[0]
            if p is fresh and g == i:
                if len(p.keys) == 1:
                    break
                g = p.keys[1]
            behind = [r for r in p.readers if r.needs(g, p.total)]
            if behind and not p.warned_behind:
                p.warned_behind = True
                r = min(behind, key=Reader.next_index)
                log.warning(
                    "split %r, epoch %d: the Fuel stream's buffer is full (%d MB) and rank %d of %d is "
                    "%d batch(es) behind the stream; it will read the stream again for what it lost, which "
                    "a stream that is not deterministic cannot serve (FuelStreamSource(buffer_mb=...) holds "
                    "more)", p.split, p.epoch, self.budget // 2**20, r.rank, r.world, p.read - r.next_index(),
                )
            self.held_bytes -= p.drop(g)
        return self.held_bytes <= self.budget

    def _forget_old(self, split: str) -> _Pass | None:
        """Past MAX_EPOCHS passes of a split, forget the least recently read one nobody reads;
        returns it (its iterator is closed once this lock is let go)."""
        mine = [p for p in self._passes.values() if p.split == split]
        idle = [p for p in mine if not p.readers]
        if len(mine) <= MAX_EPOCHS or not idle:
            return None  # (a pass with readers stays: sessions are bounded by the server)
        p = min(idle, key=lambda q: q.used)
        del self._passes[(p.split, p.epoch)]
        for g in list(p.keys):
            self.held_bytes -= p.drop(g)
        self._forgotten[(p.split, p.epoch)] = p.digests[:FORGOTTEN_DIGESTS]
        while len(self._forgotten) > MAX_FORGOTTEN:
            self._forgotten.popitem(last=False)
        return p

    def close(self) -> None:
        with self._lock:
            passes, self._passes = list(self._passes.values()), OrderedDict()
            self.held_bytes = 0
        for p in passes:
            p.held.clear()
            p.keys.clear()
            it, p.iterator = p.iterator, None
            self._close_iterator(it, p.split)
