"""Progress through an epoch on rank 0: a tqdm bar when stderr is a terminal and logs are text,
otherwise log records every tenth of the epoch or every ``interval_s`` seconds. Never both."""

from __future__ import annotations

import logging
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
    server cannot tell), ``share`` the data-wait share so far."""

    def __init__(self, epoch: int, total: int | None, *, initial: int = 0, enabled: bool = True, bar: bool = False,
                 interval_s: float = 30.0, fraction: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self.epoch, self.total, self.enabled = epoch, total, enabled
        self.interval_s, self.fraction, self.clock = interval_s, fraction, clock
        self._bar = None
        self._last_step = initial
        self._last_time = clock()
        if enabled and bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=f"epoch {epoch}", unit="batch", leave=True,
                             dynamic_ncols=True, file=sys.stderr)

    def _bucket(self, step: int) -> int:
        return int(step / (self.total * self.fraction)) if self.total else 0

    def update(self, step: int, loss: float, share: float | None) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{loss:.4f}", data_wait=f"{100 * (share or 0.0):.1f}%", refresh=False)
            return
        now = self.clock()
        due = self._bucket(step) > self._bucket(self._last_step) or now - self._last_time >= self.interval_s
        if not due:
            return
        self._last_step, self._last_time = step, now
        of = f"/{self.total}" if self.total else ""
        wait = "n/a" if share is None else f"{100 * share:.1f}%"
        log.info("epoch %d: step %d%s, loss %.4f, data wait %s", self.epoch, step, of, loss, wait,
                 extra={"epoch": self.epoch, "step": step, "steps": self.total, "loss": loss, "data_wait_share": share})

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
