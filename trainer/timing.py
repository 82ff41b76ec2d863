"""Per-step timing of a training epoch: how long each step waited for its batch, how long it
computed, and the whole iteration, summarised as percentiles; GPU utilisation samples.

Memory is bounded: each series keeps exact count, sum and max, and at most ``capacity`` samples
(a uniform reservoir) for the percentiles."""

from __future__ import annotations

import logging
import random
from typing import Any, Callable, Iterable, Sequence

import numpy as np

__all__ = ["PERCENTILES", "Reservoir", "StepTimes", "GpuSampler", "summarize", "pool", "wait_share", "report",
           "gpu_report"]

log = logging.getLogger("fuelline.trainer")

PERCENTILES = (50, 90, 99)
SUMMARY_KEYS = ("p50", "p90", "p99", "max", "mean")


def summarize(values: Iterable[float], scale: float = 1.0) -> dict[str, float | None]:
    """``{"p50", "p90", "p99", "max", "mean"}`` of ``values`` times ``scale`` (linear
    interpolation between order statistics); all None when there are no values."""
    a = np.asarray(list(values), dtype=np.float64) * scale
    if a.size == 0:
        return dict.fromkeys(SUMMARY_KEYS)
    p = np.percentile(a, PERCENTILES)
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2]), "max": float(a.max()), "mean": float(a.mean())}


def wait_share(wait_total: float, step_total: float) -> float | None:
    """The share of the loop's time spent waiting for data: wait / (wait + step); None with no time."""
    total = wait_total + step_total
    return float(wait_total / total) if total > 0 else None


class Reservoir:
    """Exact count, sum and max of a series, and a uniform sample of at most ``capacity`` of its values."""

    def __init__(self, capacity: int = 10_000, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.count = 0
        self.total = 0.0
        self.max: float | None = None
        self.samples: list[float] = []
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        value = float(value)
        self.count += 1
        self.total += value
        self.max = value if self.max is None else max(self.max, value)
        if len(self.samples) < self.capacity:
            self.samples.append(value)
        else:
            j = self._rng.randrange(self.count)  # Algorithm R: every value kept with probability capacity/count
            if j < self.capacity:
                self.samples[j] = value

    def state(self) -> dict[str, Any]:
        """What another process needs to pool this series with its own (plain, picklable)."""
        return {"count": self.count, "total": self.total, "max": self.max, "samples": list(self.samples)}


def pool(states: Sequence[dict[str, Any]], scale: float = 1.0) -> dict[str, float | None]:
    """One summary of several series' ``Reservoir.state()`` (e.g. one per rank): percentiles of the
    samples put together (each weighted by how many values it stands for), exact mean and max."""
    states = [s for s in states if s["count"]]
    if not states:
        return dict.fromkeys(SUMMARY_KEYS)
    if all(len(s["samples"]) == s["count"] for s in states):
        out = summarize([v for s in states for v in s["samples"]], scale)
    else:  # some reservoir overflowed: weight each sample by the values it stands for
        values = np.concatenate([np.asarray(s["samples"], dtype=np.float64) for s in states])
        weights = np.concatenate([np.full(len(s["samples"]), s["count"] / len(s["samples"])) for s in states])
        order = np.argsort(values)
        values, weights = values[order], weights[order]
        cdf = (np.cumsum(weights) - 0.5 * weights) / weights.sum()
        p = np.interp(np.array(PERCENTILES) / 100.0, cdf, values) * scale
        out = {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}
    count = sum(s["count"] for s in states)
    out["max"] = float(max(s["max"] for s in states)) * scale
    out["mean"] = float(sum(s["total"] for s in states) / count) * scale
    return out


class StepTimes:
    """One epoch's per-step times on one rank, in seconds: ``wait`` (for the next batch), ``step``
    (forward, backward, optimizer) and ``batch`` (from one batch's arrival to the next: the whole
    iteration, logging and checkpoints included)."""

    SERIES = ("wait", "step", "batch")

    def __init__(self, capacity: int = 10_000, seed: int = 0) -> None:
        self.series = {name: Reservoir(capacity, seed + i) for i, name in enumerate(self.SERIES)}
        self._last_arrival: float | None = None

    def record(self, wait: float, step: float, arrival: float) -> None:
        """A step that waited ``wait`` s for a batch that arrived at ``arrival`` (a perf_counter
        reading) and then computed for ``step`` s."""
        self.series["wait"].add(wait)
        self.series["step"].add(step)
        if self._last_arrival is not None:
            self.series["batch"].add(arrival - self._last_arrival)
        self._last_arrival = arrival

    @property
    def steps(self) -> int:
        return self.series["wait"].count

    def share(self) -> float | None:
        return wait_share(self.series["wait"].total, self.series["step"].total)

    def state(self) -> dict[str, Any]:
        return {name: r.state() for name, r in self.series.items()}


def report(states: Sequence[dict[str, Any]], totals: Sequence[tuple[float, float]] | None = None) -> dict[str, Any]:
    """The metrics-line fields of the ``StepTimes.state()`` of every rank, pooled. ``totals``, one
    (wait, step) pair of seconds per rank, is what the shares are of (by default the states' sums)."""
    if totals is None:
        totals = [(s["wait"]["total"], s["step"]["total"]) for s in states]
    return {
        "data_wait_share": wait_share(sum(w for w, _ in totals), sum(s for _, s in totals)),
        "data_wait_share_per_rank": [wait_share(w, s) for w, s in totals],
        "data_wait_ms": pool([s["wait"] for s in states], 1000.0),
        "step_ms": pool([s["step"] for s in states], 1000.0),
        "batch_ms": pool([s["batch"] for s in states], 1000.0),
        "timing_over": "all ranks pooled",
    }


class GpuSampler:
    """GPU utilisation (percent, as ``torch.cuda.utilization`` reads it through NVML) sampled every
    ``every`` steps. Without CUDA, or without NVML (pynvml / nvidia-ml-py), it samples nothing and
    reports None; a failing read turns it off for good rather than fail the run."""

    def __init__(self, read: Callable[[], float] | None, every: int = 10) -> None:
        self.read = read
        self.every = max(1, int(every))
        self.samples: list[float] = []

    @classmethod
    def for_device(cls, device: Any, every: int = 10) -> "GpuSampler":
        if getattr(device, "type", None) != "cuda":
            return cls(None, every)
        import torch

        return cls(lambda: float(torch.cuda.utilization(device)), every)

    def reset(self, every: int | None = None) -> None:
        self.samples = []
        if every is not None:
            self.every = max(1, int(every))

    def maybe_sample(self, step: int) -> None:
        if self.read is None or step % self.every:
            return
        try:
            self.samples.append(float(self.read()))
        except Exception as exc:  # NVML missing or unusable: no figure, never a failed run
            log.info("GPU utilisation not available (%s: %s); gpu_util will be null", type(exc).__name__, exc)
            self.read = None
            self.samples = []


def gpu_report(per_rank: Sequence[list[float] | None]) -> dict[str, float] | None:
    """``{"mean", "max"}`` of the utilisation samples of every rank, or None when there are none."""
    values = [v for samples in per_rank if samples for v in samples]
    if not values:
        return None
    return {"mean": float(np.mean(values)), "max": float(np.max(values))}
