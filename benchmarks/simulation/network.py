"""The simulated network and clock: an event loop, and connections as libzmq keeps them."""

from __future__ import annotations

import heapq
from typing import Any, Callable

__all__ = ["Loop", "Pipe", "ZMQ_RECONNECT_IVL"]

ZMQ_RECONNECT_IVL = 0.1  # libzmq's default: a connecting socket tries again every 100 ms


class Loop:
    """Simulated time: callbacks in the order of their times (ties in the order scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._n = 0
        self.events = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._queue, (max(t, self.now), self._n, fn, args))
        self._n += 1

    def after(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float, done: Callable[[], bool] = lambda: False) -> None:
        queue = self._queue
        while queue and queue[0][0] <= until and not done():
            t, _, fn, args = heapq.heappop(queue)
            self.now = t
            self.events += 1
            fn(*args)


class Pipe:
    """One connection, as libzmq keeps it: a DEALER's routing id, its queue while not connected."""

    __slots__ = ("link", "server", "rid", "peer", "open", "connected", "pending", "phase", "up_at", "down_at")

    def __init__(self, link: Any, server: int, rid: bytes, peer: str, phase: float) -> None:
        self.link, self.server, self.rid, self.peer = link, server, rid, peer
        self.open = True
        self.connected = False
        self.pending: list[tuple[list[Any], str]] = []
        self.phase = phase  # when, within libzmq's reconnect interval, this socket tries again
        # When the last message each way arrives: a connection delivers in order (TCP).
        self.up_at = self.down_at = 0.0
