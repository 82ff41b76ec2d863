"""What a connection does with each message from its server (``fuelline.client.connection``).

Batches and ends of epoch must come in order: one ahead of the expected position means messages
were lost in transit (a TCP reset that libzmq reconnected under the same routing id drops what was
queued on the old connection), and so does a server heartbeat that counts more messages of the
stream than arrived; the connection then asks again from its position. One behind it is a server
bug, reported. A Welcome is checked against the sequence fingerprint the connection holds to, and
may move the connection to the server's Unix socket. Errors fail the connection or are logged;
a Bye starts a reconnect.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from fuelline.client.slabs import ClientSlabs, SlabUnavailable
from fuelline.protocol import (
    ArrayMeta,
    Batch,
    Bye,
    Credit,
    EndOfEpoch,
    Error,
    ErrorCode,
    FingerprintMismatch,
    Heartbeat,
    ProtocolError,
    ProtocolVersionError,
    RemoteError,
    Welcome,
    decode,
)
from fuelline.protocol.placement import Placement

__all__ = ["Item", "Receiving"]

log = logging.getLogger("fuelline.client")

MAX_LOSSES_IN_A_ROW = 3  # asking again from one position more often than this is a failure


@dataclass(frozen=True)
class Item:
    """A batch or an end of epoch, tagged with the user's stream it belongs to."""

    stream: int
    kind: str  # "batch" or "end"
    epoch: int = 0
    seq: int = 0
    arrays: dict | None = None


