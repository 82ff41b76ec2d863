"""The memory tier: each client's last K prepared batches, so a reconnect resumes without recomputing.

A client that reconnects (a network blip, a server that dropped it as silent) asks again for the
batch after the last one it received. That batch, and the few after it, were usually prepared
moments ago: up to ``hwm`` sent and lost in flight, up to ``hwm`` prepared ahead. Keeping the last
K of them per client means the new session sends them again instead of reading, aligning and
preprocessing them a second time.

An entry belongs to one client (its ``client_id``) and one request (split, rank, world size, resume
history, sources): a Hello that asks for anything else starts the client afresh. Memory is bounded
by K batches per client and by ``max_clients``, the least recently served client going first; a
client that says Bye is forgotten at once. The arrays are kept as they were sent (a batch that is a
view of a decoded block keeps that block alive while it is cached), with the checksums they were
sent with where they might be written again (``Remembered``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable, NamedTuple

import numpy as np

__all__ = ["RecentBatches", "Remembered"]


class Remembered(NamedTuple):
    """A batch as the memory tier keeps it: its arrays, and the checksum of each array as it was
    sent (in the arrays' order), or None where the source never writes a batch again, so that a
    batch changed since it was sent is not sent again as if it were the same."""

    arrays: dict[str, np.ndarray]
    checksums: tuple[int | None, ...] | None


class _Client:
    __slots__ = ("request", "batches")

    def __init__(self, request: Hashable) -> None:
        self.request = request
        self.batches: OrderedDict[tuple[int, int], Remembered] = OrderedDict()


class RecentBatches:
    """The last ``k`` batches prepared for each of at most ``max_clients`` clients (thread-safe).

    ``hits`` counts batches served from here; ``misses`` counts batches that had to be prepared.
    """

    def __init__(self, k: int = 10, max_clients: int = 64) -> None:
        if k < 0 or max_clients < 1:
            raise ValueError(f"need k >= 0 and max_clients >= 1, got {k}, {max_clients}")
        self.k = k
        self.max_clients = max_clients
        self.hits = 0
        self.misses = 0
        self._clients: OrderedDict[str, _Client] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, client_id: str, request: Hashable, epoch: int, seq: int) -> Remembered | None:
        """Batch ``seq`` of ``epoch`` if it was prepared for this client and request (a hit)."""
        with self._lock:
            client = self._clients.get(client_id)
            if client is None or client.request != request:
                return None
            entry = client.batches.get((epoch, seq))
            if entry is not None:
                self.hits += 1
                self._clients.move_to_end(client_id)
            return entry

    def put(self, client_id: str, request: Hashable, epoch: int, seq: int, entry: Remembered) -> None:
        """Record a batch just prepared by the source (a miss)."""
        with self._lock:
            self.misses += 1
            if not self.k:
                return
            client = self._clients.get(client_id)
            if client is None or client.request != request:
                client = self._clients[client_id] = _Client(request)
            self._clients.move_to_end(client_id)
            client.batches[(epoch, seq)] = entry
            client.batches.move_to_end((epoch, seq))
            while len(client.batches) > self.k:
                client.batches.popitem(last=False)
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)

    def reject(self, client_id: str) -> None:
        """The batch just got is not to be sent after all (it changed): uncount its hit and
        forget the client."""
        with self._lock:
            self.hits -= 1
            self._clients.pop(client_id, None)

    def forget(self, client_id: str) -> None:
        with self._lock:
            self._clients.pop(client_id, None)

    def batches(self) -> int:
        with self._lock:
            return sum(len(c.batches) for c in self._clients.values())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"cache_memory_hits": self.hits, "cache_memory_misses": self.misses,
                    "cache_memory_batches": sum(len(c.batches) for c in self._clients.values())}
