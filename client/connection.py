"""One client connection: a DEALER socket to one server, kept alive and resumed.

The connection is a small state machine behind a lock, driven by whichever thread needs it. While
the user waits for a batch, the user's own thread receives, decodes and returns it: no hand-off
between threads on the hot path (a hand-off per batch cost a fifth of loopback throughput).
While the user is busy training, a keep-alive thread drives it: it decodes and checks what has
arrived, one batch per turn, so that the user's next ``take`` finds it ready (decoding a 3 MB
batch and checking its checksum is a few hundred microseconds a step that would otherwise count
as waiting for data); it sends heartbeats and notices a silent server. Its turns come every
half millisecond while batches arrive and back off to 20 ms when none do; it stays out of the
way of a user who comes back for the next batch at once (that user decodes its own batches, on
the hot path above), and never waits for the lock, which the user's thread holds while it
drives. Prefetch needs no thread of ours: the server may send up to ``hwm`` batches, which
libzmq's I/O thread receives meanwhile.

The connection tracks the position after the last batch it received. After a silence of three
server heartbeat intervals, a ``Bye`` or a server restart, it reconnects with backoff and asks for
exactly that position, so nothing is lost or repeated. It gives up with ``ServerUnavailable``
after ``timeout`` seconds without hearing from the server; until its first Welcome, after
``connect_timeout`` seconds of refused connections (nothing listens there). The position means
the same batch only under the same sequence fingerprint (``Welcome.fingerprint``): the
connection holds to the first one it hears (or the one ``hold_to`` gives it), and fails with
``FingerprintMismatch`` on a Welcome that differs, before any batch of that server is handed over.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import deque
from typing import Any

import zmq

from fuelline.client.curve import CurveKeys, HandshakeWatch
from fuelline.client.receiving import Item, Receiving
from fuelline.client.slabs import ClientSlabs
from fuelline.protocol import (
    DEFAULT_LIMITS,
    Bye,
    Credit,
    FingerprintMismatch,
    Heartbeat,
    Hello,
    Limits,
    ServerUnavailable,
    Welcome,
    encode,
)
from fuelline.protocol.common.threadnames import name_this_thread

__all__ = ["Connection", "Item", "backoff_delay"]


def backoff_delay(backoff: float, rng: random.Random) -> float:
    """The wait before a reconnect: between half of ``backoff`` and all of it, at random, so
    that clients a server restart dropped together do not all come back in the same instant."""
    return backoff / 2 + rng.uniform(0.0, backoff / 2)

log = logging.getLogger("fuelline.client")


class Connection(Receiving):
    """One server connection.

    Args:
        endpoint: ``tcp://host:port``.
        hello: the Hello template (identity, rank, split, sources...); position and credit are
            filled in per (re)connect.
        hwm: batches the client may hold (received and not yet taken, plus in flight).
        heartbeat: the client's heartbeat interval.
        timeout: seconds without hearing the server before ServerUnavailable.
        connect_timeout: seconds of refused connections before the first Welcome after which
            ServerUnavailable is raised; once welcomed, a server that goes away gets ``timeout``.
        curve: CURVE keys to connect with; None for a server without CURVE.
        local: move to the server's ipc endpoint when its Welcome offers one this client can
            prove it shares (the server's token file reads the same here): a client on the
            server's own host then reads through a Unix socket instead of TCP. Reconnects start
            over TCP (the server may have moved), and move again.
        shared_memory: on the Unix socket, ask for batches placed in shared memory
            (``fuelline.client.slabs``); a slab that cannot be mapped turns it off for this
            connection, and what it held is asked for again.
    """

    BACKOFF_MIN = 0.05
    BACKOFF_MAX = 2.0
    # Seconds between the keep-alive thread's turns while batches arrive; None: a turn every
    # quarter heartbeat only, taking in everything there is.
    READ_AHEAD_TURN: float | None = 0.0005
    READ_AHEAD_IDLE = 0.02  # the longest pause between turns while nothing arrives

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
        curve: CurveKeys | None = None,
        local: bool = True,
        connect_timeout: float | None = None,
        shared_memory: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.transport = endpoint  # where the socket connects now: the endpoint, or the server's ipc path
        self._local = local
        self._shared_memory = shared_memory and local
        self._slabs: ClientSlabs | None = None  # on the Unix socket with shared memory: its slabs
        self.welcome: Welcome | None = None
        self.reconnects = 0
        self.resumes_after_loss = 0  # times messages lost in transit were asked for again
        self.data_losses: list[str] = []  # what the server left out (--on-bad-shard skip), in its words
        self.data_loss_epochs: list[int] = []  # the epoch of each (notices come in order with batches)
        self.fingerprint: dict[str, str] | None = None  # the sequence this connection's positions belong to
        self._fingerprint_at = ""  # where it came from, as an error names it
        self._template = hello
        self._hwm = hwm
        self._heartbeat = heartbeat
        self._timeout = timeout
        self._connect_timeout = timeout if connect_timeout is None else connect_timeout
        self._verify = verify
        self._limits = limits
        self._ctx = context or zmq.Context.instance()
        # CURVE: a refused handshake is silence to the socket; the watch tells the client why.
        self._curve = curve
        self._watch = HandshakeWatch(endpoint, curve)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, name=f"fuelline-keepalive-{endpoint}", daemon=True)
        self._items: deque[Item] = deque()
        self._messages = 0  # received so far (the keep-alive thread's pace follows it)
        self._taken_at = 0.0  # when the user's thread last took an item
        self._in_take = False  # the user's thread is in take(), waiting for an item
        self._error: BaseException | None = None
        self._sock: zmq.Socket | None = None
        self._stream = 0  # the user's stream (changes on seek); tags the items handed over
        self._gen = 0  # the Hello counter on the wire (changes on every Hello); tags batches
        self._pos = (0, 0)  # the next (epoch, seq) expected from the server
        self._history: tuple = ()  # segments of _pos's epoch run at other world sizes (Hello.history)
        self._undelivered = 0  # batches received for the current stream, not yet taken
        self._pending_credit = 0  # batches taken, not yet returned to the server as credit
        # Credit a Hello over TCP held back until its Welcome says whether this client moves to
        # the server's Unix socket (see _hello).
        self._withheld = 0
        self._credit_group = max(1, hwm // 4)
        self._connected = False
        self._awaiting_welcome = False
        self._received = 0  # batches and ends of epoch of this Hello's stream received (see Heartbeat.sent)
        self._losses: tuple[tuple[int, int], int] = ((-1, -1), 0)  # (position, losses met there in a row)
        self._server_heartbeat = heartbeat
        self._bye_reason = ""
        self._bye_pending = False
        self._busy_since: float | None = None  # when a server that welcomed us first said it was full
        self._backoff = self.BACKOFF_MIN
        self._jitter = random.Random()  # (seeded by the system: every client its own draws)
        self._retry_at: float | None = None
        self._last_heard = self._last_sent = self._hello_sent = self._started = time.monotonic()

    # -- the user's side -----------------------------------------------------------------------
    def start(self, stream: int, epoch: int, cursor: int, history: tuple = ()) -> None:
        with self._lock:
            self._stream, self._pos, self._history = stream, (epoch, cursor), tuple(history)
            self._last_heard = self._started = time.monotonic()
            self._open()
        self._keepalive.start()

    def seek(self, stream: int, epoch: int, cursor: int, history: tuple = ()) -> None:
        """Restart the stream at a position; items of older streams are dropped."""
        with self._lock:
            self._stream, self._pos, self._undelivered = stream, (epoch, cursor), 0
            self._history = tuple(history)
            self._items.clear()
            if self._sock is not None:
                self._say_hello()

    def credit(self, stream: int, n: int = 1) -> None:
        """The user took n batches of ``stream``: room for n more."""
        with self._lock:
            if stream == self._stream:
                self._undelivered -= n
                self._pending_credit += n
                self._flush_credit(2 * self._credit_group)

    def take(self, wait: float) -> Item | None:
        """The next item, driving the connection for up to ``wait`` seconds; None if none came.

        Raises:
            ServerUnavailable, RemoteError, ProtocolError: the connection has failed.
        """
        deadline = time.monotonic() + wait
        with self._lock:
            self._in_take = True
            try:
                while True:
                    if self._items:
                        self._taken_at = time.monotonic()
                        return self._items.popleft()
                    if self._error is not None:
                        raise self._error
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._flush_credit(1)  # (about to wait: the server must not idle meanwhile)
                    self._step(min(left, self._tick))
            finally:
                self._in_take = False

    def hold_to(self, fingerprint: dict[str, str], where: str) -> None:
        """Accept from now on only servers of this sequence fingerprint (``where`` names its
        origin in errors, e.g. "in the saved position").

        Raises:
            FingerprintMismatch: the server already heard from has another one (nothing changes).
        """
        with self._lock:
            if self.welcome is not None and self.welcome.fingerprint != fingerprint:
                raise FingerprintMismatch(fingerprint, self.welcome.fingerprint, where, f"at {self.endpoint}")
            self.fingerprint, self._fingerprint_at = dict(fingerprint), where

    def wait_welcome(self, timeout: float) -> Welcome:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.welcome is None:
                if self._error is not None:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerUnavailable(self.endpoint, timeout, self._detail("no welcome"))
                self._step(min(left, self._tick))
            return self.welcome

    def close(self) -> None:
        self._stop.set()
        if self._keepalive.is_alive():
            self._keepalive.join(5.0)
        with self._lock:
            if self._sock is not None:
                try:
                    self._send(Bye("client closing"))
                    self._watch.detach()  # before the socket closes (see HandshakeWatch.detach)
                    # A moment for the Bye to leave (on the shared context, close does not block).
                    self._sock.close(linger=200)
                    self._sock = None
                except zmq.ZMQError:
                    pass
            self._close_socket()
            self._items.clear()

    @property
    def _tick(self) -> float:
        return self._heartbeat / 4

    # -- keep-alive thread ---------------------------------------------------------------------
    def _keep_alive(self) -> None:
        name_this_thread("fl-keepalive")
        interval = self._tick if self.READ_AHEAD_TURN is None else self.READ_AHEAD_TURN
        while not self._stop.wait(interval):
            # If the user's thread holds the lock, it is driving the connection itself.
            turn = self.READ_AHEAD_TURN
            if turn is not None and (self._in_take or time.monotonic() - self._taken_at < 2 * turn):
                # The user is waiting for a batch, or came for one a moment ago and will be back
                # as soon: a consumer that outpaces the data decodes its own batches, and a turn
                # here would only take the GIL from it.
                interval = self.READ_AHEAD_IDLE if self._in_take else 8 * turn
                continue
            if not self._lock.acquire(blocking=False):
                # Back soon: the user may be about to train.
                interval = self._tick if turn is None else 2 * turn
                continue
            received = 0
            try:
                if self._error is None:
                    self._flush_credit(self._credit_group)
                    before = self._messages
                    # One message a turn, so the user's thread is never kept waiting for more.
                    self._step(0.0, limit=None if turn is None else 1)
                    received = self._messages - before
            except Exception as exc:  # a bug must surface in the user's thread, not vanish here
                log.exception("client keep-alive for %s failed", self.endpoint)
                self._error = exc
            finally:
                self._lock.release()
            if turn is None:
                interval = self._tick
            else:
                interval = turn if received > 0 else min(2 * interval, self.READ_AHEAD_IDLE, self._tick)

    # -- the state machine (call with the lock held) ----------------------------------------------
    def _hello(self) -> Hello:
        t = self._template
        credit = max(0, self._hwm - self._undelivered)
        # A client that may move to the server's Unix socket asks for nothing over TCP: the
        # server would prepare up to hwm batches for a session the move then replaces (and send
        # them again from its memory, copied into shared memory). Its Welcome says whether to
        # move; if not, the credit follows it.
        self._withheld = credit if self._local and self.transport == self.endpoint else 0
        return Hello(
            client_id=t.client_id,
            rank=t.rank,
            world_size=t.world_size,
            split=t.split,
            sources=t.sources,
            stream=self._gen,
            epoch=self._pos[0],
            cursor=self._pos[1],
            history=self._history if self._history else (),
            credit=credit - self._withheld,
            heartbeat=self._heartbeat,
            shm=self._slabs is not None,
        )

    def _open(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # only small control messages go out; never drop a Credit
        sock.setsockopt(zmq.RCVHWM, 0)  # credit bounds what comes in
        sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        if self._curve is not None:
            self._curve.apply(sock)
        if self.transport.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)  # (libzmq leaves IPv6 off: an IPv6 server's address would be refused)
        self._watch.attach(sock)
        sock.connect(self.transport)
        self._sock = sock
        self._connected = False
        self._say_hello()

    def _say_hello(self) -> None:
        # A new generation per Hello: batches of a session this Hello replaces are told apart.
        self._gen += 1
        self._pending_credit = 0  # the Hello's credit (hwm - undelivered) includes it
        self._send(self._hello())
        self._hello_sent = time.monotonic()
        self._received = 0
        self._awaiting_welcome = True

    def _close_socket(self) -> None:
        self._pending_credit = 0  # the next Hello's credit includes it
        self._watch.detach()  # before the socket closes (see HandshakeWatch.detach)
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
        if self._error is None:
            self._error = error
        self._close_socket()

    def _flush_credit(self, group: int) -> None:
        """Return credit once ``group`` batches are pending, or nothing is left to take. The keep-alive
        thread returns a quarter of hwm while the user trains, the user's thread twice that: a send
        wakes libzmq's I/O thread, which on a busy host can cost the sender its time slice. Sent even
        before a Welcome (the server reads it after the Hello); else the next Hello's includes it."""
        slabs = self._slabs
        if (self._pending_credit and (self._pending_credit >= group or not self._items)) or (
                slabs is not None and len(slabs.released) >= max(group, 2)):
            self._send(Credit(self._pending_credit, slabs.take_released() if slabs is not None else ()))
            self._pending_credit = 0

    def _step(self, wait: float, limit: int | None = None) -> None:
        """Receive what there is (waiting up to ``wait`` seconds; at most ``limit`` messages),
        then keep the connection alive: heartbeats, silence detection, reconnection."""
        if self._error is not None or not self._reconnected(wait):
            return
        if self._sock is not None and (self._sock.poll(int(wait * 1000)) if wait > 0 else True):
            self._drain_socket(limit)
        if self._sock is not None and not self._connected:  # handshakes happen before a Welcome
            refused = self._watch.check()
            if refused is not None:
                self._fail(refused)
        if self._error is not None:
            return
        now = time.monotonic()
        if self._given_up(now) or self._sock is None:
            return
        self._heartbeat_or_retry(now)

    def _reconnected(self, wait: float) -> bool:
        """Reopen the socket once a backoff is over; False while it lasts (having waited in it
        up to ``wait`` seconds: the caller waits anyway)."""
        if self._sock is not None or self._retry_at is None:
            return True
        now = time.monotonic()
        if now < self._retry_at:
            time.sleep(min(wait, self._retry_at - now))
            return False
        self.reconnects += 1
        self._retry_at = None
        self.transport = self.endpoint  # the server may have restarted elsewhere: ask TCP again
        self._slabs = None
        self._open()
        return True

    def _given_up(self, now: float) -> bool:
        """Fail (and True) where connections were refused, or the server silent, for too long."""
        silent = now - self._last_heard
        # Refused connections fail after connect_timeout, but only before the first Welcome: a
        # server welcomed once may be restarting, and gets the whole timeout.
        refusal_limit = self._timeout if self.welcome is not None else self._connect_timeout
        if self._watch.refused_for(now, self._started, refusal_limit) > refusal_limit and self.welcome is None:
            self._fail(ServerUnavailable(self.endpoint, now - self._started, self._detail("")))
            return True
        if silent > self._timeout:
            detail = f"it said: {self._bye_reason}" if self._bye_reason else ""
            self._fail(ServerUnavailable(self.endpoint, silent, self._detail(detail)))
            return True
        return False

    def _heartbeat_or_retry(self, now: float) -> None:
        """A heartbeat when this side has been quiet; after silence (or a Bye), drop the socket
        and try again after a backoff."""
        silence_limit = 3 * (self._server_heartbeat if self._connected else self._heartbeat)
        # No Welcome for as long counts as silence, whatever else the server says: a Hello lost
        # with a server killed after it was sent is never answered by the next one, which only
        # replies no-session to heartbeats.
        unwelcome = self._awaiting_welcome and now - self._hello_sent > silence_limit
        if self._bye_pending or unwelcome or now - max(self._last_heard, self._hello_sent) > silence_limit:
            if unwelcome and now - self._last_heard <= silence_limit:
                log.warning("server %s sent no Welcome in %.1fs; reconnecting", self.endpoint, now - self._hello_sent)
            elif not self._bye_pending:
                # (Refused connections were told once, as such: retrying them is no news.)
                log.log(logging.DEBUG if self._watch.refused else logging.WARNING,
                        "server %s silent for %.1fs; reconnecting", self.endpoint, now - self._last_heard)
            self._bye_pending = False
            self._close_socket()
            self._retry_at = now + backoff_delay(self._backoff, self._jitter)
            self._backoff = min(self._backoff * 2, self.BACKOFF_MAX)
        elif now - self._last_sent >= self._heartbeat:
            self._send(Heartbeat())

    def _detail(self, detail: str) -> str:
        """``detail``, and what the handshakes suggest when the server was never heard properly."""
        hint = self._watch.hint()
        return "; ".join(part for part in (detail, hint) if part)