class Receiving:
    """The receiving half of ``Connection``; the connection's lock is held around every call."""

    endpoint: str
    transport: str
    welcome: Welcome | None
    fingerprint: dict[str, str] | None
    data_losses: list[str]
    data_loss_epochs: list[int]
    resumes_after_loss: int
    BACKOFF_MIN: float
    _fingerprint_at: str
    _sock: zmq.Socket | None
    _error: BaseException | None
    _items: deque[Item]
    _messages: int
    _stream: int
    _gen: int
    _pos: tuple[int, int]
    _history: tuple
    _undelivered: int
    _received: int
    _losses: tuple[tuple[int, int], int]
    _connected: bool
    _awaiting_welcome: bool
    _server_heartbeat: float

    if TYPE_CHECKING:  # supplied by Connection, which the receiving half calls back into
        def _fail(self, error: BaseException) -> None: ...
        def _say_hello(self) -> None: ...
        def _close_socket(self) -> None: ...
        def _open(self) -> None: ...
        def _send(self, msg: Any) -> None: ...
    _bye_reason: str
    _bye_pending: bool
    _busy_since: float | None
    _timeout: float
    _backoff: float
    _last_heard: float
    _local: bool
    _withheld: int
    _shared_memory: bool
    _slabs: ClientSlabs | None
    _limits: Any
    _verify: bool
    _watch: Any
    # (and the connection's _fail, _say_hello, _close_socket and _open)

    def _out_of_order(self, what: str, where: tuple[int, int]) -> None:
        """A batch or an end that is not the one expected next: ahead of it, what came between was
        lost in transit; behind it, the server repeats itself, which is a bug to report."""
        if where > self._pos:
            self._lost(f"{what} arrived, expected {self._pos[0]}:{self._pos[1]}")
        else:
            self._fail(ProtocolError(f"{self.endpoint} sent {what}, expected {self._pos[0]}:{self._pos[1]}"))

    def _lost(self, why: str) -> None:
        """Messages lost in transit (a connection reset that libzmq reconnected under the same
        routing id drops what was queued on the old one): ask again from the next undelivered
        position, as after a silence. The server's memory tier still holds what it sent."""
        where, count = self._losses
        count = count + 1 if where == self._pos else 1
        self._losses = (self._pos, count)
        if count > MAX_LOSSES_IN_A_ROW:
            self._fail(ProtocolError(
                f"{self.endpoint} lost messages at {self._pos[0]}:{self._pos[1]} {count} times in a row ({why})"))
            return
        log.warning("server %s: messages lost in transit (%s); asking again from %d:%d",
                    self.endpoint, why, *self._pos)
        self.resumes_after_loss += 1
        self._say_hello()

    def _shares_host(self, local: Any) -> bool:
        """Whether the server's ipc endpoint is reachable from here: its token file must read
        the same here (a container on the same machine has a filesystem of its own)."""
        if not self._local:
            return False
        path = local["endpoint"][len("ipc://"):]
        try:
            with open(path + ".token") as f:
                return f.read(256) == local["token"]
        except OSError:
            return False

    def _drain_socket(self, limit: int | None = None) -> None:
        for _ in itertools.repeat(None) if limit is None else range(limit):
            if self._sock is None or self._error is not None:
                return
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            self._messages += 1
            try:
                msg = decode(frames, limits=self._limits, verify=self._verify, place=self._place)
            except SlabUnavailable as exc:
                # Not to be mapped from here after all: the rest of this connection goes through
                # the socket, from the batch that could not be read (a Hello that says so).
                log.warning("server %s: %s; reading through the socket instead", self.endpoint, exc)
                self._slabs = None
                self._say_hello()
                continue
            except ProtocolVersionError as exc:
                self._fail(ProtocolVersionError(exc.got, exc.expected, peer=self.endpoint))
                return
            except ProtocolError as exc:
                self._fail(ProtocolError(f"from {self.endpoint}: {exc}"))
                return
            self._on_message(msg)

    def _full(self, message: str) -> None:
        """A server that welcomed this connection before is full now (its session was given up to a
        newcomer while this client held its batches, or it restarted with fewer places): a place
        may come free, so it is asked again with backoff, as after silence, for up to ``timeout``;
        a client never welcomed is told at once (``RemoteError`` busy)."""
        now = time.monotonic()
        if self._busy_since is None:
            self._busy_since = now
            log.warning("server %s is full: %s; asking again for up to %.0fs", self.endpoint, message, self._timeout)
        if now - self._busy_since > self._timeout:
            self._fail(RemoteError(ErrorCode.BUSY, f"{message} (asked again for {now - self._busy_since:.0f}s)",
                                   peer=self.endpoint))
            return
        self._bye_reason = message
        self._bye_pending = True
        self._connected = False

    def _place(self, stream: int, metas: list[ArrayMeta], placement: Placement) -> dict:
        """A placed batch's arrays; none for a batch of a stream a later Hello replaced (dropped
        unread: its session's slabs may be gone)."""
        if stream != self._gen:
            return {}
        if self._slabs is None:
            raise ProtocolError("batch placed in shared memory, which this connection did not ask for")
        return self._slabs.arrays(metas, placement)

    def _on_message(self, msg: Any) -> None:
        handler = self._HANDLERS.get(type(msg))
        if handler is not None:
            getattr(self, handler)(msg)

    def _on_batch(self, msg: Batch) -> None:
        if msg.stream != self._gen:
            return  # from a session a later Hello replaced
        if self._awaiting_welcome:
            # Its Welcome, and so its fingerprint, is not checked yet: never hand it over.
            self._fail(ProtocolError(f"{self.endpoint} sent batch {msg.epoch}:{msg.seq} before its Welcome"))
            return
        if (msg.epoch, msg.seq) != self._pos:
            self._out_of_order(f"batch {msg.epoch}:{msg.seq}", (msg.epoch, msg.seq))
            return
        self._received += 1
        self._items.append(Item(self._stream, "batch", msg.epoch, msg.seq, dict(msg.arrays)))
        self._undelivered += 1
        self._pos = (msg.epoch, msg.seq + 1)

    def _on_end(self, msg: EndOfEpoch) -> None:
        if msg.stream != self._gen:
            return
        if (msg.epoch, msg.batches) != self._pos:
            self._out_of_order(f"the end of epoch {msg.epoch} after {msg.batches} batches", (msg.epoch, msg.batches))
            return
        self._received += 1
        self._items.append(Item(self._stream, "end", msg.epoch, msg.batches))
        self._pos = (msg.epoch + 1, 0)
        self._history = ()  # later epochs start whole

    def _on_welcome(self, msg: Welcome) -> None:
        if msg.stream != self._gen or not self._same_sequence(msg):
            return
        self._connected = True
        self._awaiting_welcome = False
        self._bye_reason = ""
        self._busy_since = None
        self._backoff = self.BACKOFF_MIN
        self._server_heartbeat = msg.heartbeat
        self.welcome = msg
        # The handshake is done: nothing more to learn from the monitor, whose unread
        # events would pile up for as long as this socket lives.
        self._watch.detach()
        if msg.local is not None and self.transport == self.endpoint and self._shares_host(msg.local):
            # The same session again over the Unix socket: the Hello there replaces this
            # one, and asks for the credit this one held back.
            log.debug("server %s is on this host: reading through %s", self.endpoint, msg.local["endpoint"])
            self.transport = msg.local["endpoint"]
            if self._shared_memory:
                self._slabs = ClientSlabs(os.path.dirname(self.transport[len("ipc://"):]))
            self._close_socket()
            self._open()
        elif self._withheld:
            # Staying on TCP (another host, no socket offered): the credit the Hello held back.
            self._send(Credit(self._withheld))
            self._withheld = 0

    def _same_sequence(self, msg: Welcome) -> bool:
        """Hold to the first fingerprint heard; False (and the connection fails) on another."""
        if self.fingerprint is None:
            if msg.fingerprint is not None:
                self.fingerprint = dict(msg.fingerprint)
                self._fingerprint_at = f"in what {self.endpoint} served before"
            return True
        if msg.fingerprint != self.fingerprint:
            self._fail(FingerprintMismatch(self.fingerprint, msg.fingerprint, self._fingerprint_at,
                                           f"at {self.endpoint} now"))
            return False
        return True

    def _on_error(self, msg: Error) -> None:
        if msg.code == ErrorCode.NO_SESSION:
            # The server restarted, or dropped us: ask again from where we are.
            if not self._awaiting_welcome:
                self._connected = False
                self._say_hello()
        elif msg.code == ErrorCode.BUSY and self.welcome is not None:
            self._full(msg.message)
        elif msg.fatal:
            self._fail(RemoteError(msg.code, msg.message, peer=self.endpoint))
        else:
            if msg.code == ErrorCode.DATA_LOSS:
                # Sent in order with the batches: the epoch of the next batch due is the
                # epoch whose rows were left out, however far ahead of the consumer we read.
                self.data_losses.append(msg.message)
                self.data_loss_epochs.append(self._pos[0])
            log.warning("server %s: %s [%s]", self.endpoint, msg.message, msg.code)

    def _on_bye(self, msg: Bye) -> None:
        log.warning("server %s said bye: %s", self.endpoint, msg.reason)
        self._bye_reason = msg.reason or "bye"
        self._bye_pending = True
        self._connected = False

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        if msg.stream == self._gen and not self._awaiting_welcome and msg.sent is not None and msg.sent > self._received:
            self._lost(f"it has sent {msg.sent} messages of this stream and {self._received} arrived")
        # (Any other heartbeat: hearing it is all it is for.)

    # Each message type's handler, by name (a subclass may refine one).
    _HANDLERS: dict[type, str] = {
        Batch: "_on_batch", EndOfEpoch: "_on_end", Welcome: "_on_welcome", Error: "_on_error", Bye: "_on_bye",
        Heartbeat: "_on_heartbeat",
    }
