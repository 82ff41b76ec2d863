"""A loopback TCP proxy that a test can cut, slow down, stall and resume.

One thread runs a selector loop over every connection: nothing it does blocks, so a command
(``cut``, ``delay``, ``stall``, ``resume``, ``close``) takes effect within one turn of the loop,
and ``cut`` and ``close`` wait for it with a deadline. It is bounded in every direction: at most
``max_connections`` pairs, at most ``buffer_bytes`` held per direction of a pair (beyond that it
stops reading, and TCP's own flow control slows the sender), and it stops by itself, closing
everything, ``lifetime`` seconds after it started, so a test that forgets it leaves nothing behind.

A connection whose upstream refuses (the server is down) is closed at once, as a dead host would
be: the client's reconnect logic is what a test exercises, not the proxy's.
"""

from __future__ import annotations

import collections
import selectors
import socket
import struct
import threading
import time
from typing import Any, Callable

__all__ = ["TcpProxy"]

CHUNK = 65536
COMMAND_WAIT = 5.0  # seconds a caller waits for the loop to carry out a command


class _Pair:
    """A client connection and its upstream, with what each direction holds for the other."""

    def __init__(self, down: socket.socket, up: socket.socket) -> None:
        self.down, self.up = down, up
        self.connected = False  # the upstream connect has completed
        # Per direction: (release time, bytes) in arrival order; a delay holds chunks until then.
        self.held: dict[socket.socket, collections.deque[tuple[float, bytes]]] = {
            down: collections.deque(), up: collections.deque()
        }
        self.held_bytes = {down: 0, up: 0}  # keyed by the socket the bytes go to

    def peer(self, sock: socket.socket) -> socket.socket:
        return self.up if sock is self.down else self.down


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target_host:target_port``.

    Args:
        target_port: where the real server listens.
        target_host: its interface (loopback by default).
        max_connections: pairs held at most; a connection beyond that is closed at once.
        buffer_bytes: bytes held per direction of a pair before reading from its sender stops.
        lifetime: seconds after which the proxy closes everything and its thread ends.

    Attributes:
        port: the port clients connect to.
        accepted, cuts: connections accepted and connections cut so far.
    """

    def __init__(
        self, target_port: int, *, target_host: str = "127.0.0.1", max_connections: int = 128,
        buffer_bytes: int = 4 << 20, lifetime: float = 900.0,
    ) -> None:
        self.target = (target_host, target_port)
        self.max_connections = max_connections
        self.buffer_bytes = buffer_bytes
        self.accepted = 0
        self.cuts = 0
        self._deadline = time.monotonic() + lifetime
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._commands: collections.deque[tuple[Callable[[], Any], threading.Event]] = collections.deque()
        self._pairs: dict[socket.socket, _Pair] = {}  # both sockets of a pair map to it
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._delay = 0.0
        self._stalled = False
        self._armed: tuple[float, threading.Event, list[int]] | None = None  # cut(in_flight=True)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tcp-proxy-{self.port}", daemon=True)
        self._thread.start()

    # -- commands (any thread) ----------------------------------------------------------------
    def cut(self, in_flight: bool = False, within: float = 1.0) -> int:
        """Reset every connection; returns how many pairs were cut. New ones are accepted.

        With ``in_flight``, the cut waits (up to ``within`` seconds) for the next chunk the
        server sends, and that chunk is lost with the connections: a reset in mid-transfer.
        """
        if not in_flight:
            return self._command(self._cut_all)
        done, result = threading.Event(), []
        self._command(lambda: setattr(self, "_armed", (time.monotonic() + within, done, result)))
        if not done.wait(within + COMMAND_WAIT):
            raise RuntimeError(f"tcp proxy on port {self.port} did not cut within {within + COMMAND_WAIT}s")
        return result[0]

    def delay(self, seconds: float) -> None:
        """Hold every chunk ``seconds`` before forwarding it (0 for none), until ``resume``."""
        self._command(lambda: setattr(self, "_delay", float(seconds)))

    def stall(self) -> None:
        """Forward nothing, on old and new connections alike, until ``resume``: a hung network."""
        self._command(lambda: setattr(self, "_stalled", True))

    def resume(self) -> None:
        """Forward again, without delay."""
        self._command(lambda: (setattr(self, "_stalled", False), setattr(self, "_delay", 0.0)))

    @property
    def armed(self) -> bool:
        """A ``cut(in_flight=True)`` waits for the server's next chunk."""
        return self._armed is not None

    @property
    def connections(self) -> int:
        return len({id(p) for p in list(self._pairs.values())})

    def close(self) -> None:
        """Close every connection and the listener, and end the thread."""
        if not self._closed.is_set():
            self._deadline = 0.0
            self._wake()
        self._thread.join(COMMAND_WAIT)
        if self._thread.is_alive():
            raise RuntimeError(f"tcp proxy on port {self.port} did not stop within {COMMAND_WAIT}s")

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _command(self, action: Callable[[], Any]) -> Any:
        if self._closed.is_set():
            raise RuntimeError(f"tcp proxy on port {self.port} is closed")
        done = threading.Event()
        result: list[Any] = []
        self._commands.append((lambda: result.append(action()), done))
        self._wake()
        if not done.wait(COMMAND_WAIT):
            raise RuntimeError(f"tcp proxy on port {self.port} did not act within {COMMAND_WAIT}s")
        return result[0] if result else None

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a full wake-up pipe already wakes the loop

    # -- the loop (its own thread) --------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while time.monotonic() < self._deadline:
                if self._armed is not None and time.monotonic() >= self._armed[0]:
                    self._fire()  # nothing came from the server in time: cut anyway
                self._update_interest()
                for key, events in self._sel.select(self._select_timeout()):
                    sock = key.fileobj
                    if sock is self._wake_r:
                        self._run_commands()
                    elif sock is self._listener:
                        self._accept()
                    elif sock in self._pairs:  # an earlier event this turn may have closed it
                        self._service(sock, events)  # type: ignore[arg-type]
        finally:
            self._fire()
            self._cut_all()
            self._closed.set()
            self._run_commands()  # nothing waits on a closed proxy
            for s in (self._listener, self._wake_r, self._wake_w):
                s.close()
            self._sel.close()

    def _select_timeout(self) -> float:
        now = time.monotonic()
        timeout = min(0.5, max(0.0, self._deadline - now))
        if self._armed is not None:
            timeout = min(timeout, max(0.0, self._armed[0] - now))
        for pair in set(self._pairs.values()):
            for held in pair.held.values():
                if held:
                    timeout = min(timeout, max(0.0, held[0][0] - now))
        return timeout

    def _run_commands(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while self._commands:
            action, done = self._commands.popleft()
            try:
                if not self._closed.is_set():
                    action()
            finally:
                done.set()

    def _accept(self) -> None:
        try:
            down, _ = self._listener.accept()
        except (BlockingIOError, OSError):
            return
        self.accepted += 1
        if self.connections >= self.max_connections:
            self._reset(down)
            return
        down.setblocking(False)
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        up.setblocking(False)
        up.connect_ex(self.target)
        pair = _Pair(down, up)
        self._pairs[down] = self._pairs[up] = pair  # the loop registers both for what they wait on

    def _update_interest(self) -> None:
        now = time.monotonic()
        for sock, pair in list(self._pairs.items()):
            peer = pair.peer(sock)
            if not pair.connected:
                # The client side waits for the upstream; the upstream waits to finish connecting.
                mask = selectors.EVENT_WRITE if sock is pair.up else 0
            elif self._stalled:
                mask = 0
            else:
                mask = 0
                if pair.held_bytes[peer] < self.buffer_bytes:
                    mask |= selectors.EVENT_READ
                held = pair.held[sock]
                if held and held[0][0] <= now:
                    mask |= selectors.EVENT_WRITE
            # An empty mask cannot be registered; a socket with nothing to do is left out.
            try:
                current = self._sel.get_key(sock).events
            except KeyError:
                current = 0
            if mask != current:
                if current and mask:
                    self._sel.modify(sock, mask)
                elif mask:
                    self._sel.register(sock, mask)
                else:
                    self._sel.unregister(sock)

    def _service(self, sock: socket.socket, events: int) -> None:
        pair = self._pairs[sock]
        if not pair.connected:
            if sock is pair.up and pair.up.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                pair.connected = True
            else:
                self._drop(pair)  # refused: the server is down
            return
        if events & selectors.EVENT_READ:
            try:
                data = sock.recv(CHUNK)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                data = b""
            if data == b"":
                self._drop(pair)
                return
            if data and sock is pair.up and self._armed is not None:
                self._fire()  # this chunk is lost with the connections
                return
            if data:
                peer = pair.peer(sock)
                pair.held[peer].append((time.monotonic() + self._delay, data))
                pair.held_bytes[peer] += len(data)
        if events & selectors.EVENT_WRITE:
            held = pair.held[sock]
            now = time.monotonic()
            while held and held[0][0] <= now:
                release, data = held[0]
                try:
                    sent = sock.send(data)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    self._drop(pair)
                    return
                pair.held_bytes[sock] -= sent
                if sent < len(data):
                    held[0] = (release, data[sent:])
                    break
                held.popleft()

    def _fire(self) -> None:
        if self._armed is not None:
            _, done, result = self._armed
            self._armed = None
            result.append(self._cut_all())
            done.set()

    def _cut_all(self) -> int:
        pairs = {id(p): p for p in self._pairs.values()}
        for pair in pairs.values():
            self._drop(pair)
        self.cuts += len(pairs)
        return len(pairs)

    def _drop(self, pair: _Pair) -> None:
        for sock in (pair.down, pair.up):
            self._pairs.pop(sock, None)
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            self._reset(sock)

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        # Linger 0: the close sends a reset, as a cut cable or a crashed peer would look.
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        sock.close()
