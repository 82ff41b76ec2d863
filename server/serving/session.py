"""One client's session on a server: its position, its credit, and its producer, which prepares
its batches.

The producer runs ahead of the client by at most ``hwm`` prepared batches; the serving loop sends
them while the client has credit and fewer than ``hwm`` batches in flight. So a session holds at
most 2 × hwm batches however slow its client, and a client's memory holds at most its own hwm.
The producer starts with the client's first credit: a session never granted any holds no batch,
so idle connections cost the server next to nothing.

The production is one generator (``_production``) of steps: it queues each item for the loop to
send and yields; where the next batch's decodes are still running it yields their futures (a
``Waiting``). Two drivers step it the same way, and differ only in where they wait:

- the serving loop, for a ``cooperative`` source (one whose decodes run on threads or processes of
  its own: Parquet, aligned windows), between requests (``advance``), a few batches at a time:
  while a batch's units are decoded it serves the others, and is rung once they are done. One
  thread then does all of a batch's work, with no hand-off of the interpreter lock between a
  producer and the loop for each batch;
- a producer thread of the session's own, for any other source (a Fuel-style stream, which may
  block on anything): it waits for room in the queue before each step, and for a ``Waiting``'s
  futures, and rings the loop for what it queued.

Either way a step is taken only while the queue has room, so a session never holds a prepared
batch beyond its queue.

Credit is believed only as far as an honest client could grant it (``grant``): the server never
counts more than hwm batches as granted or in flight, and a client that returns credit for more
batches than it could hold is refused, so a lie cannot make the server queue more.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future, wait
from typing import Any, Callable, ContextManager, Generator

import numpy as np

from fuelline.protocol import Batch, DataError, EndOfEpoch, Error, ErrorCode, Hello, ProtocolError, encode
from fuelline.protocol.arrays import wire_array
from fuelline.protocol.codec import batch_checksums, encode_placed
from fuelline.protocol.common.threadnames import name_this_thread
from fuelline.server.cache.memory import RecentBatches, Remembered
from fuelline.server.serving.slabs import SessionSlabs
from fuelline.server.sources.buffers import allocating
from fuelline.server.sources.contract import BatchSource, Waiting

__all__ = ["Session"]

log = logging.getLogger("fuelline.server")

# An item ready to send: (kind, frames, bytes of its arrays); kind "batch" needs credit, the others do not.
Outgoing = tuple[str, list[Any], int]
# The producer's steps (``_production``): None after each item put, a ``Waiting`` where the next
# batch waits for decodes.
Production = Generator["Waiting | None", None, None]
_ENDED = object()  # (what ``next`` gives a producer thread for a production that ended)


class Session:
    """A client connection's session; the serving loop owns its socket side.

    Args:
        peer: the connection's remote address (``"local"`` over ipc), for caps and logs.
        max_heartbeat: the longest heartbeat interval the server lets a client claim: a silent
            client is dropped after 3 intervals, so this bounds how long a mute one is kept.
        slabs: where to place its batches in shared memory (a local client that asked for it),
            or None: every batch goes over the socket.
        clock: the time, in seconds (the serving core's).
    """

    def __init__(
        self,
        routing_id: bytes,
        hello: Hello,
        source: BatchSource,
        sources: tuple[str, ...],
        hwm: int,
        checksum: bool,
        wake: Callable[[], None],
        name: str,
        recent: RecentBatches | None = None,
        *,
        peer: str = "local",
        max_heartbeat: float = 3600.0,
        slabs: SessionSlabs | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.routing_id = routing_id
        self.hello = hello
        self.sources = sources
        self.name = name
        self.peer = peer
        self.hwm = hwm
        # A client whose hwm is larger than the server's asks for more; the server's hwm decides.
        self.credit = min(hello.credit, hwm)
        self.credit_heard = hello.credit  # credit the client granted, all told (see credit_lost)
        self.in_flight = 0
        self.granted = self.credit > 0  # the client has made room for a batch at least once
        self.client_heartbeat = min(hello.heartbeat, max_heartbeat)
        self._clock = clock
        self.created = self.last_heard = self.last_sent = clock()
        self.last_granted = self.created  # (a Hello's credit is granted as it arrives; see stalled_for)
        self.sent_batches = 0
        # Since when the peer's send queue has been full (libzmq's SNDHWM), with items waiting
        # here to go; None while it takes what is sent.
        self.blocked_since: float | None = None
        self.sent_items = 0  # batches and ends of epoch the loop has sent (see Heartbeat.sent)
        # Credit returned for batches this session did not send (see grant).
        self._returned_unsent = 0
        self._unsent_allowed = max(hwm, hello.credit)
        self._source = source
        self._recent = recent
        # A unit source never writes a batch's arrays again; a Fuel stream may reuse its buffers
        # (see _remembered).
        self._immutable = bool(source.immutable_batches)
        # What a cached batch must have been prepared for, besides its client and position.
        self._request = (hello.split, hello.rank, hello.world_size, hello.history, sources)
        self._checksum = checksum
        self.slabs = slabs
        self._wake = wake
        self._ready: deque[Outgoing] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._producer_waiting = False
        self._thread: threading.Thread | None = None
        # Stepped by the serving loop (``advance``), not by a thread of its own.
        self.inline = bool(source.cooperative)
        self._started = False
        self._steps: Production | None = None  # inline: the production, while it runs
        self._waiting: tuple[Future, ...] = ()  # inline: the decodes its next batch needs

    @property
    def queued(self) -> int:
        """Items prepared and not yet sent (waiting for the client's credit)."""
        return len(self._ready)

    @property
    def sendable(self) -> bool:
        """Whether ``take_sendable`` would give anything now (a racy look, for the loop's turn: a
        producer that queues an item rings the loop, which looks again)."""
        ready = self._ready
        try:
            return bool(ready) and (ready[0][0] != "batch" or (self.credit > 0 and self.in_flight < self.hwm))
        except IndexError:  # (emptied meanwhile)
            return False

    @property
    def can_advance(self) -> bool:
        """Inline: whether ``advance`` would prepare a batch now (room for it, and no decode to
        wait for)."""
        return (
            self._steps is not None and not self._stopped and len(self._ready) < self.hwm
            and all(f.done() for f in self._waiting)
        )

    @property
    def producer_alive(self) -> bool:
        """Whether the producer thread is still running (it may, for a moment, after ``stop``)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start preparing batches if the client has granted credit; else the first ``grant``
        that leaves credit does.

        Raises:
            RuntimeError: no thread could be started (the process is at its thread limit).
        """
        if self._started or self.credit <= 0 or self._stopped:
            return
        if self.inline:
            self._steps = self._production()
        else:
            thread = threading.Thread(target=self._produce, name=f"fuelline-{self.name}", daemon=True)
            thread.start()
            self._thread = thread  # (only once started: a failed start leaves nothing to join)
        self._started = True

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._ready.clear()
            self._cond.notify_all()
        steps, self._steps = self._steps, None
        if steps is not None:
            steps.close()  # (its reader lets go of its decodes and blocks, before its slabs go)
        if self.slabs is not None:
            self.slabs.close()

    def release(self, regions: tuple[int, ...]) -> None:
        """The client let go of the batches placed in these shared-memory regions."""
        if self.slabs is not None and regions:
            self.slabs.release(regions)

    def join(self, timeout: float) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    # -- serving loop side ---------------------------------------------------------------------
    def grant(self, n: int) -> None:
        """The client made room for ``n`` more batches.

        An honest client keeps what it was sent and has not taken, plus its credit, within its
        hwm; so the server believes at most its own hwm of credit and batches in flight. Credit
        for batches this session never sent is a reconnecting client's, for batches it still
        held from its connection before: its Hello asked for its hwm minus those. The server
        does not know that hwm, and allows the larger of its own and the Hello's credit.

        The first credit of a session whose Hello granted none is the credit that Hello held
        back (a client that might have moved to the server's Unix socket): it is taken as a
        Hello's credit would have been.

        Raises:
            ProtocolError: credit no honest client could grant (the session must end).
        """
        self.last_granted = self._clock()
        self.credit_heard += n
        if not self.granted:
            self._unsent_allowed = max(self._unsent_allowed, n)
            self.credit = min(n, self.hwm - self.in_flight)
            self.granted = True
            return
        self._returned_unsent += max(0, n - self.in_flight)
        if self._returned_unsent > self._unsent_allowed:
            raise ProtocolError(
                f"credit for {n} batches with {self.in_flight} in flight: a client returns credit for the batches "
                f"it was sent, and for at most {self._unsent_allowed} it held from an earlier connection"
            )
        self.in_flight = max(0, self.in_flight - n)
        self.credit = min(self.credit + n, self.hwm - self.in_flight)
        self.granted = True

    def credit_lost(self, granted: int) -> int:
        """Credit the client says it granted (``granted``, in all, in a heartbeat) and that never
        arrived: lost in transit with a connection libzmq reset and reconnected."""
        return max(0, granted - self.credit_heard)

    def advance(self, until: float) -> None:
        """Inline: prepare batches on this thread (the serving loop's) until ``hwm`` are ready,
        the next one waits for a decode (whose end rings the loop), the session's producer ends,
        or the clock passes ``until`` (a gather of several batches may take it past)."""
        if not self.can_advance:
            return
        assert self._steps is not None
        self._waiting = ()
        with self._allocating():
            while len(self._ready) < self.hwm:
                try:
                    step = next(self._steps)
                except StopIteration:
                    self._steps = None
                    return
                if step is not None:
                    self._waiting = step.futures
                    for future in step.futures:
                        future.add_done_callback(self._decoded)
                    return
                if self._clock() >= until:
                    return

    def _decoded(self, _future: Future) -> None:
        self._wake()

    def stalled_for(self, now: float) -> float:
        """Seconds this session has waited on its client: since its last grant of credit (or its
        Hello), where it has no credit left (its client holds every batch it asked for, or never
        asked for any); 0 while it has credit the server has not used yet, for then it waits on
        the server (its next batch is still being prepared), not on its client."""
        return 0.0 if self.credit > 0 else now - self.last_granted

    def take_sendable(self) -> list[Outgoing]:
        """Items the loop may send now, in order, with their credit already taken."""
        out: list[Outgoing] = []
        if not self._ready:
            return out  # (a racy peek is fine: a producer that appends rings the loop again)
        with self._cond:
            while self._ready:
                kind = self._ready[0][0]
                if kind == "batch":
                    if self.credit <= 0 or self.in_flight >= self.hwm:
                        break
                    self.credit -= 1
                    self.in_flight += 1
                    self.sent_batches += 1
                out.append(self._ready.popleft())
            if out and self._producer_waiting:
                self._cond.notify()  # only the producer ever waits, and notify costs even with none
        return out

    def requeue(self, items: list[Outgoing]) -> None:
        """Items ``take_sendable`` gave that could not be sent (the peer's queue was full): back
        at the head, in order, with their credit, to go first once there is room."""
        with self._cond:
            for item in reversed(items):
                if item[0] == "batch":
                    self.credit += 1
                    self.in_flight -= 1
                    self.sent_batches -= 1
                self._ready.appendleft(item)

    def put_first(self, *items: Outgoing) -> None:
        """Items to go, in order, before anything prepared (Welcomes)."""
        with self._cond:
            self._ready.extendleft(reversed(items))

    def unsent_welcomes(self) -> list[Outgoing]:
        """The Welcomes still waiting for room in the peer's queue."""
        with self._cond:
            return [item for item in self._ready if item[0] == "welcome"]

    # -- the producer ---------------------------------------------------------------------------
    def _put(self, item: Outgoing) -> bool:
        """Queue an item for the loop to send (its driver stepped the production only while the
        queue had room). False: the session stopped."""
        with self._cond:
            if self._stopped:
                return False
            self._ready.append(item)
        return True

    def _report_loss(self, message: str) -> None:
        """Data left out under --on-bad-shard skip: the client is told, in order with its batches."""
        self._put(("notice", encode(Error(ErrorCode.DATA_LOSS, message, fatal=False)), 0))

    def _remembered(self, epoch: int, seq: int) -> dict[str, Any] | None:
        """Batch ``seq`` from the memory tier, if it holds it unchanged. A Fuel stream's arrays
        are kept by reference with the checksums they were sent with: one that changed since
        (a stream reusing its buffers) is not sent again, and the client's batches are dropped."""
        h, recent = self.hello, self._recent
        if recent is None:
            return None
        entry = recent.get(h.client_id, self._request, epoch, seq)
        if entry is None:
            return None
        arrays, sent_with = entry
        if sent_with is not None:
            now = tuple(wire_array(name, a, with_checksum=True)[0].checksum for name, a in arrays.items())
            if now != sent_with:
                log.warning("session %s: batch %d:%d changed after it was sent (the stream reuses its arrays); "
                            "preparing it again", self.name, epoch, seq)
                recent.reject(h.client_id)
                return None
        return arrays

    def _remember(self, epoch: int, seq: int, arrays: dict[str, Any], frames: list[Any], keepable: bool) -> None:
        recent = self._recent
        if recent is None:
            return
        if not keepable:
            recent.misses += 1  # (built in a slab, which is used again once the client lets it go)
            return
        if not self._immutable and (not self._checksum or len(frames) == 1):
            # (a reused buffer could not be told from the batch sent: no checksums, or placed in shared memory)
            recent.misses += 1
            return
        entry = Remembered(arrays, None if self._immutable else batch_checksums(frames))
        # Under the lock ``stop`` takes: once a session has stopped it remembers nothing, so a
        # client forgotten after its Bye stays forgotten.
        with self._cond:
            if not self._stopped:
                recent.put(self.hello.client_id, self._request, epoch, seq, entry)

    def _batches(self, epoch: int, start: int) -> Generator[tuple[dict[str, Any], bool] | Waiting, None, None]:
        """(arrays, prepared now) for batches ``start…`` of an epoch: from the memory tier while
        it holds them (a client that reconnects asks again for what was just sent), then from
        the source; inline, a ``Waiting`` where the source's next batch is still being decoded."""
        h = self.hello
        seq = start
        while (arrays := self._remembered(epoch, seq)) is not None:
            yield arrays, False
            seq += 1
        # The first epoch may be one resumed from another world size (Hello.history).
        history = h.history if h.history and epoch == h.epoch else ()
        batches = self._source.iter_steps(h.split, epoch, h.rank, h.world_size, seq, self.sources, on_loss=self._report_loss, history=history)
        try:
            for step in batches:
                yield step if isinstance(step, Waiting) else (step, True)
        finally:
            batches.close()

    def _encode(self, batch: Batch) -> tuple[list[Any], int, bool]:
        """A batch's frames, placed in shared memory where this session can; its bytes; and
        whether its arrays are the producer's to keep (not built in a slab, which is used again
        once the client lets it go)."""
        if self.slabs is not None:
            placed = self.slabs.place(batch.arrays)
            if placed is not None:
                nbytes = sum(m.nbytes for m in placed.metas)
                return encode_placed(batch, placed.metas, placed.placement), nbytes, not placed.in_place
            if self.slabs.holds(batch.arrays):  # (the slab may be reused once the socket has it: copy)
                copies = {k: np.array(v) for k, v in batch.arrays.items()}
                frames = encode(Batch(batch.stream, batch.epoch, batch.seq, copies), checksum=self._checksum)
                return frames, sum(memoryview(f).nbytes for f in frames[1:]), False
        frames = encode(batch, checksum=self._checksum)
        return frames, sum(memoryview(f).nbytes for f in frames[1:]), True

    def _allocating(self) -> ContextManager[None]:
        # A client that reads shared memory has its batches gathered in its slabs to begin with.
        return allocating(self.slabs.carve if self.slabs is not None else None)

    def _produce(self) -> None:
        """A producer thread's life: the production's steps, each once the queue has room; a
        ``Waiting``'s futures waited for; the loop rung for each item queued."""
        name_this_thread("fl-produce")
        steps = self._production()
        try:
            with self._allocating():
                while self._room():
                    step = next(steps, _ENDED)
                    if step is _ENDED:
                        return
                    if isinstance(step, Waiting):
                        while wait(step.futures, timeout=0.5).not_done and not self._stopped:
                            pass
                    else:
                        self._wake()
        finally:
            steps.close()
            self._wake()  # (an error it queued as it ended)

    def _room(self) -> bool:
        """A producer thread waits here until the queue has room; False: the session stopped."""
        with self._cond:
            while len(self._ready) >= self.hwm and not self._stopped:
                self._producer_waiting = True
                self._cond.wait(0.5)
                self._producer_waiting = False
            return not self._stopped

    def _production(self) -> Production:
        """The producer: every batch of the session's epochs, each put for the loop to send,
        then an end of epoch; an error, put for the client, ends it. Steps: None after each
        item put, a ``Waiting`` where the next batch waits for decodes."""
        h = self.hello
        epoch, cursor = h.epoch, h.cursor
        where = f"data server session {self.name} (split {h.split!r}, rank {h.rank} of {h.world_size})"
        try:
            while not self._stopped:
                seq = cursor
                batches = self._batches(epoch, cursor)
                try:
                    for item in batches:
                        if isinstance(item, Waiting):
                            yield item
                            continue
                        arrays, fresh = item
                        frames, nbytes, keepable = self._encode(Batch(h.stream, epoch, seq, arrays))
                        if not self._put(("batch", frames, nbytes)):
                            return  # (stopped: a client that left or was replaced is not remembered)
                        if fresh:
                            self._remember(epoch, seq, arrays, frames, keepable)
                        seq += 1
                        yield None
                finally:
                    batches.close()
                if not self._put(("end", encode(EndOfEpoch(h.stream, epoch, seq)), 0)):
                    return
                yield None
                # A resume saved after an epoch's last batch, on another world size, leaves the
                # epoch nothing: it ends at once, as it does at the same world size.
                if seq == 0 and not (h.history and epoch == h.epoch):
                    raise DataError(f"epoch {epoch} of split {h.split!r} has no batches")
                epoch, cursor = epoch + 1, 0
        except DataError as exc:
            log.error("in %s, epoch %d: %s", where, epoch, exc)
            self._put(("error", encode(Error(ErrorCode.DATA, f"in {where}, epoch {epoch}: {exc}")), 0))
        except Exception as exc:  # a bug: report it to the client with its place, keep serving others
            if self._stopped:  # (its client is gone, and at shutdown its source may be closing under it)
                log.debug("in %s, epoch %d, after it stopped", where, epoch, exc_info=True)
                return
            log.exception("in %s, epoch %d", where, epoch)
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            self._put(("error", encode(Error(ErrorCode.INTERNAL, f"in {where}, epoch {epoch}: {tb}")), 0))
