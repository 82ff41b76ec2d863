"""The client's I/O thread: one DEALER socket to one server, kept alive and resumed.

The thread receives and decodes batches while the user trains, so up to ``hwm`` batches are
always on their way (prefetch). It tracks the position after the last batch it received; after a
silence of three server heartbeat intervals, a ``Bye`` or a server restart, it reconnects with
backoff and asks for exactly that position, so nothing is lost or repeated. It gives up with
``ServerUnavailable`` after ``timeout`` seconds without hearing from the server.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from fuelline.protocol import (
    DEFAULT_LIMITS,
    Batch,
    Bye,
    Credit,
    EndOfEpoch,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Limits,
    ProtocolError,
    ProtocolVersionError,
    RemoteError,
    ServerUnavailable,
    Welcome,
    decode,
    encode,
)

__all__ = ["Connection", "Item"]

log = logging.getLogger("fuelline.client")


@dataclass(frozen=True)
class Item:
    """What the I/O thread hands to the user thread."""

    stream: int
    kind: str  # "batch", "end" or "error"
    epoch: int = 0
    seq: int = 0
    arrays: dict | None = None
    error: BaseException | None = None


class Connection:
    """One server connection, driven by its own thread.

    Args:
        endpoint: ``tcp://host:port``.
        hello: the Hello template (identity, rank, split, sources...); position and credit are
            filled in per (re)connect.
        hwm: batches the client may hold (queued for the user plus in flight).
        heartbeat: the client's heartbeat interval.
        timeout: seconds without hearing the server before ServerUnavailable.
    """

    BACKOFF_MIN = 0.05
    BACKOFF_MAX = 2.0

    def __init__(
        self,
        endpoint: str,
        hello: Hello,
        *,
        hwm: int,
        heartbeat: float,
        timeout: float,
        verify: bool = True,
        limits: Limits = DEFAULT_LIMITS,
        context: zmq.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.out: queue.Queue[Item] = queue.Queue()
        self.welcome: Welcome | None = None
        self.welcomed = threading.Event()
        self.reconnects = 0
        self._template = hello
        self._hwm = hwm
        self._heartbeat = heartbeat
        self._timeout = timeout
        self._verify = verify
        self._limits = limits
        self._ctx = context or zmq.Context.instance()
        self._commands: deque[tuple] = deque()
        self._wake_pending = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=f"fuelline-client-{endpoint}", daemon=True)
        self._closing = False
        self._sock: zmq.Socket | None = None
        # Owned by the I/O thread:
        self._stream = 0  # the user's stream (changes on seek); tags the items handed over
        self._gen = 0  # the Hello counter on the wire (changes on every Hello); tags batches
        self._awaiting_welcome = False
        self._bye_pending = False
        self._pos = (0, 0)
        self._undelivered = 0
        self._pending_credit = 0  # batches the user took, not yet returned to the server as credit
        self._credit_group = max(1, hwm // 4)
        self._server_heartbeat = heartbeat
        self._connected = False

    # -- user thread ---------------------------------------------------------------------------
    def start(self, stream: int, epoch: int, cursor: int) -> None:
        self._stream, self._pos = stream, (epoch, cursor)
        self._thread.start()

    def seek(self, stream: int, epoch: int, cursor: int) -> None:
        """Restart the stream at a position; items of older streams are to be dropped."""
        self._command(("seek", stream, epoch, cursor))

    def credit(self, stream: int, n: int = 1) -> None:
        """The user took n batches of ``stream``: room for n more."""
        self._command(("credit", stream, n))

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        self._command(("close",))
        if self._thread.is_alive():
            self._thread.join(timeout)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _command(self, cmd: tuple) -> None:
        self._commands.append(cmd)
        # One byte per wake-up, not per command: the I/O thread clears the flag after emptying
        # the pipe and before taking the commands, so a command queued after that rings again.
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    # -- I/O thread ----------------------------------------------------------------------------
    def _hello(self) -> Hello:
        t = self._template
        return Hello(
            client_id=t.client_id,
            rank=t.rank,
            world_size=t.world_size,
            split=t.split,
            sources=t.sources,
            stream=self._gen,
            epoch=self._pos[0],
            cursor=self._pos[1],
            credit=max(0, self._hwm - self._undelivered),
            heartbeat=self._heartbeat,
        )

    def _open(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # only small control messages go out; never drop a Credit
        sock.setsockopt(zmq.RCVHWM, 0)  # credit bounds what comes in
        sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        sock.connect(self.endpoint)
        self._sock = sock
        self._connected = False
        self._say_hello()

    def _say_hello(self) -> None:
        # A new generation per Hello: batches of a session this Hello replaces are told apart.
        self._gen += 1
        self._pending_credit = 0  # the Hello's credit (hwm - undelivered) includes it
        self._send(self._hello())
        self._hello_sent = time.monotonic()
        self._awaiting_welcome = True

    def _close_socket(self) -> None:
        self._pending_credit = 0  # the next Hello's credit includes it
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._connected = False

    def _send(self, msg: Any) -> None:
        if self._sock is None:
            return
        self._sock.send_multipart(encode(msg))
        self._last_sent = time.monotonic()

    def _fail(self, error: BaseException) -> None:
        self.out.put(Item(self._stream, "error", error=error))
        self._closing = True

    def _run(self) -> None:
        self._last_heard = self._last_sent = time.monotonic()
        self._bye_reason = ""
        backoff = self.BACKOFF_MIN
        retry_at = None  # when a lost connection is next retried
        poller, poller_sock = zmq.Poller(), object()
        try:
            self._open()
            while not self._closing:
                now = time.monotonic()
                if self._sock is None and retry_at is not None and now >= retry_at:
                    self.reconnects += 1
                    self._open()
                    retry_at = None
                if poller_sock is not self._sock:
                    poller = zmq.Poller()
                    poller.register(self._wake_r, zmq.POLLIN)
                    if self._sock is not None:
                        poller.register(self._sock, zmq.POLLIN)
                    poller_sock = self._sock
                wait = self._heartbeat / 4
                if retry_at is not None:
                    wait = min(wait, max(0.0, retry_at - now))
                events = dict(poller.poll(wait * 1000))
                if self._wake_r in events:
                    self._drain_commands()
                if self._sock is not None and self._sock in events:
                    self._drain_socket()
                    if self._connected:
                        backoff = self.BACKOFF_MIN
                if self._closing:
                    break
                now = time.monotonic()
                silent = now - self._last_heard
                if silent > self._timeout:
                    detail = f"it said: {self._bye_reason}" if self._bye_reason else ""
                    self._fail(ServerUnavailable(self.endpoint, silent, detail))
                    break
                limit = 3 * (self._server_heartbeat if self._connected else self._heartbeat)
                if self._sock is not None and (self._bye_pending or now - max(self._last_heard, self._hello_sent) > limit):
                    # Silence (or a Bye): drop this socket and try again with backoff.
                    if not self._bye_pending:
                        log.warning("server %s silent for %.1fs; reconnecting", self.endpoint, silent)
                    self._bye_pending = False
                    self._close_socket()
                    retry_at = now + backoff
                    backoff = min(backoff * 2, self.BACKOFF_MAX)
                elif self._sock is not None and now - self._last_sent >= self._heartbeat:
                    self._send(Heartbeat())
        except Exception as exc:  # a bug must surface in the user thread, not die silently here
            log.exception("client I/O thread for %s failed", self.endpoint)
            self._fail(exc)
        finally:
            if self._sock is not None:
                try:
                    self._send(Bye("client closing"))
                except zmq.ZMQError:
                    pass
            self._close_socket()

    def _drain_commands(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        # Only now: cleared before the drain, a ring during the drain would be swallowed with
        # the flag left up, and no command would ring again.
        self._wake_pending = False
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "credit":
                if cmd[1] == self._stream:
                    self._pending_credit += cmd[2]
                    self._undelivered -= cmd[2]
            elif cmd[0] == "seek":
                self._stream, self._pos, self._undelivered = cmd[1], (cmd[2], cmd[3]), 0
                if self._sock is not None:
                    self._say_hello()
            elif cmd[0] == "close":
                self._closing = True
        self._flush_credit()

    def _flush_credit(self) -> None:
        """Return credit in groups of a quarter of hwm (fewer messages and wake-ups on both
        sides), but at once when the user has nothing left to take, so the server never idles
        while the user waits. Sent even before a Welcome: the server reads it after the Hello on
        the same connection; without a socket, the next Hello's credit accounts for it."""
        if self._pending_credit and (self._pending_credit >= self._credit_group or self.out.empty()):
            self._send(Credit(self._pending_credit))
            self._pending_credit = 0

    def _drain_socket(self) -> None:
        assert self._sock is not None
        while self._sock is not None:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            try:
                msg = decode(frames, limits=self._limits, verify=self._verify)
            except ProtocolVersionError as exc:
                self._fail(ProtocolVersionError(exc.got, exc.expected, peer=self.endpoint))
                return
            except ProtocolError as exc:
                self._fail(ProtocolError(f"from {self.endpoint}: {exc}"))
                return
            self._on_message(msg)
            if self._closing:
                return

    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, Batch):
            if msg.stream != self._gen:
                return  # sent before our last seek
            if (msg.epoch, msg.seq) != self._pos:
                self._fail(ProtocolError(f"{self.endpoint} sent batch {msg.epoch}:{msg.seq}, expected {self._pos[0]}:{self._pos[1]}"))
                return
            self.out.put(Item(self._stream, "batch", msg.epoch, msg.seq, dict(msg.arrays)))
            self._undelivered += 1
            self._pos = (msg.epoch, msg.seq + 1)
        elif isinstance(msg, EndOfEpoch):
            if msg.stream != self._gen:
                return
            if (msg.epoch, msg.batches) != self._pos:
                self._fail(ProtocolError(f"{self.endpoint} ended epoch {msg.epoch} after {msg.batches} batches, expected {self._pos[0]}:{self._pos[1]}"))
                return
            self.out.put(Item(self._stream, "end", msg.epoch, msg.batches))
            self._pos = (msg.epoch + 1, 0)
        elif isinstance(msg, Welcome):
            if msg.stream == self._gen:
                self._connected = True
                self._awaiting_welcome = False
                self._bye_reason = ""
                self._server_heartbeat = msg.heartbeat
                self.welcome = msg
                self.welcomed.set()
        elif isinstance(msg, Error):
            if msg.code == ErrorCode.NO_SESSION:
                # The server restarted, or dropped us: ask again from where we are.
                if not self._awaiting_welcome:
                    self._connected = False
                    self._say_hello()
            elif msg.fatal:
                self._fail(RemoteError(msg.code, msg.message, peer=self.endpoint))
            else:
                log.warning("server %s: %s [%s]", self.endpoint, msg.message, msg.code)
        elif isinstance(msg, Bye):
            log.warning("server %s said bye: %s", self.endpoint, msg.reason)
            self._bye_reason = msg.reason or "bye"
            self._bye_pending = True
            self._connected = False
        # Heartbeat: hearing it is all it is for.
