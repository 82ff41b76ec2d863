"""One client connection: a ZeroMQ DEALER socket to one server, driving its ``Link``.

The protocol (position, credit, Welcome checks, silence, reconnects with backoff, resume) is the
I/O-free ``fuelline.client.link.Link``; this driver gives it a socket, a lock and a thread, and
the wall clock, and carries out the actions it returns after each call (``_act``). It is driven
by whichever thread needs it. While the user waits for a batch, the
user's own thread receives, decodes and returns it: no hand-off between threads on the hot path
(a hand-off per batch cost a fifth of loopback throughput). While the user is busy training, a
keep-alive thread drives it: it decodes and checks what has arrived, one batch per turn, so that
the user's next ``take`` finds it ready (decoding a 3 MB batch and checking its checksum is a few
hundred microseconds a step that would otherwise count as waiting for data); it sends heartbeats
and notices a silent server. Its turns come every half millisecond while batches arrive and back
off to 20 ms when none do; it stays out of the way of a user who comes back for the next batch at
once (that user decodes its own batches, on the hot path above), and never waits for the lock,
which the user's thread holds while it drives. Prefetch needs no thread of ours: the server may
send up to ``hwm`` batches, which libzmq's I/O thread receives meanwhile.

Over CURVE, a refused handshake is silence to the socket: a ``HandshakeWatch`` tells the client
why. A Welcome that offers the server's Unix socket moves the connection there when the server's
token file reads the same here (a container on the same machine has a filesystem of its own).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from typing import Any

import zmq

from fuelline.client.curve import CurveKeys, HandshakeWatch
from fuelline.client.link import Connect, Disconnect, HandshakeDone, Item, Link, Transmit, backoff_delay
from fuelline.client.slabs import ClientSlabs
from fuelline.protocol import DEFAULT_LIMITS, Hello, Limits, ServerUnavailable, Welcome
from fuelline.protocol.common.threadnames import name_this_thread

__all__ = ["Connection", "Item", "backoff_delay"]

log = logging.getLogger("fuelline.client")


class Connection(Link):
    """One server connection (see ``Link`` for the arguments it shares).

    Args:
        curve: CURVE keys to connect with; None for a server without CURVE.
        context: the ZeroMQ context its sockets belong to (the process's shared one by default).
    """

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
        super().__init__(endpoint, hello, hwm=hwm, heartbeat=heartbeat, timeout=timeout, verify=verify, limits=limits,
                         local=local, connect_timeout=connect_timeout, shared_memory=shared_memory)
        self._ctx = context or zmq.Context.instance()
        # CURVE: a refused handshake is silence to the socket; the watch tells the client why.
        self._curve = curve
        self._watch = HandshakeWatch(endpoint, curve)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, name=f"fuelline-keepalive-{endpoint}", daemon=True)
        self._taken_at = 0.0  # when the user's thread last took an item
        self._in_take = False  # the user's thread is in take(), waiting for an item
        self._sock: zmq.Socket | None = None

    # -- the user's side -----------------------------------------------------------------------
    def start(self, seek: int, epoch: int, cursor: int, history: tuple = ()) -> None:
        with self._lock:
            self.begin(seek, epoch, cursor, history)
            self._act()
        self._keepalive.start()

    def seek(self, seek: int, epoch: int, cursor: int, history: tuple = ()) -> None:
        """Restart at a position, under a new seek counter; items of older ones are dropped."""
        with self._lock:
            super().seek(seek, epoch, cursor, history)
            self._act()

    def credit(self, seek: int, n: int = 1) -> None:
        """The user took n batches tagged ``seek``: room for n more."""
        with self._lock:
            super().credit(seek, n)
            self._act()

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
                    self._act()
                    self._step(min(left, self._tick))
            finally:
                self._in_take = False

    def hold_to(self, fingerprint: dict[str, str], where: str) -> None:
        with self._lock:
            super().hold_to(fingerprint, where)

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
                    self.say_bye("client closing")
                    self._act()
                    self._watch.detach()  # before the socket closes (see HandshakeWatch.detach)
                    # A moment for the Bye to leave (on the shared context, close does not block).
                    self._sock.close(linger=200)
                    self._sock = None
                except zmq.ZMQError:
                    pass
            self._close_transport()
            self._act()
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
                    self._act()
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

    # -- driving the link (call with the lock held) ------------------------------------------------
    def _step(self, wait: float, limit: int | None = None) -> None:
        """Receive what there is (waiting up to ``wait`` seconds; at most ``limit`` messages),
        then keep the connection alive: heartbeats, silence detection, reconnection."""
        if self._error is not None:
            return
        due = self.reconnect_due()
        self._act()
        if not due:
            assert self.retry_at is not None
            time.sleep(max(0.0, min(wait, self.retry_at - time.monotonic())))  # (the caller waits anyway)
            return
        if self._sock is not None and (self._sock.poll(int(wait * 1000)) if wait > 0 else True):
            self._drain_socket(limit)
        if self._sock is not None and not self._connected:  # handshakes happen before a Welcome
            refused = self._watch.check()
            if refused is not None:
                self._fail(refused)
        self.tick()
        self._act()

    def _drain_socket(self, limit: int | None = None) -> None:
        for _ in itertools.repeat(None) if limit is None else range(limit):
            if self._sock is None or self._error is not None:
                return
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.receive(frames)
            self._act()  # (before the next message: a Welcome may move the link to another socket)

    # -- the link's I/O ---------------------------------------------------------------------------
    def _act(self) -> None:
        """Carry out what the link returned, in order."""
        if not self._actions:
            return
        for action in self.take_actions():
            if isinstance(action, Transmit):
                assert self._sock is not None
                self._sock.send_multipart(action.frames)
            elif isinstance(action, Connect):
                self._connect(action.transport)
            elif isinstance(action, Disconnect):
                self._disconnect()
            elif isinstance(action, HandshakeDone):
                # Nothing more to learn from the monitor, whose unread events would pile up
                # for as long as this socket lives.
                self._watch.detach()

    def _connect(self, transport: str) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # only small control messages go out; never drop a Credit
        sock.setsockopt(zmq.RCVHWM, 0)  # credit bounds what comes in
        sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        if self._curve is not None:
            self._curve.apply(sock)
        if transport.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)  # (libzmq leaves IPv6 off: an IPv6 server's address would be refused)
        self._watch.attach(sock)
        sock.connect(transport)
        self._sock = sock

    def _disconnect(self) -> None:
        self._watch.detach()  # before the socket closes (see HandshakeWatch.detach)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _shares_host(self, local: Any) -> bool:
        """Whether the server's ipc endpoint is reachable from here: its token file must read
        the same here (a container on the same machine has a filesystem of its own)."""
        path = local["endpoint"][len("ipc://"):]
        try:
            with open(path + ".token") as f:
                return f.read(256) == local["token"]
        except OSError:
            return False

    def _map_slabs(self, folder: str) -> ClientSlabs:
        return ClientSlabs(folder)

    def _refused_for(self, now: float, limit: float) -> float:
        return self._watch.refused_for(now, self._started, limit)

    @property
    def _refused(self) -> bool:
        return bool(self._watch.refused)

    def _detail(self, detail: str) -> str:
        """``detail``, and what the handshakes suggest when the server was never heard properly."""
        hint = self._watch.hint()
        return "; ".join(part for part in (detail, hint) if part)
