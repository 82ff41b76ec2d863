"""Event counts shared by the threads of a server (read-ahead, prefetch, the worker pool's
dispatcher): a ``collections.Counter`` whose additions hold a lock, so none is lost."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Mapping

__all__ = ["Counts"]


class Counts(Counter):
    """``add``/``add_all`` are atomic; reading is a plain Counter's. Pickles as its counts (a
    worker process's copy gets a lock of its own)."""

    def __init__(self, counts: Mapping[str, int] | None = None) -> None:
        super().__init__(counts or {})
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self[name] += n

    def add_all(self, counts: Mapping[str, int]) -> None:
        with self._lock:
            self.update(counts)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Counts, (dict(self),))
