"""The plan and the verdict of a fault schedule (run by ``fault_schedule.py``).

``make_schedule`` draws a schedule from ``random.Random(seed)``: the served options, the client
stops (``resume`` kinds: every rank stops after the same batch and new readers go on from its
``state_dict``) and the faults, each due after a number of batches delivered in all. ``walk`` is
the reference the readers must match: per (job, rank, epoch) the batches that the documented order
(``fuelline.server.sources.ordering``) and ``load_state_dict`` give. ``check`` holds what a run saw to
that reference and to the bounds on the server's memory and threads.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow.parquet as pq

from fuelline.protocol import FingerprintMismatch
from fuelline.server.sources.ordering import epoch_order, rank_rows, remaining_order, rows_per_rank

KINDS = ("kill", "other-options", "pause", "cut", "delay", "stall", "silent-peers", "hostile-peers",
         "resume", "resume-resized", "resume-epoch-end", "slow-stage", "hanging-stage", "shard-swap")
CLIENT_KINDS = ("resume", "resume-resized", "resume-epoch-end")
# Faults after which the server serves another sequence: readers may raise FingerprintMismatch,
# and nothing is due after them (one per schedule, last).
TERMINAL_KINDS = ("other-options", "shard-swap")
STAGE_KINDS = ("slow-stage", "hanging-stage")  # the server runs the harness's stage (fault_stage.py)
STAGE = "support.fault_stage:stage"
STAGE_SPLITS = ("train", "val", "train,val")  # the splits a slow stage slows
RSS_BOUND_MB = 300.0  # growth allowed over the server's RSS at readiness
THREAD_BOUND = 40  # growth allowed over its thread count at readiness


@dataclass(frozen=True)
class Options:
    """What a run serves, and how its clients read."""

    rows: int = 2000  # a fifth of them are the val split
    files: int = 4
    row_group_rows: int = 50
    dim: int = 4
    batch_size: int = 24
    seed: int = 0
    shuffle_block: int = 4
    workers: int = 0
    epochs: int = 2
    world: int = 2
    hwm: int = 4
    pace: float = 0.05  # seconds of "training" per batch, so that faults meet readers mid-epoch
    timeout: float = 20.0  # the clients' timeout and receive_timeout
    heartbeat: float = 0.2  # the clients'
    server_heartbeat: float = 0.3
    stage: bool = False  # serve through the harness's stage (drawn with a stage kind)
    plain: bool = False  # shards of as many rows have the same size (drawn with shard-swap)

    @property
    def train_rows(self) -> int:
        return self.rows - max(1, int(self.rows * 0.2))  # as write_sample_dataset splits them

    def serve_args(self, dataset: Path, port: int) -> list[str]:
        return [sys.executable, "-m", "fuelline.server.cli", "serve", str(dataset), "--port", str(port),
                "--batch-size", str(self.batch_size), "--seed", str(self.seed), "--hwm", str(self.hwm),
                "--heartbeat", str(self.server_heartbeat), "--shuffle-block", str(self.shuffle_block),
                "--workers", str(self.workers), "--status-interval", "0", *(["--stage", STAGE] if self.stage else [])]


@dataclass(frozen=True)
class Fault:
    """A fault applied ``wait`` seconds after the readers have delivered ``at`` batches in all."""

    kind: str
    at: int
    wait: float
    length: float = 0.0  # seconds it lasts: downtime, pause, stall, delay, peers held, stage slow
    count: int = 0  # peers, or the delay in milliseconds (of each chunk, or of each batch in a slow stage)
    change: tuple[str, str] = ("", "")  # other-options: the option and its new value; slow-stage: ("splits", ...)

    def __str__(self) -> str:
        what = {"kill": f" down {self.length:.2f}s", "shard-swap": f" down {self.length:.2f}s",
                "delay": f" {self.count} ms", "other-options": " %s %s" % self.change,
                "slow-stage": f" {self.count} ms a batch of {self.change[1]}",
                "silent-peers": f" {self.count}", "hostile-peers": f" {self.count}"}.get(self.kind, "")
        lasting = (f" for {self.length:.2f}s" if self.kind in ("pause", "stall", "delay", "slow-stage") or "peers" in self.kind
                   else "")
        return f"{self.kind}{what}{lasting} at batch {self.at} (+{self.wait:.2f}s)"


@dataclass(frozen=True)
class Stop:
    """Every rank of a job stops after batch ``cursor`` of ``epoch`` (or after the epoch's end,
    with ``after_end``); the next job reads on with ``world`` ranks."""

    kind: str
    epoch: int
    cursor: int
    after_end: bool
    world: int

    def __str__(self) -> str:
        where = f"end of epoch {self.epoch}" if self.after_end else f"epoch {self.epoch} batch {self.cursor}"
        return f"{self.kind}: stop after {where}, resume on world size {self.world}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    options: Options
    faults: tuple[Fault, ...]
    stops: tuple[Stop, ...]
    steps: int
    kinds: tuple[str, ...] = KINDS

    def describe(self) -> str:
        o = self.options
        head = (f"seed {self.seed}: world {o.world}, {o.epochs} epochs, batch size {o.batch_size}, --seed {o.seed}, "
                f"--workers {o.workers}{' --stage ' + STAGE if o.stage else ''}{', plain shards' if o.plain else ''} (replay: cd tests && python -m support.fault_schedule --seed {self.seed} --steps {self.steps}"
                f"{'' if self.kinds == KINDS else ' --kinds ' + ','.join(self.kinds)})")
        return "\n".join([head, *(f"  {x}" for x in (*self.stops, *self.faults))])


def walk(opts: Options, stops: tuple[Stop, ...], order_of: Callable[[int], np.ndarray]):
    """The reference: [(job, rank, epoch, batches)] for every rank of every job, as the documented
    order and ``load_state_dict`` (a resize appends (world, cursor) to the epoch's history) say;
    and per epoch how many rows wrap-padding repeats (world - 1 at most, per world size it ran on)."""
    out, pads = [], [0] * opts.epochs
    world, epoch, cursor, history, bs = opts.world, 0, 0, (), opts.batch_size
    for job, stop in enumerate((*stops, None)):
        while epoch < opts.epochs:
            rest = remaining_order(order_of(epoch), history, bs)
            if cursor == 0 and len(rest):  # a phase starts: a new epoch, or a resize
                pads[epoch] += world * rows_per_rank(len(rest), world) - len(rest)
            ends = stop is not None and stop.epoch == epoch and not stop.after_end
            for rank in range(world):
                span = rank_rows(rest, rank, world)
                take = span[cursor * bs:stop.cursor * bs if ends else len(span)]
                out.append((job, rank, epoch, [take[i:i + bs] for i in range(0, len(take), bs)]))
            if ends:
                cursor = stop.cursor
                break
            epoch, cursor, history = epoch + 1, 0, ()
            if stop is not None and stop.after_end and stop.epoch == epoch - 1:
                break
        if stop is not None and stop.world != world:
            history, cursor, world = history + ((world, cursor),), 0, stop.world
    return out, pads


def make_schedule(seed: int, steps: int = 6, kinds: tuple[str, ...] = KINDS) -> Schedule:
    """The schedule of ``seed``: options, client stops and faults, all drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    opts = Options(seed=rng.randrange(1000), world=rng.choice([2, 3]), batch_size=rng.choice([20, 24, 32]),
                   workers=rng.choice([0, 0, 1]))
    picked = [rng.choice(kinds) for _ in range(steps)]
    stops: list[Stop] = []
    world, epoch, cursor, history = opts.world, 0, 0, ()
    for kind, f in sorted(((k, rng.random()) for k in picked if k in CLIENT_KINDS), key=lambda x: x[1]):
        e = max(epoch, min(opts.epochs - 1, int(f * opts.epochs)))
        c, h = (cursor, history) if e == epoch else (0, ())
        rest = len(remaining_order(np.arange(opts.train_rows), h, opts.batch_size))
        batches = -(-rows_per_rank(rest, world) // opts.batch_size) if rest else 0
        new_world = world if kind == "resume" else rng.choice([w for w in (1, 2, 3, 4) if w != world])
        after, k = False, rng.randint(c + 1, batches - 1) if batches - 1 > c else -1
        if kind == "resume-epoch-end":
            after, k, new_world = e < opts.epochs - 1 and rng.random() < 0.5, batches, rng.choice([1, 2, 3, 4])
        if k <= c and not after:
            continue  # no batch left to stop after in this phase
        stops.append(Stop(kind, e, k, after, new_world))
        epoch, cursor, history = (e + 1, 0, ()) if after else (e, k, h)
        if new_world != world:
            history, cursor, world = history + ((world, cursor),), 0, new_world
    total = sum(len(b) for *_, b in walk(opts, tuple(stops), lambda e: np.arange(opts.train_rows))[0])
    # One terminal fault at most, last (a second one drawn is a kill: nothing would follow the first).
    others = [k for k in picked if k not in CLIENT_KINDS]
    terminal = [k for k in others if k in TERMINAL_KINDS]
    others = [k for k in others if k not in TERMINAL_KINDS] + ["kill"] * (len(terminal) - 1) + terminal[:1]
    faults = []
    for kind, f in zip(others, sorted(rng.uniform(0.05, 0.8) for _ in others)):
        length = {"kill": rng.uniform(0.0, 1.0), "pause": rng.uniform(0.3, 2.5), "stall": rng.uniform(0.3, 2.5),
                  "delay": rng.uniform(0.5, 2.0), "silent-peers": rng.uniform(1.0, 3.0),
                  "hostile-peers": rng.uniform(1.0, 2.0), "slow-stage": rng.uniform(1.0, 4.0),
                  "shard-swap": rng.uniform(0.0, 1.0)}.get(kind, 0.0)
        # A slow stage's batch takes 1 to 5 of the server's heartbeats (0.3 s): its clients must hear them.
        count = {"delay": rng.randint(20, 200), "silent-peers": rng.randint(30, 80),
                 "hostile-peers": rng.randint(3, 10), "slow-stage": rng.randint(300, 1500)}.get(kind, 0)
        change = ("", "")
        if kind == "other-options":
            change = rng.choice([("--seed", str(opts.seed + 1 + rng.randrange(100))),
                                 ("--batch-size", str(opts.batch_size + 8))])
        elif kind == "slow-stage":
            change = ("splits", rng.choice(STAGE_SPLITS))
        faults.append(Fault(kind, int(f * total), rng.uniform(0.0, 0.3), length, count, change))
    opts = replace(opts, stage=any(k in STAGE_KINDS for k in others), plain="shard-swap" in others)
    return Schedule(seed, opts, tuple(faults), tuple(stops), steps, tuple(kinds))


def check(schedule: Schedule, dataset: Path, *, got: dict[tuple[int, int, int], list[np.ndarray]],
          errors: dict[tuple[int, int], tuple[float, BaseException]], finished: set[tuple[int, int]],
          mismatch_restart: float | None, peaks: dict[int, list[float]], failures: list[str],
          figures: list[str]) -> None:
    """Hold a run of ``schedule`` on ``dataset`` to the invariant; what breaks it goes to ``failures``.

    Args:
        got: per (job, rank, epoch) the batches of ``sample_id`` delivered.
        errors: per (job, rank) when a reader raised, and what.
        finished: the (job, rank) readers that completed.
        mismatch_restart: when the server came back with other options, if it did.
        peaks: per server pid, [RSS and threads at readiness, their peaks].
        failures: the run's failures so far; the id-set check runs only where there are none.
        figures: what was measured, for the report.
    """
    o, fail = schedule.options, failures
    groups = [pq.ParquetFile(f).read_row_group(g, columns=["sample_id"]).column(0).to_numpy()
              for f in sorted((dataset / "train").glob("*.parquet")) for g in range(pq.ParquetFile(f).num_row_groups)]
    ids_of_row, lengths = np.concatenate(groups), np.array([len(g) for g in groups])
    expected, pads = walk(o, schedule.stops, lambda e: ids_of_row[epoch_order(lengths, o.seed, e, True, o.shuffle_block)])
    for (job, rank), (when, exc) in sorted(errors.items()):
        if mismatch_restart is not None and when > mismatch_restart and isinstance(exc, FingerprintMismatch):
            figures.append(f"job {job} rank {rank} raised, as allowed: {exc!r:.300}")
        else:
            fail.append(f"job {job} rank {rank} raised {exc!r:.600}")
    for job, rank, epoch, batches in expected:
        delivered = got.get((job, rank, epoch), [])
        if (job, rank) not in finished:
            batches = batches[:len(delivered)]  # an error (reported above, or allowed) ended the reader
        bad = next((i for i, (want, have) in enumerate(zip(batches, delivered))
                    if not np.array_equal(want, have)), None)
        if bad is not None:
            fail.append(f"job {job} rank {rank} epoch {epoch} batch {bad}: got ids {delivered[bad][:6]}... "
                        f"({len(delivered[bad])}), expected {batches[bad][:6]}... ({len(batches[bad])})")
        elif len(delivered) != len(batches):
            fail.append(f"job {job} rank {rank} epoch {epoch}: {len(delivered)} batches, expected {len(batches)}")
    for key in sorted(set(got) - {(j, r, e) for j, r, e, _ in expected}):
        fail.append(f"job {key[0]} rank {key[1]} epoch {key[2]}: {len(got[key])} batches nobody expected")
    if not errors and not fail:  # the same, without the reference: each id once, but padding
        for epoch in range(o.epochs):
            ids = np.concatenate([b for (_, _, e), bs in got.items() if e == epoch for b in bs])
            distinct = np.unique(ids)
            if not np.array_equal(distinct, np.sort(ids_of_row)) or len(ids) - len(distinct) > pads[epoch]:
                fail.append(f"epoch {epoch}: {len(distinct)} distinct ids of {len(ids_of_row)}, "
                            f"{len(ids) - len(distinct)} repeated (padding allows {pads[epoch]})")
    for pid, (rss0, threads0, rss, threads) in peaks.items():
        figures.append(f"server {pid}: RSS {rss0:.0f} -> peak {rss:.0f} MB, threads {threads0} -> {threads}")
        if rss - rss0 > RSS_BOUND_MB or threads - threads0 > THREAD_BOUND:
            fail.append(f"server {pid} grew from {rss0:.0f} MB / {threads0} threads at readiness to {rss:.0f} MB / "
                        f"{threads} threads (bounds +{RSS_BOUND_MB:.0f} MB, +{THREAD_BOUND} threads)")
