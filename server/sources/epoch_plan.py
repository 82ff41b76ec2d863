"""An epoch's plan, made a block at a time on the threads that need it (``EpochPlan``), and the
generators its versions shuffle with. What the order is, and how ranks share it:
``fuelline.server.sources.ordering``."""

from __future__ import annotations

import numbers
import threading
import time
from concurrent.futures import Future
from typing import Sequence

import numpy as np

from fuelline.protocol.common.threadnames import name_this_thread

__all__ = ["ORDER_VERSION", "ORDER_VERSIONS", "EpochPlan", "epoch_rng", "block_rng"]


# How the rows of a block are shuffled (``EpochPlan``). A version moves rows to other positions,
# so it is a part of the sequence fingerprint: a client never joins a position of one to another.
ORDER_VERSIONS = (1, 2)
ORDER_VERSION = 2  # the default
AHEAD_BLOCKS = 2  # blocks the plan's thread makes after each block a reader asks for
IDLE_END = 5.0  # seconds the plan's thread waits for work before it ends (a later ask starts another)
# A plan of at most this many rows is made whole where it is started (a millisecond or less): a
# thread of its own, and the round trips to it, would cost small epochs more than the plan does.
INLINE_ROWS = 1 << 16

def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng(_epoch_seeds(seed, epoch))


def block_rng(seed: int, epoch: int, block: int) -> np.random.Generator:
    """The generator that shuffles the rows of block ``block`` of an epoch (order version 2): a
    child of the epoch's seed sequence, independent of every other block's."""
    return np.random.default_rng(np.random.SeedSequence(_epoch_seeds(seed, epoch).entropy, spawn_key=(int(block),)))


def _epoch_seeds(seed: int, epoch: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32, int(epoch)])


def _checked_version(order_version: int) -> int:
    if not isinstance(order_version, numbers.Integral) or isinstance(order_version, bool) or order_version not in ORDER_VERSIONS:
        raise ValueError(f"order_version must be one of {ORDER_VERSIONS}, got {order_version!r}")
    return int(order_version)


