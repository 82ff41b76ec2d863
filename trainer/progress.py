"""Progress through an epoch on rank 0: a tqdm bar when stderr is a terminal and logs are text,
otherwise log records at even intervals: every tenth of the epoch when its length is known, every
``interval_s`` seconds when it is not. Never both.

One rule at a time, on a fixed grid: mixing a step rule with a time rule, or restarting the clock
at each record, puts records at uneven steps, which reads as uneven progress in a log."""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, Callable

__all__ = ["EpochProgress", "use_bar"]

log = logging.getLogger("fuelline.trainer")


def use_bar(log_format: str, stream: Any = None) -> bool:
    """A bar only for people watching a terminal; with JSON logs progress is log records."""
    stream = sys.stderr if stream is None else stream
    try:
        return log_format == "text" and stream.isatty()
    except (AttributeError, ValueError):
        return False


class EpochProgress:
    """``update(step, loss, share)`` after each step: ``step`` is the number of batches of the epoch
    done so far (counting any done before a resume), ``total`` the epoch's batches (None if the
    server cannot tell), ``share`` the data-wait share so far.

    ``epoch`` is the stream's number of the epoch, from 0, as the metrics records and checkpoints
    have it (and a JSON log record's ``epoch`` field); the text for people counts from 1, of
    ``epochs`` where given, as the trainer's epoch summary line does (``epoch 1/10: step 5/50``).

    Without a bar, a record comes at every multiple of ``ceil(fraction * total)`` steps and at the
    last step; with no ``total``, at every multiple of ``interval_s`` seconds since the start."""

    def __init__(self, epoch: int, total: int | None, *, epochs: int | None = None, initial: int = 0,
                 enabled: bool = True, bar: bool = False, interval_s: float = 30.0, fraction: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < fraction <= 1 or interval_s <= 0:
            raise ValueError(f"fraction must be in (0, 1] and interval_s > 0, got {fraction} and {interval_s}")
        self.epoch, self.total, self.enabled = epoch, total, enabled
        self.name = f"epoch {epoch + 1}" + (f"/{epochs}" if epochs else "")
        self.interval_s, self.clock = interval_s, clock
        self.stride = max(1, math.ceil(total * fraction)) if total else None
        self._bar = None
        self._start = clock()
        self._next_time = self._start + interval_s
        if enabled and bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=self.name, unit="batch", leave=True,
                             dynamic_ncols=True, file=sys.stderr)

    def _due(self, step: int) -> bool:
        if self.stride is not None:
            return step % self.stride == 0 or step == self.total
        now = self.clock()
        if now < self._next_time:
            return False
        # The next mark on the grid after now: a slow step that spans several marks logs once.
        self._next_time = self._start + self.interval_s * (math.floor((now - self._start) / self.interval_s) + 1)
        return True

    def update(self, step: int, loss: float, share: float | None) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{loss:.4f}", data_wait=f"{100 * (share or 0.0):.1f}%", refresh=False)
            return
        if not self._due(step):
            return
        of = f"/{self.total}" if self.total else ""
        wait = "n/a" if share is None else f"{100 * share:.1f}%"
        log.info("%s: step %d%s, loss %.4f, data wait %s", self.name, step, of, loss, wait,
                 extra={"epoch": self.epoch, "step": step, "steps": self.total, "loss": loss, "data_wait_share": share})

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
