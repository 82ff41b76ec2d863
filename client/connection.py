"""One client connection: a ZeroMQ DEALER socket to one server, driving its ``Link``.

The protocol (position, credit, Welcome checks, silence, reconnects with backoff, resume) is the
I/O-free ``fuelline.client.link.Link``; this driver gives it a socket, a lock and a thread, and
the wall clock, and carries out the actions it returns after each call (``_act``). It is driven
by whichever thread needs it. While the user waits for a batch, the
user's own thread receives, decodes and returns it: no hand-off between threads on the hot path
(a hand-off per batch cost a fifth of loopback throughput). While the user is busy training, a
keep-alive thread drives it: it decodes and checks what has arrived, one batch per turn, so that
the user's next ``take`` finds it ready (decoding a 3 MB batch and checking its checksum is a few
hundred microseconds a step that would otherwise count as waiting for data); it returns credit,
sends heartbeats and notices a silent server. It sleeps in ``poll`` on the socket's own file
descriptor (``ZMQ_FD``), holding neither the lock nor the interpreter's, and takes a turn when
libzmq has news for the socket, or every 20 ms at the least. It wakes for what arrives, not on a
timer: each wake-up takes the interpreter lock from a user whose training step holds it. It leaves
the connection to a user's thread that is in ``take`` (the thread says so before it waits for the
lock): that thread decodes its own batches, on the hot path above. Prefetch needs no thread of
ours: the server may send up to ``hwm`` batches, which libzmq's I/O thread receives meanwhile.

Over CURVE, a refused handshake is silence to the socket: a ``HandshakeWatch`` tells the client
why. A Welcome that offers the server's Unix socket moves the connection there when the server's
token file reads the same here (a container on the same machine has a filesystem of its own).
"""

from __future__ import annotations

import itertools
import logging
import select
import threading
import time
import uuid
from typing import Any

import zmq

from fuelline.client import heap
from fuelline.client.curve import CurveKeys, HandshakeWatch
from fuelline.client.link import Connect, Disconnect, HandshakeDone, Item, Link, Transmit, backoff_delay
from fuelline.client.slabs import ClientSlabs
from fuelline.protocol import DEFAULT_LIMITS, Hello, Limits, ServerUnavailable, Welcome
from fuelline.protocol.common import descriptors
from fuelline.protocol.common.threadnames import name_this_thread
from fuelline.protocol.common.wakepipe import WakePipe

__all__ = ["Connection", "Item", "backoff_delay", "FILES_PER_CONNECTION", "FILES_PER_CONTEXT"]

# Open files a connection holds at most: its ZeroMQ socket's mailbox, the TCP connection (and the
# Unix socket's, on the server's host), its wake-up eventfd (a pipe's two ends off Linux), and
# while it connects the socket monitor's pair (measured with 8 servers: 4.75 a server over TCP and
# 6.75 on the server's host at the peak; 2.75 and 4 once reading).
FILES_PER_CONNECTION = 8
FILES_PER_CONTEXT = 16  # a ZeroMQ context's own (its I/O thread's poller and mailboxes), with room to spare

log = logging.getLogger("fuelline.client")


class Connection(Link):
    """One server connection (see ``Link`` for the arguments it shares).

    Args:
        curve: CURVE keys to connect with; None for a server without CURVE.
        context: the ZeroMQ context its sockets belong to (the process's shared one by default).
    """

    READ_AHEAD_IDLE = 0.02  # the keep-alive thread's longest sleep between turns

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
        self._in_take = False  # the user's thread is in take() (set before it waits for the lock)
        self._wake = WakePipe()  # rings the keep-alive thread: credit to return, or closing
        self._sock: zmq.Socket | None = None
        self._largest = 0  # bytes of the largest message received (see fuelline.client.heap)

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
            if self._pending_credit >= self._credit_group:
                self._wake.ring()  # (the keep-alive thread returns it while the user trains)

    def take(self, wait: float) -> Item | None:
        """The next item, driving the connection for up to ``wait`` seconds; None if none came.

        Raises:
            ServerUnavailable, RemoteError, ProtocolError: the connection has failed.
        """
        deadline = time.monotonic() + wait
        self._in_take = True  # (before the lock: the keep-alive thread leaves it alone from now)
        try:
            with self._lock:
                while True:
                    if self._items:
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
        self._wake.ring()
        if self._keepalive.is_alive():
            self._keepalive.join(5.0)
        if not self._keepalive.is_alive():  # (else its poll may still watch the pipe)
            self._wake.close()
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
        heap.release(id(self))

    @property
    def _tick(self) -> float:
        return self._heartbeat / 4

    # -- keep-alive thread ---------------------------------------------------------------------
    def _keep_alive(self) -> None:
        name_this_thread("fl-keepalive")
        idle = min(self.READ_AHEAD_IDLE, self._tick)
        poller = select.poll()
        poller.register(self._wake.fd, select.POLLIN)
        watched: int | None = None  # the file descriptor of the socket the poller watches
        more = False  # the last turn left a message to read
        while not self._stop.is_set():
            if self._in_take:
                self._stop.wait(idle)  # (the user's thread drives the connection meanwhile)
            elif not more:
                poller.poll(idle * 1000)  # news for the socket, a nudge, or the longest sleep
            if self._wake.rung:
                self._wake.drain()  # (before the turn: what a ring during the drain was for is seen)
            more = False
            if self._stop.is_set() or self._in_take:
                continue
            # Held for a moment (credit, a seek): take() says so before it waits for the lock.
            if not self._lock.acquire(timeout=idle):
                continue
            try:
                fd = watched
                if not self._in_take:  # (it came while this thread waited for the lock)
                    fd, more = self._read_ahead()
            finally:
                self._lock.release()
            if fd != watched:
                if watched is not None:
                    poller.unregister(watched)
                if fd is not None:
                    poller.register(fd, select.POLLIN)
                watched = fd

    def _read_ahead(self) -> tuple[int | None, bool]:
        """The keep-alive thread's turn (with the lock held): credit back, one message in (so the
        user's thread is never kept waiting for more), the connection kept alive. Returns the
        socket's file descriptor to poll (None: no socket) and whether a message waits already."""
        try:
            if self._error is None:
                self._flush_credit(self._credit_group)
                self._act()
                self._step(0.0, limit=1)
            if self._sock is None or self._error is not None:
                return None, False
            # ZMQ_FD signals an edge: what arrived while this turn read is only seen in ZMQ_EVENTS
            # (which also makes the next arrival signal again).
            fd, events = self._sock.getsockopt(zmq.FD), self._sock.getsockopt(zmq.EVENTS)
            assert isinstance(fd, int) and isinstance(events, int)
            return fd, bool(events & zmq.POLLIN)
        except Exception as exc:  # a bug must surface in the user's thread, not vanish here
            log.exception("client keep-alive for %s failed", self.endpoint)
            self._error = exc
            return None, False

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
            # (Counted once read as the server's: a message refused unread sizes nothing.)
            if len(frames) > 1 and self._error is None and (nbytes := sum(map(len, frames))) > self._largest:
                self._largest = nbytes
                if nbytes >= heap.SMALLEST:
                    heap.hold(id(self), self._hwm * nbytes)
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
        try:
            sock = self._ctx.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            if exc.errno not in descriptors.EXHAUSTED:
                raise
            raise descriptors.exhausted(f"connecting to {self.endpoint}", exc,
                                        f"a stream takes about {FILES_PER_CONNECTION} a server") from exc
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