class EpochPlan:
    """One epoch's order and the blocks it was mixed in, made a block at a time.

    The units' permutation is drawn at once; the rows of each block are then written and
    shuffled when a reader first needs them, or by the plan's own thread (``start``), which makes
    the blocks readers wait for first, then the ``AHEAD_BLOCKS`` after each block a reader has
    asked for, and otherwise waits: a plan made whole at once (about 0.5 s of a core for 38 M
    rows) took that core from the decodes of the first batches. ``unit_perm`` and ``block_at``
    are known from the start, so a reader's first units are decoded meanwhile.

    How a block's rows are shuffled is the order's version (``ORDER_VERSIONS``):

    * **2** (the default): by a generator of the block's own (``block_rng``). Any block is made
      without the others, so a rank whose rows start at the end of the epoch waits for its own
      block (about 15 ms for a million rows), never for the blocks before it.
    * **1**: by the epoch's generator, each block drawing where the one before left it, so
      block ``b`` is made only after blocks ``0…b-1`` (for 38 M rows the whole plan takes about
      0.6 s, and the last rank waits for most of it). Served for positions saved in that order.

    Attributes:
        unit_perm: the units in serving order.
        shuffle_block: consecutive units of ``unit_perm`` whose rows are mixed together.
        total: rows in the epoch.
        bounds: where each block starts in the order, and the order's end (``n_blocks + 1``).
        order_version: how the blocks are shuffled (above).
    """

    idle_end = IDLE_END
    inline_rows = INLINE_ROWS

    def __init__(self, unit_lengths: np.ndarray, seed: int, epoch: int, shuffle: bool = True, shuffle_block: int = 8,
                 order_version: int = ORDER_VERSION) -> None:
        lengths = np.asarray(unit_lengths, dtype=np.int64)
        if shuffle and shuffle_block < 1:
            raise ValueError(f"shuffle_block must be >= 1, got {shuffle_block}")
        self.order_version = _checked_version(order_version)
        self.total = int(lengths.sum())
        self._unit_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self._seed, self._epoch, self._shuffle = seed, epoch, shuffle
        self._rng: np.random.Generator | None = None  # the epoch's, shared by the blocks of order 1
        if shuffle:
            epoch_gen = epoch_rng(seed, epoch)
            self.unit_perm = epoch_gen.permutation(len(lengths))
            self.shuffle_block = shuffle_block
            if self.order_version == 1:
                self._rng = epoch_gen
        else:
            self.unit_perm, self.shuffle_block = np.arange(len(lengths)), 1
        self._perm_lengths = lengths[self.unit_perm]
        ends = np.concatenate([[0], np.cumsum(self._perm_lengths)]).astype(np.int64)
        bounds = ends[::self.shuffle_block]
        self.bounds = np.append(bounds, self.total) if bounds[-1] != self.total else bounds
        # Row ids in 32 bits where they fit: half the memory to hold and to fault in (a 38 M-row
        # plan is 150 MB), and the same order: a shuffle's draws do not depend on the item size.
        self._order = np.empty(self.total, dtype=np.int32 if self.total < 2**31 else np.int64)
        # A block is made once, by whichever thread needs it first; the others wait for the block
        # they need, not for a lock: a thread that held a lock while it made each block took it
        # straight back for the next one, and a reader of a block already made waited on.
        self._made = [False] * self.n_blocks
        self._all_made = not self.n_blocks
        self._making: set[int] = set()
        self._error: BaseException | None = None
        self._cond = threading.Condition()  # guards the rest
        self._waiters: list[tuple[set[int], Future[None]]] = []  # blocks a reader waits for, its future
        self._asked = [False] * self.n_blocks  # blocks a reader has asked for
        self._soon: set[int] = set()  # blocks after those asked for, which the plan's thread makes ahead
        self._threaded = False  # ``start`` was called: a thread of its own makes what readers wait for
        self._thread: threading.Thread | None = None  # that thread, while it runs (it ends when idle)

    @property
    def n_blocks(self) -> int:
        return len(self.bounds) - 1

    @property
    def chained(self) -> bool:
        """Whether a block is made only after those before it (order 1, shuffled)."""
        return self._rng is not None

    def blocks_made(self) -> list[int]:
        """The blocks made so far."""
        with self._cond:
            return [b for b, made in enumerate(self._made) if made]

    def start(self) -> "EpochPlan":
        """Have a thread of its own make the blocks readers wait for, and those just after the
        blocks they ask for (a daemon: it only computes, and it ends when idle); a plan of at
        most ``inline_rows`` rows is made whole here instead."""
        if self.total <= self.inline_rows:
            self._ensure(range(self.n_blocks))
            return self
        with self._cond:
            self._threaded = True
            self._wake_thread()
        return self

    def _wake_thread(self) -> None:
        """(With ``_cond`` held.) Have the plan's thread look for work, starting it if it ended."""
        if not self._threaded or self._all_made:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._make_rest, name="fuelline-plan", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _make_rest(self) -> None:
        name_this_thread("fl-plan")
        try:
            while (b := self._next_for_thread()) is not None:
                self._ensure([b])
        except BaseException:  # (kept, and raised to every reader that needs what is missing)
            with self._cond:
                self._thread = None

    def _next_for_thread(self) -> int | None:
        """The block the plan's thread makes next: the first a reader waits for, else the first
        of those soon needed; None (and the thread ends) when there is none for ``idle_end``
        seconds, or the plan is made or failed: a thread never holds a plan nobody reads."""
        with self._cond:
            idle_until: float | None = None
            while True:
                block = None if self._error is not None or self._all_made else self._wanted()
                if block is not None or self._error is not None or self._all_made:
                    if block is None:
                        self._thread = None
                    return block
                now = time.monotonic()
                idle_until = now + self.idle_end if idle_until is None else idle_until
                if now >= idle_until:
                    self._thread = None  # (a reader that asks later starts another)
                    return None
                self._cond.wait(idle_until - now)

    def _wanted(self) -> int | None:
        """(With ``_cond`` held.) The block the plan's thread should make now, if any."""
        waited = [b for blocks, _ in self._waiters for b in blocks]
        if self.chained:  # (the next in the chain, even while a reader makes it: then it waits)
            first = next(b for b, made in enumerate(self._made) if not made)
            return first if waited or any(b >= first for b in self._soon) else None
        pick = [b for b in waited if b not in self._making] or [b for b in self._soon if b not in self._making]
        return min(pick) if pick else None

    def prepare(self, block: int) -> None:
        """A reader will start at ``block``: the plan's thread makes it, and the ``AHEAD_BLOCKS``
        after it, while the reader gets ready (its first units are decoded meanwhile)."""
        if not 0 <= block < self.n_blocks or self._made[block]:
            return
        with self._cond:
            if not self._made[block]:
                self._soon.add(block)
                self._wake_thread()
        self._note_asked([block])

    def _note_asked(self, blocks: Sequence[int]) -> None:
        """Blocks a reader asks for: the plan's thread makes the ``AHEAD_BLOCKS`` after each before
        the reader gets there."""
        new = [b for b in blocks if not self._asked[b]]
        if not new:
            return
        with self._cond:
            for b in new:
                self._asked[b] = True
                self._soon.update(a for a in range(b + 1, min(b + 1 + AHEAD_BLOCKS, self.n_blocks)) if not self._made[a])
            self._wake_thread()

    def _ensure(self, blocks: Sequence[int]) -> None:
        """Make ``blocks`` (in ascending order; for a chained plan, every block up to its last),
        here, or wait for the thread already making one of them."""
        for b in blocks:
            with self._cond:
                while not self._made[b] and b in self._making and self._error is None:
                    self._cond.wait()
                if self._error is not None:
                    raise self._error
                if self._made[b]:
                    continue
                self._making.add(b)
            try:
                self._fill_block(b)
            except BaseException as exc:
                with self._cond:
                    self._error = exc
                    self._making.discard(b)
                    self._cond.notify_all()
                    failed, self._waiters = self._waiters, []
                for _, future in failed:
                    future.set_exception(exc)
                raise
            with self._cond:
                self._made[b] = True
                self._making.discard(b)
                self._soon.discard(b)
                self._all_made = all(self._made)
                self._cond.notify_all()
                done = []
                for blocks_left, future in self._waiters:
                    blocks_left.discard(b)
                    if not blocks_left:
                        done.append(future)
                if done:
                    self._waiters = [(left, f) for left, f in self._waiters if left]
            for future in done:
                future.set_result(None)

    def _fill_block(self, b: int) -> None:
        lo, hi = int(self.bounds[b]), int(self.bounds[b + 1])
        k = self.shuffle_block
        at = lo
        # Row ids of the block's units laid end to end, a unit at a time.
        for u, n in zip(self.unit_perm[b * k : (b + 1) * k].tolist(), self._perm_lengths[b * k : (b + 1) * k].tolist()):
            first = int(self._unit_start[u])
            self._order[at:at + n] = np.arange(first, first + n, dtype=self._order.dtype)
            at += n
        if not self._shuffle:
            return
        if self._rng is not None:
            # Order 1: the epoch's generator, where the block before left it (made first).
            assert b == 0 or self._made[b - 1], f"block {b} of a chained plan made before block {b - 1}"
            rng = self._rng
        else:
            rng = block_rng(self._seed, self._epoch, b)
        # Shuffled in place: the same swaps, from the same draws, as permuting an arange of its
        # length and gathering by it, so the same order, without the two temporaries.
        rng.shuffle(self._order[lo:hi])

    def block_at(self, position: int) -> int:
        """The block that position ``position`` of the order (``0 <= position < total``) is in."""
        return int(np.searchsorted(self.bounds, position, side="right")) - 1

    def block_of_row(self, row: int) -> int:
        """The block a row (a global row id) is served in."""
        unit = int(np.searchsorted(self._unit_start, row, side="right")) - 1
        return int(np.flatnonzero(self.unit_perm == unit)[0]) // self.shuffle_block

    def _needed(self, lo: int, hi: int) -> list[int]:
        """The blocks positions ``lo…hi`` (taken modulo ``total``) need, ascending: those they lie
        in, and, in a chained plan, every block before them."""
        if hi <= lo or not self.total:
            return []
        if hi - lo >= self.total:
            return list(range(self.n_blocks))
        start = lo % self.total
        wraps = start + (hi - lo) > self.total  # (around the end: the padding of the last ranks)
        first, last = self.block_at(start), self.block_at((hi - 1) % self.total)
        if self.chained:
            return list(range(self.n_blocks if wraps else last + 1))
        if wraps:
            return sorted({*range(last + 1), *range(first, self.n_blocks)})
        return list(range(first, last + 1))

    def pending(self, lo: int, hi: int) -> "Future[None] | None":
        """None if positions ``lo…hi`` of the order are made; else a future done when they are
        (made on the plan's thread, before the blocks no reader waits for: ``start`` it first,
        or this makes them here)."""
        if self._all_made:
            return None
        blocks = self._needed(lo, hi)
        self._note_asked(blocks)
        if not self._threaded:
            self._ensure(blocks)
            return None
        future: Future[None] = Future()
        with self._cond:
            if self._error is not None:
                future.set_exception(self._error)
                return future
            missing = {b for b in blocks if not self._made[b]}
            if not missing:
                return None
            self._waiters.append((missing, future))
            self._wake_thread()
        return future

    def span(self, lo: int, hi: int) -> np.ndarray:
        """Global row ids at positions ``lo…hi`` of the order, wrapping around its end (the
        padding of the last ranks); waits for (or makes) the blocks they are in. Read-only."""
        if not self._all_made:
            blocks = self._needed(lo, hi)
            self._note_asked(blocks)
            self._ensure(blocks)
        if hi <= self.total:
            out = self._order[lo:hi]
        else:
            out = self._order[(lo % self.total + np.arange(hi - lo, dtype=np.int64)) % self.total] if self.total else self._order[:0]
        out = out.view()
        out.setflags(write=False)
        return out

    @property
    def order(self) -> np.ndarray:
        """Global row ids in serving order (before sharding), the whole epoch. Read-only."""
        return self.span(0, self.total)
