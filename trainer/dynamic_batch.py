"""Dynamic batch size: the largest micro-batch the GPU holds, accumulated to the server's batch.

With CUDA, ``probe`` finds the largest micro-batch (within 512…2048 by default, halving from the
top) for which a forward and backward pass fit in memory; every served batch is then cut into
micro-batches whose gradients accumulate (DDP synchronises only on the last one). If memory still
runs out mid-run (fragmentation, a longer batch), the step is retried with half the micro-batch
instead of dying. On CPU there is nothing to probe: one micro-batch per batch.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Mapping

import torch

__all__ = ["MicroBatcher"]

log = logging.getLogger("fuelline.trainer")

Batch = Mapping[str, torch.Tensor]


def _rows(batch: Batch) -> int:
    return len(next(iter(batch.values())))


def _slice(batch: Batch, lo: int, hi: int) -> dict[str, torch.Tensor]:
    return {k: v[lo:hi] for k, v in batch.items()}


class MicroBatcher:
    """Cuts batches into micro-batches and survives out-of-memory errors by halving them.

    Args:
        enabled: probe and split (CUDA); when False every batch is one micro-batch.
        size: the micro-batch to start from (``probe`` sets it).
        smallest, largest: the probe's range.
    """

    def __init__(self, enabled: bool, size: int | None = None, smallest: int = 512, largest: int = 2048) -> None:
        self.enabled = enabled
        self.size = size
        self.smallest = smallest
        self.largest = largest
        self.halvings = 0

    def probe(self, example: Batch, step: Callable[[Batch, float], None], zero_grad: Callable[[], None]) -> int | None:
        """Find the largest micro-batch that fits, from ``largest`` down to ``smallest``."""
        if not self.enabled:
            return None
        size = self.largest
        while True:
            repeat = -(-size // _rows(example))
            trial = {k: v.repeat(repeat, *([1] * (v.dim() - 1)))[:size] for k, v in example.items()}
            try:
                step(trial, 1.0)
                zero_grad()
                self.size = size
                log.info("micro-batch of %d fits in GPU memory", size)
                return size
            except torch.OutOfMemoryError:
                zero_grad()
                torch.cuda.empty_cache()
                if size <= self.smallest:
                    self.size = self.smallest
                    log.warning("even a micro-batch of %d does not fit; using it and halving on demand", size)
                    return size
                size //= 2

    def run(self, batch: Batch, step: Callable[[Batch, float], None], zero_grad: Callable[[], None],
            no_sync: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        """Forward and backward over ``batch`` in micro-batches; ``step(micro, scale)`` must do one
        forward and backward with the loss multiplied by ``scale`` (the micro-batch's share)."""
        rows = _rows(batch)
        while True:
            size = rows if not self.enabled or self.size is None else min(self.size, rows)
            try:
                for lo in range(0, rows, size):
                    hi = min(rows, lo + size)
                    last = hi == rows
                    # Only the last micro-batch lets DDP all-reduce; the others accumulate locally.
                    ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
                    with ctx:
                        step(_slice(batch, lo, hi), (hi - lo) / rows)
                return
            except torch.OutOfMemoryError:
                if size <= 1:
                    raise
                zero_grad()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self.size = max(1, size // 2)
                self.halvings += 1
                log.warning("out of memory with micro-batch %d; retrying the step with %d", size, self.size)
