"""What a server reports about itself: its counters, and the status line it logs per interval."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["counters", "StatusLine"]

log = logging.getLogger("fuelline.server")


def counters(server: Any) -> dict[str, int]:
    """Everything a server counted so far: its own ``stats``, the memory tier's, the source's."""
    out = dict(server.stats)
    if server.recent is not None:
        out.update(server.recent.stats())
    # Read under the counts' own lock: read-ahead, prefetch and worker-pool threads add to
    # them meanwhile, and a dict that grows while it is copied raises.
    out.update(server.source.counters.snapshot())
    return out


class StatusLine:
    """One readable line per interval: what an operator looks at first.

    An idle server does not repeat itself: after a line that said nothing was sent, a line that
    would say the same (the same clients, no batch sent, the same batches waiting) is left out
    until something happens.
    """

    def __init__(self, interval: float, now: float) -> None:
        self.interval = interval  # seconds; 0: none
        self._at = now + interval
        self._base = (0, 0, now)
        self._stage_base: dict[str, tuple[int, float]] = {}  # each stage's batches and seconds at the last line
        self._said: tuple | None = None  # (clients, waiting, batches and bytes sent) of the last line

    def due(self, now: float) -> bool:
        return bool(self.interval) and now >= self._at

    def log(self, server: Any, now: float) -> None:
        batches, nbytes, since = self._base
        dt = max(now - since, 1e-9)
        sessions = list(server.sessions.values())
        queued = sum(s.queued for s in sessions)
        counts = counters(server)
        stages = self._stages(server.source, now)
        state = (len(sessions), queued, counts["batches"] - batches, counts["bytes"] - nbytes, stages)
        self._at = now + self.interval
        self._base = (counts["batches"], counts["bytes"], now)
        if state == self._said and not any(state[2:]):
            return
        self._said = state
        tiers = []
        for tier in ("memory", "decoded", "disk"):
            hits, misses = counts.get(f"cache_{tier}_hits", 0), counts.get(f"cache_{tier}_misses", 0)
            if hits or misses:
                tiers.append(f"{tier} cache {hits} hits / {misses} misses")
        if counts.get("remote_fetches"):
            tiers.append(f"{counts['remote_fetches']} remote fetches ({counts.get('remote_bytes', 0) / 1e6:.1f} MB)")
        log.info(
            "%d client%s; %.1f batches/s, %.1f MB/s; %d batches prepared and waiting for credit%s%s",
            len(sessions), "" if len(sessions) == 1 else "s", state[2] / dt, state[3] / dt / 1e6, queued,
            "".join(f"; {t}" for t in tiers), f"; {stages}" if stages else "",
        )

    def _stages(self, source: Any, now: float) -> str:
        """The time a batch spent in each stage since the last line, and the batches in a stage
        for longer than the interval (a stage that takes minutes finishes nothing to average)."""
        times = source.stage_times()
        parts = []
        for stage, (n, seconds) in times.items():
            n0, s0 = self._stage_base.get(stage, (0, 0.0))
            if n > n0:
                parts.append(f"{stage} {(seconds - s0) / (n - n0):.3f} s")
        self._stage_base = dict(times)
        said = f"stages per batch: {', '.join(parts)}" if parts else ""
        long = [r for r in source.stage_runs() if now - r.started > self.interval]
        if long:
            oldest = long[0]
            said += ("; " if said else "") + (
                f"{len(long)} batch{'es' * (len(long) != 1)} in a stage for over {self.interval:g} s "
                f"(the longest: {oldest.stage}, {now - oldest.started:.0f} s on {oldest.batch})")
        return said
