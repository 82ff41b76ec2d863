"""``python -m benchmarks.cost``: what a data server costs, in CPU and memory, as the work grows.

Every point is a real ``fuelline serve`` process read by N client processes, each reading its own
full epochs of the train split (rank 0 of world size 1: N clients ask for N times the windows).
Per point and timed round: server CPU ms per served window (user + system CPU of the server and
its worker processes, from ``/proc``, over every window the clients received) and the peak RSS of
the server plus its workers (summed, sampled every 25 ms by a thread reading ``/proc``; pages
shared between the server and its forked workers count in each, so an upper bound).

Dimensions, one varied at a time from a base (16 recordings × 60 s, window 2 s, hop 1, batch 64,
--workers 0, 1 client), each decoded every epoch (``--decoded-cache-mb 0``) and decoded kept (the
default budget, which holds these datasets from the untimed warm-up round on):

1. clients: 1, 2, 4, 8, 16, concurrently;
2. recording length: 30, 60, 120, 240 s, the same total seconds (about the same windows) in
   fewer, longer recordings;
3. window length: ``--window 1, 2, 4, 8``, ``--hop 1``;
4. ``--workers 0, 1, 2, 4``;
5. and, for memory per cache MB, ``--decoded-cache-mb 0, 32, 64, 128, 192`` on 128 recordings
   × 60 s, whose decoded split (about 250 MB) is larger than every budget, so each fills.

One server per point for its whole dimension (no point inherits another's peak memory); rounds
alternate over a dimension's points (A B C … A B C …) and medians are taken over them.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from benchmarks.clients import HWM, TIMEOUT_S, Clients
from benchmarks.common import DEFAULT_DATA_DIR, RESULTS_DIR, Contender, Round, ServerProcess, alternate, progress
from benchmarks.pipeline import ensure_dataset
from benchmarks.report import Metric, RatioSpec, build_report, environment, server_cpu_ms_per_window, write_results
from fuelline.protocol.common.cpu import process_cpu_seconds
from fuelline.server.multimodal.source import WindowSource

__all__ = ["run", "main"]

EVERY_EPOCH, KEPT = "decoded every epoch", "decoded kept"
MODES = {EVERY_EPOCH: ["--decoded-cache-mb", "0"], KEPT: []}  # KEPT: the default budget
BATCH_SIZE = 64
SAMPLE_S = 0.025


@dataclass(frozen=True)
class Sizes:
    """The points of each dimension and the base they vary from."""

    clients: tuple[int, ...]
    recording_s: tuple[int, ...]
    total_s: int  # recordings × seconds, the same for every recording length
    windows_s: tuple[int, ...]
    workers: tuple[int, ...]
    base_s: int  # the base dataset: total_s / base_s recordings of base_s seconds
    windows_per_round: int  # each point reads at least this many windows a round, in whole epochs
    cache_mb: tuple[int, ...]  # --decoded-cache-mb budgets, all below the cache dataset's decoded size
    cache_recordings: int  # the cache dataset: this many recordings of base_s seconds


def sizes(quick: bool) -> Sizes:
    if quick:
        return Sizes((1, 2), (10, 20), 80, (1, 2), (0, 1), 20, 200, (0, 1, 2), 4)
    return Sizes((1, 2, 4, 8, 16), (30, 60, 120, 240), 960, (1, 2, 4, 8), (0, 1, 2, 4), 60, 12000,
                 (0, 32, 64, 128, 192), 128)


@dataclass(frozen=True)
class CostRound(Round):
    """A Round whose ``rows`` are every window served (first batches included), with the peak RSS
    of the server and its workers over the round."""

    peak_rss_mb: float


def peak_rss_mb(r: Round) -> float:
    return r.peak_rss_mb if isinstance(r, CostRound) else float("nan")


@dataclass(frozen=True)
class Point:
    dimension: str
    x: int
    mode: str
    dataset: str
    clients: int = 1
    window: int = 2
    workers: int = 0
    cache_mb: int | None = None  # a budget of its own instead of the mode's

    @property
    def name(self) -> str:
        return f"{self.dimension} {self.x}" + (f", {self.mode}" if self.cache_mb is None else "")

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "fuelline.server.cli", "serve", self.dataset, "--port", "0",
                "--batch-size", str(BATCH_SIZE), "--hwm", str(HWM), "--status-interval", "0",
                "--window", str(self.window), "--hop", "1", "--workers", str(self.workers),
                *(MODES[self.mode] if self.cache_mb is None else ["--decoded-cache-mb", str(self.cache_mb)])]


# -- memory -----------------------------------------------------------------------------------------
def _rss_mb(pid: int) -> float:
    """VmRSS of a process and all its descendants (a server's worker processes), summed."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            for tid in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (tid / "children").read_text().split()]
        except OSError:  # a process that ended while it was read
            pass
    return total / 1024


class PeakRss(threading.Thread):
    """The highest summed RSS of a process tree while it is watched."""

    def __init__(self, pid: int) -> None:
        super().__init__(name=f"rss-{pid}", daemon=True)
        self.pid, self.peak = pid, _rss_mb(pid)
        self._done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.wait(SAMPLE_S):
            self.peak = max(self.peak, _rss_mb(self.pid))

    def stop(self) -> float:
        self._done.set()
        self.join(5)
        return max(self.peak, _rss_mb(self.pid))


# -- one round ----------------------------------------------------------------------------------------
def read_round(clients: Clients, server: ServerProcess, n: int, epochs: int) -> CostRound:
    """Clients 0…n-1 each read ``epochs`` full epochs at once; the server's CPU and peak RSS
    over the whole round (connecting included: a client's connection is part of its cost)."""
    cpu0 = process_cpu_seconds(server.pid)
    ccpu0 = [process_cpu_seconds(p.pid) or 0.0 for p in clients.procs[:n]]
    rss = PeakRss(server.pid)
    started = time.monotonic()
    for i in range(n):
        clients.ask(i, [f"{server.host}:{server.port}"], 0, 1, epochs)
    replies = []
    try:
        for i, conn in enumerate(clients.conns[:n]):
            if not conn.poll(10 * TIMEOUT_S):
                raise TimeoutError(f"client {i} of {n} on {server.name}: no report within {10 * TIMEOUT_S:.0f}s")
            replies.append(conn.recv())
    finally:
        peak = rss.stop()
    seconds = time.monotonic() - started
    cpu1 = process_cpu_seconds(server.pid)
    ccpu1 = [process_cpu_seconds(p.pid) or 0.0 for p in clients.procs[:n]]
    errors = [r[1] for r in replies if r[0] != "ok"]
    if errors:
        raise RuntimeError(f"{server.name}: {len(errors)} of {n} clients failed: {errors[0]}")
    producer = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    return CostRound(sum(r[1] for r in replies), sum(r[2] for r in replies), sum(r[3] for r in replies), seconds,
                     sum(ccpu1) - sum(ccpu0), producer, peak)


def train_split(dataset: str, window: int = 2) -> tuple[int, float]:
    """Windows of the train split, and its MB decoded: what a cache that keeps it all holds."""
    source = WindowSource(dataset, window=float(window), hop=1.0)
    try:
        row = sum(int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize for c in source.column_specs(source.sources))
        return source.rows("train"), source.rows("train") * row / 2**20
    finally:
        source.close()


def points(size: Sizes, data_dir: Path) -> dict[str, list[Point]]:
    def data(seconds: int) -> str:
        return str(ensure_dataset(data_dir, size.total_s // seconds, float(seconds)))

    base = data(size.base_s)
    out: dict[str, list[Point]] = {"clients": [], "recording s": [], "window s": [], "workers": []}
    for mode in MODES:
        out["clients"] += [Point("clients", n, mode, base, clients=n) for n in size.clients]
        out["recording s"] += [Point("recording s", s, mode, data(s)) for s in size.recording_s]
        out["window s"] += [Point("window s", w, mode, base, window=w) for w in size.windows_s]
        out["workers"] += [Point("workers", k, mode, base, workers=k) for k in size.workers]
    # Budgets smaller than this dataset's decoded split, so each fills to its budget: RSS per cache MB.
    big = str(ensure_dataset(data_dir, size.cache_recordings, float(size.base_s)))
    out["decoded-cache MB"] = [Point("decoded-cache MB", mb, KEPT, big, cache_mb=mb) for mb in size.cache_mb]
    return out


def measure(dimension: list[Point], clients: Clients, size: Sizes, rounds: int,
            logs: Path) -> tuple[dict[str, list[Round]], dict[str, dict[str, Any]]]:
    """Start one server per point, alternate rounds over the points, stop the servers; the
    rounds per point, and how each server ended when told to stop."""
    cpu = server_cpu_ms_per_window()
    with ExitStack() as stack:
        contenders, servers = [], []
        for i, p in enumerate(dimension):
            server = stack.enter_context(ServerProcess(p.name, p.argv(), logs / f"{p.dimension}-{i}.log"))
            servers.append(server)
            per_epoch = p.clients * train_split(p.dataset, p.window)[0]
            epochs = max(1, math.ceil(size.windows_per_round / per_epoch))
            contenders.append(Contender(p.name, functools.partial(read_round, clients, server, p.clients, epochs)))
        results = alternate(contenders, rounds,
                            lambda r: f"{cpu.of(r):.3f} ms/window, {peak_rss_mb(r):.0f} MB, {r.rows} windows")
        return results, {s.name: s.stop() for s in servers}


# -- report and plot ----------------------------------------------------------------------------------
def series(results: dict[str, list[Round]], pts: dict[str, list[Point]], metrics: Sequence[Metric]) -> dict[str, Any]:
    """Per dimension and mode: x, and each metric's median/min/max at every x."""
    out: dict[str, Any] = {}
    for dim, dim_points in pts.items():
        out[dim] = {"x": sorted({p.x for p in dim_points}), "modes": {}}
        for mode in MODES:
            mine = [p for p in dim_points if p.mode == mode]
            if mine:
                values = {m.unit: [[m.of(r) for r in results[p.name]] for p in mine] for m in metrics}
                out[dim]["modes"][mode] = {unit: [{"median": statistics.median(v), "min": min(v), "max": max(v)}
                                                  for v in per_point] for unit, per_point in values.items()}
    return out


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    return float(np.polyfit(xs, ys, 1)[0]) if len(xs) > 1 else float("nan")


def derived(by_dim: dict[str, Any], size: Sizes, decoded_mb: dict[str, float]) -> dict[str, Any]:
    """What the sizing guide quotes, computed from the medians (one place, so docs and run agree)."""
    cpu, rss = "server CPU ms/window", "peak RSS MB"

    def med(dim: str, mode: str, unit: str) -> list[float]:
        return [s["median"] for s in by_dim[dim]["modes"][mode][unit]]

    def by_x(dim: str, mode: str, unit: str) -> dict[int, float]:
        return dict(zip(by_dim[dim]["x"], med(dim, mode, unit)))

    out: dict[str, Any] = {"decoded_mb": decoded_mb}
    base = {"clients": size.clients[0], "recording s": size.base_s, "window s": 2, "workers": 0}
    for mode in MODES:
        out[mode] = {
            "cores_per_10k_windows_s_1_client": med("clients", mode, cpu)[0] * 10,
            "cores_per_10k_windows_s_most_clients": med("clients", mode, cpu)[-1] * 10,
            "rss_mb_per_client": _slope(by_dim["clients"]["x"], med("clients", mode, rss)),
            "rss_mb_per_worker": _slope(by_dim["workers"]["x"], med("workers", mode, rss)),
            **{f"{unit}_by_{dim}": by_x(dim, mode, unit) for dim in base for unit in (cpu, rss)},
            # The same configuration, measured in every dimension: how far dimensions drift apart.
            "base_cpu_by_dimension": {dim: by_x(dim, mode, cpu).get(x) for dim, x in base.items()},
        }
    cache = by_dim["decoded-cache MB"]
    # Only budgets the split overflows: a larger one holds the split and stops growing.
    fills = [(x, y) for x, y in zip(cache["x"], med("decoded-cache MB", KEPT, rss)) if x < decoded_mb["cache"]]
    out["rss_mb_per_cache_mb"] = _slope([x for x, _ in fills], [y for _, y in fills])
    return out


def ratios(size: Sizes) -> list[RatioSpec]:
    """CPU per window: kept over every-epoch decoding, and the most clients over one, per mode."""
    one, most = size.clients[0], size.clients[-1]
    return [RatioSpec(f"clients {one}, {KEPT}", f"clients {one}, {EVERY_EPOCH}"),
            *(RatioSpec(f"clients {most}, {m}", f"clients {one}, {m}") for m in MODES)]


def plot(record: dict[str, Any], results_dir: Path) -> Path:
    from benchmarks.plots import FUELLINE_COLOR, OTHER_COLOR, _save, plt

    by_dim = record["dimensions"]
    labels = {"clients": "concurrent clients (each a full epoch)", "recording s": "recording length, s (same total)",
              "window s": "--window, s (hop 1)", "workers": "--workers",
              "decoded-cache MB": "--decoded-cache-mb (below the split: fills)"}
    colors = {EVERY_EPOCH: OTHER_COLOR, KEPT: FUELLINE_COLOR}
    fig, axes = plt.subplots(2, len(by_dim), figsize=(4.2 * len(by_dim), 7.4), squeeze=False)
    for col, (dim, part) in enumerate(by_dim.items()):
        for row, unit in enumerate(("server CPU ms/window", "peak RSS MB")):
            ax, top = axes[row][col], 0.0
            for mode, by_unit in part["modes"].items():
                stats, color = by_unit[unit], colors[mode]
                med = [s["median"] for s in stats]
                err = [[m - s["min"] for m, s in zip(med, stats)], [s["max"] - m for m, s in zip(med, stats)]]
                label = mode if dim != "decoded-cache MB" else "1 client, budget filled"
                ax.errorbar(part["x"], med, yerr=err, marker="o", capsize=4, color=color, label=label)
                top = max(top, *(s["max"] for s in stats))
            ax.set_xticks(part["x"])
            ax.set_xlabel(labels[dim])
            ax.set_ylabel(f"{unit} (median, min–max)")
            ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
            ax.legend(fontsize=8, loc="best")
    fig.suptitle(record["title"], fontsize=10)
    return _save(fig, results_dir / "cost.png")


def _notes(size: Sizes, rounds: int, f: dict[str, Any]) -> list[str]:
    both = lambda key, fmt: "; ".join(f"{m} {fmt.format(f[m][key])}" for m in MODES)  # noqa: E731
    drift = lambda m: ", ".join(f"{v:.3f}" for v in f[m]["base_cpu_by_dimension"].values() if v is not None)  # noqa: E731
    return [
        f"{rounds} timed rounds after one untimed warm-up round of every point, the points of a dimension "
        "alternately. Rounds are short (about a second a point): this machine's 2 cores are shared and noisy, so "
        "medians of short alternating rounds rather than one long run. One server process per point for its "
        "whole dimension, so no point inherits another's peak memory.",
        f"Base: {size.total_s // size.base_s} recordings × {size.base_s} s, window 2 s, hop 1, batch {BATCH_SIZE}, "
        "--workers 0, 1 client; each dimension varies one of these. Recording length keeps the total seconds "
        f"({size.total_s} s), and so about the same windows: fewer, longer recordings.",
        f"Every client reads its own full epochs (rank 0 of 1) of the train split, at least {size.windows_per_round} "
        "windows per point per round in whole epochs; n clients ask for n times the windows. Clients are spawned "
        "processes on the same cores as the server.",
        "server CPU ms/window: CPU of the server and its worker processes over the round (connecting included), "
        "over every window served. peak RSS MB: the server's and its workers' VmRSS summed, sampled every "
        f"{SAMPLE_S * 1e3:.0f} ms. windows/s: every window over the round's wall time. CPU s/GB: server and clients.",
        f"{KEPT}: the default --decoded-cache-mb (1024) holds the decoded train split ({f['decoded_mb']['base']:.0f} "
        f"MB at the base) from the warm-up round on, so timed rounds decode nothing; {EVERY_EPOCH}: "
        "--decoded-cache-mb 0. decoded-cache MB: budgets below the decoded train split of "
        f"{size.cache_recordings} recordings × {size.base_s} s ({f['decoded_mb']['cache']:.0f} MB), so each fills "
        "(RSS per decoded-cache MB is fitted over the budgets below that size only).",
        "Cores per 10k windows/s (ms/window × 10), 1 client: " + both("cores_per_10k_windows_s_1_client", "{:.2f}")
        + f"; {size.clients[-1]} clients: " + both("cores_per_10k_windows_s_most_clients", "{:.2f}")
        + ". RSS per extra client (least-squares slope): " + both("rss_mb_per_client", "{:.1f} MB")
        + "; per extra worker: " + both("rss_mb_per_worker", "{:.1f} MB")
        + f"; per decoded-cache MB: {f['rss_mb_per_cache_mb']:.2f} MB.",
        "The base configuration is measured once in every dimension; its CPU ms/window there shows how far "
        f"dimensions measured minutes apart drift: {EVERY_EPOCH} {drift(EVERY_EPOCH)}; {KEPT} {drift(KEPT)}.",
    ]


def run(rounds: int, data_dir: Path, results_dir: Path = RESULTS_DIR, quick: bool = False) -> dict[str, Any]:
    """Measure every point, write ``cost.json``, ``cost.md`` and ``cost.png``; return the record."""
    env = environment()
    size = sizes(quick)
    pts = points(size, data_dir)
    base = pts["clients"][0].dataset
    cpu = server_cpu_ms_per_window()
    rss = Metric("peak RSS MB", peak_rss_mb, "{:,.0f}")
    wps = Metric("windows/s", lambda r: r.rows / r.seconds, "{:,.0f}")
    results: dict[str, list[Round]] = {}
    exits: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-") as logs, ExitStack() as stack:
        progress(f"starting {max(size.clients)} client processes ...")
        clients = Clients(max(size.clients))
        stack.callback(clients.close)
        for dim, dim_points in pts.items():
            progress(f"-- {dim}: {len(dim_points)} servers")
            dim_results, dim_exits = measure(dim_points, clients, size, rounds, Path(logs))
            results.update(dim_results)
            exits.update(dim_exits)
    elapsed = time.perf_counter() - started
    by_dim = series(results, pts, [cpu, rss])
    figures = derived(by_dim, size, {"base": train_split(base)[1],
                                     "cache": train_split(pts["decoded-cache MB"][0].dataset)[1]})
    parameters = {"rounds": rounds, "quick": quick, **size.__dict__, "batch_size": BATCH_SIZE, "hwm": HWM,
                  "base_dataset": base, "modes": {m: " ".join(a) or "default --decoded-cache-mb" for m, a in MODES.items()},
                  "seconds_measuring": round(elapsed)}
    notes = _notes(size, rounds, figures)
    record, md = build_report(
        "cost", "cost — server CPU per window and peak RSS, by clients, recording length, window, workers and cache",
        results, [cpu, rss, wps], ratios(size), parameters, notes, env, exits=exits,
        extra={"dimensions": by_dim, "derived": figures},
    )
    print(md, flush=True)
    for path in write_results("cost", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    print(f"wrote {plot(record, results_dir)}", flush=True)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per point (default 5)")
    p.add_argument("--quick", action="store_true", help="tiny datasets, 2 points per dimension, 2 rounds: a smoke run")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where datasets are made and reused")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="where cost.json, .md and .png go (default benchmarks/results; with --quick, a temporary one)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    rounds = min(args.rounds, 2) if args.quick else args.rounds
    results = args.results_dir or (Path(tempfile.mkdtemp(prefix="fuelline-bench-quick-")) if args.quick else RESULTS_DIR)
    run(rounds, args.data_dir, results, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
