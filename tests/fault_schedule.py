"""Fault schedules against a real data server and real clients, in the manner of Jepsen.

A run writes a small sample dataset, starts ``fuelline serve`` behind a loopback TCP proxy
(``tcp_proxy.TcpProxy``) and reads ``epochs`` epochs with ``world`` client ranks, a thread each,
recording every ``sample_id`` delivered. A schedule drawn from ``random.Random(seed)`` applies
faults meanwhile, each once the readers have delivered a given number of batches in all (so that
a replay meets the same progress), after a random wait that is part of the schedule:

* ``kill``: kill -9 the server and restart it on the same port with the same options;
* ``other-options``: kill -9 and restart with another ``--seed`` or ``--batch-size`` (always last);
* ``pause``: SIGSTOP, and SIGCONT well within the clients' timeout;
* ``cut`` / ``delay`` / ``stall``: the proxy resets every connection, holds every chunk a while,
  or forwards nothing for a while;
* ``silent-peers``: raw DEALERs that send a Hello (credit 0, heartbeat 3600 s) and nothing more;
* ``hostile-peers``: DEALERs that lie about credit (``Credit(2**30)`` again and again) and send garbage;
* ``resume`` / ``resume-resized`` / ``resume-epoch-end``: every rank stops after the same batch,
  as a torchrun job would, saves its ``state_dict`` and closes; new readers go on from there, on
  the same world size (each from its own state) or another (each from rank 0's).

The invariant: per (job, rank, epoch) the batches equal the reference, which follows the documented
order (``fuelline.server.ordering``: the epoch's order, contiguous wrap-padded rank spans,
``remaining_order`` after a resize); apart from that, per epoch the ranks together got every id
of the split, repeated no more than padding allows; every ``features`` row matches its id; every
reader completed, unless a restart with other options made it raise ``FingerprintMismatch`` (then
what it got is a prefix of the reference); the server's RSS and threads stayed within bounds of
their values at readiness; worker processes die with a killed server; the last server exits 0 on
SIGTERM and leaves no hand-off file. A failure prints its seed and schedule; ``--seed N`` replays it.
"""

from __future__ import annotations

import argparse
import glob
import logging
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow.parquet as pq
import zmq

from fuelline.client import ServerDataStream
from fuelline.protocol import Credit, FingerprintMismatch, Hello, encode
from fuelline.server.ordering import epoch_order, rank_rows, remaining_order, rows_per_rank
from fuelline.server.sample import expected_features, write_sample_dataset

from conftest import ServerProcess, wait_until
from tcp_proxy import TcpProxy

KINDS = ("kill", "other-options", "pause", "cut", "delay", "stall", "silent-peers", "hostile-peers",
         "resume", "resume-resized", "resume-epoch-end")
CLIENT_KINDS = ("resume", "resume-resized", "resume-epoch-end")
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

    @property
    def train_rows(self) -> int:
        return self.rows - max(1, int(self.rows * 0.2))  # as write_sample_dataset splits them

    def serve_args(self, dataset: Path, port: int) -> list[str]:
        return [sys.executable, "-m", "fuelline.server.cli", "serve", str(dataset), "--port", str(port),
                "--batch-size", str(self.batch_size), "--seed", str(self.seed), "--hwm", str(self.hwm),
                "--heartbeat", str(self.server_heartbeat), "--shuffle-block", str(self.shuffle_block),
                "--workers", str(self.workers), "--status-interval", "0"]


@dataclass(frozen=True)
class Fault:
    """A fault applied ``wait`` seconds after the readers have delivered ``at`` batches in all."""

    kind: str
    at: int
    wait: float
    length: float = 0.0  # seconds it lasts: downtime, pause, stall, delay, peers held
    count: int = 0  # peers, or the delay in milliseconds
    change: tuple[str, str] = ("", "")  # other-options: the option and its new value

    def __str__(self) -> str:
        what = {"kill": f" down {self.length:.2f}s", "delay": f" {self.count} ms", "other-options": " %s %s" % self.change,
                "silent-peers": f" {self.count}", "hostile-peers": f" {self.count}"}.get(self.kind, "")
        lasting = f" for {self.length:.2f}s" if self.kind in ("pause", "stall", "delay") or "peers" in self.kind else ""
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
                f"--workers {o.workers} (replay: python tests/fault_schedule.py --seed {self.seed} --steps {self.steps}"
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
    others = sorted((k for k in picked if k not in CLIENT_KINDS), key=lambda k: k == "other-options")
    faults = []
    for kind, f in zip(others, sorted(rng.uniform(0.05, 0.8) for _ in others)):
        length = {"kill": rng.uniform(0.0, 1.0), "pause": rng.uniform(0.3, 2.5), "stall": rng.uniform(0.3, 2.5),
                  "delay": rng.uniform(0.5, 2.0), "silent-peers": rng.uniform(1.0, 3.0),
                  "hostile-peers": rng.uniform(1.0, 2.0)}.get(kind, 0.0)
        count = {"delay": rng.randint(20, 200), "silent-peers": rng.randint(30, 80),
                 "hostile-peers": rng.randint(3, 10)}.get(kind, 0)
        change = rng.choice([("--seed", str(opts.seed + 1 + rng.randrange(100))),
                             ("--batch-size", str(opts.batch_size + 8))]) if kind == "other-options" else ("", "")
        faults.append(Fault(kind, int(f * total), rng.uniform(0.0, 0.3), length, count, change))
    return Schedule(seed, opts, tuple(faults), tuple(stops), steps, tuple(kinds))


def proc_status(pid: int) -> tuple[float, int]:
    """(VmRSS in MB, threads) of a live process."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"])


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # state, parent, ...


def descendants(pid: int) -> set[int]:
    """Live processes below ``pid`` (its worker processes), from /proc's parent links."""
    parents = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parents[int(entry.name)] = int(_stat(int(entry.name))[1])
        except (OSError, IndexError, ValueError):
            continue
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = {p for p, q in parents.items() if q == parent} - found
        found |= kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@dataclass
class Outcome:
    schedule: Schedule
    failures: list[str] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def report(self) -> str:
        return "\n".join([f"{'PASS' if self.ok else 'FAIL'} in {self.elapsed:.1f}s, {self.schedule.describe()}",
                          "fired:", *(f"  {x}" for x in self.fired or ["nothing"]), *(f"  {x}" for x in self.figures),
                          *(f"FAILED: {x}" for x in self.failures)])


class Run:
    """One run of a schedule: ``execute`` returns its Outcome and leaves no process behind."""

    def __init__(self, schedule: Schedule, workdir: Path, deadline: float) -> None:
        self.s, self.o, self.dir = schedule, schedule.options, workdir
        self.out = Outcome(schedule)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + deadline
        self.cond = threading.Condition()  # progress, started, readers_done
        self.progress = 0  # batches delivered to every reader of every job
        self.started = 0  # faults started
        self.readers_done = False
        self.abort = threading.Event()
        self.got: dict[tuple[int, int, int], list[np.ndarray]] = {}  # (job, rank, epoch): batches of ids
        self.errors: dict[tuple[int, int], tuple[float, BaseException]] = {}  # (job, rank): (when, what)
        self.finished: set[tuple[int, int]] = set()
        self.states: dict[tuple[int, int], dict] = {}
        self.mismatch_restart: float | None = None  # when the server came back with other options
        self.peaks: dict[int, list[float]] = {}  # pid: [RSS and threads at readiness, their peaks]
        self.servers: list[ServerProcess] = []
        self.killed: set[int] = set()
        self.background: list[threading.Thread] = []  # peers, while they are held
        self.ctx = zmq.Context()
        self.proxy: TcpProxy | None = None

    def _left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def _on_schedule(self) -> bool:
        faults = self.s.faults
        return self.abort.is_set() or self.started == len(faults) or self.progress < faults[self.started].at

    def _stop(self) -> None:
        with self.cond:
            self.abort.set()
            self.cond.notify_all()

    def _start(self, args: list[str]) -> ServerProcess:
        server = ServerProcess(args, self.dir / f"server-{len(self.servers)}.log")
        rss, threads = proc_status(server.proc.pid)
        self.peaks[server.proc.pid] = [rss, threads, rss, threads]
        self.servers.append(server)
        return server

    def _watch(self) -> None:
        while not self.abort.wait(0.02):
            pid = self.servers[-1].proc.pid
            try:
                rss, threads = proc_status(pid)
            except (OSError, KeyError, ValueError):
                continue  # between a kill and a restart
            peak = self.peaks[pid]
            peak[2], peak[3] = max(peak[2], rss), max(peak[3], threads)

    # -- readers --------------------------------------------------------------------------------
    def _read(self, job: int, rank: int, world: int, state: dict | None, stop: Stop | None) -> None:
        o = self.o
        try:
            with ServerDataStream(("sample_id", "features"), host="127.0.0.1", port=self.proxy.port, hwm=o.hwm,
                                  rank=rank, world_size=world, timeout=o.timeout, heartbeat=o.heartbeat,
                                  receive_timeout=o.timeout, local=False, client_id=f"job{job}-rank{rank}") as s:
                if state is not None:
                    s.load_state_dict(state)
                while (epoch := s.state_dict()["epoch"]) < o.epochs and not self.abort.is_set():
                    for ids, features in s.get_epoch_iterator():
                        if not np.array_equal(features, expected_features(ids, o.dim)):
                            raise AssertionError(f"epoch {epoch}: features do not match sample ids {ids[:4]}")
                        self.got.setdefault((job, rank, epoch), []).append(ids.copy())
                        with self.cond:
                            self.progress += 1
                            self.cond.notify_all()
                            # A reader ahead of the schedule waits until the fault now due is under way
                            # (the one before it may still last): each fault meets the progress it was
                            # drawn for, not whatever the readers reached meanwhile.
                            self.cond.wait_for(self._on_schedule, self._left())
                        self.abort.wait(o.pace)  # the training step this reader stands for
                        if stop and not stop.after_end and (epoch, s.state_dict()["cursor"]) == (stop.epoch, stop.cursor):
                            break
                    if stop and epoch == stop.epoch:
                        break
                if not self.abort.is_set():
                    self.states[(job, rank)] = s.state_dict()
                    self.finished.add((job, rank))
        except BaseException as exc:  # the check reports it, with the schedule
            self.errors[(job, rank)] = (time.monotonic(), exc)

    def _jobs(self) -> None:
        world, states = self.o.world, None
        for job, stop in enumerate((*self.s.stops, None)):
            threads = [threading.Thread(target=self._read, name=f"job{job}-rank{r}", daemon=True, args=(
                job, r, world, None if states is None else states[r if len(states) == world else 0], stop))
                for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(self._left())
            stuck = [t.name for t in threads if t.is_alive()]
            if stuck:
                self.out.failures.append(f"readers {stuck} did not finish by the run's deadline")
            if stuck or any((job, r) not in self.finished for r in range(world)):
                return  # what stopped them is reported: an error, the deadline, a fault that failed
            states = [self.states[(job, r)] for r in range(world)]
            world = stop.world if stop else world

    # -- faults ---------------------------------------------------------------------------------
    def _faults(self) -> None:
        for fault in self.s.faults:
            with self.cond:
                due = self.cond.wait_for(lambda: self.progress >= fault.at or self.readers_done, self._left())
                self.started += 1  # readers go on meanwhile: the fault meets them mid-stream
                self.cond.notify_all()
            if not due or self.readers_done or self.abort.wait(fault.wait):
                return
            self.out.fired.append(f"{time.monotonic() - self.t0:6.2f}s, {self.progress} batches: {fault}")
            if fault.kind.endswith("-peers"):  # they stay while the schedule goes on
                self.background.append(threading.Thread(target=self._apply, args=(fault,), daemon=True))
                self.background[-1].start()
            elif not self._apply(fault):
                self._stop()  # a server that does not come back leaves nothing more to learn
                return

    def _apply(self, f: Fault) -> bool:
        try:
            self._act(f)
            return True
        except Exception as exc:
            self.out.failures.append(f"{f}: {exc!r}")
            return False

    def _act(self, f: Fault) -> None:
        server, hold = self.servers[-1], f.length
        if f.kind in ("kill", "other-options"):
            children = descendants(server.proc.pid)
            self.killed.add(server.proc.pid)
            server.kill()
            try:
                wait_until(lambda: not any(alive(p) for p in children), 10.0, "worker processes end")
            except AssertionError:
                self.out.failures.append(f"{f}: {sorted(p for p in children if alive(p))} outlived the killed server")
            self.abort.wait(hold)
            args = server.args[:]
            args[args.index("--port") + 1] = str(self.port)
            if f.kind == "other-options":
                args[args.index(f.change[0]) + 1] = f.change[1]
                self.mismatch_restart = self.mismatch_restart or time.monotonic()
            self._start(args)
        elif f.kind == "pause":
            server.proc.send_signal(signal.SIGSTOP)
            try:
                self.abort.wait(hold)
            finally:
                server.proc.send_signal(signal.SIGCONT)
        elif f.kind == "cut":
            self.proxy.cut(in_flight=True)  # as a reset in mid-transfer: what was sent is lost
        elif f.kind in ("delay", "stall"):
            self.proxy.delay(f.count / 1000) if f.kind == "delay" else self.proxy.stall()
            try:
                self.abort.wait(hold)
            finally:
                self.proxy.resume()
        else:  # silent or hostile peers, straight to the server's port (proxy cuts spare them)
            rng, socks = random.Random(self.s.seed * 7919 + f.at), []
            try:
                for i in range(f.count):
                    socks.append(self.ctx.socket(zmq.DEALER))
                    socks[-1].setsockopt(zmq.LINGER, 0)
                    socks[-1].connect(f"tcp://127.0.0.1:{self.port}")
                    # Silent peers grant no credit and claim an hour's heartbeat: they must cost the
                    # server no thread and lock nobody out. Hostile ones grant credit, then lie.
                    credit, beat = (0, 3600.0) if f.kind == "silent-peers" else (self.o.hwm, 30.0)
                    socks[-1].send_multipart(encode(Hello(f"{f.kind}-{i}", credit=credit, heartbeat=beat)))
                    for _ in range(20 if f.kind == "hostile-peers" else 0):
                        socks[-1].send_multipart(encode(Credit(2**30)))
                        socks[-1].send_multipart([rng.randbytes(rng.randint(1, 400)) for _ in range(rng.randint(1, 3))])
                self.abort.wait(hold)
            finally:
                for sock in socks:
                    sock.close(linger=0)

    # -- the run --------------------------------------------------------------------------------
    def execute(self) -> Outcome:
        o, dataset = self.o, self.dir / "data"
        threads: list[threading.Thread] = []
        try:
            write_sample_dataset(str(dataset), rows=o.rows, dim=o.dim, files=o.files, row_group_rows=o.row_group_rows)
            self.port = self._start(o.serve_args(dataset, 0)).port
            self.proxy = TcpProxy(self.port, lifetime=self._left() + 30)
            threads = [threading.Thread(target=t, daemon=True) for t in (self._watch, self._faults)]
            for t in threads:
                t.start()
            self._jobs()
        finally:
            with self.cond:
                self.readers_done = True
            self._stop()
            for t in threads + self.background:
                t.join(self._left() + 5.0)
            self._shutdown()
            self.ctx.destroy(linger=0)
        self._check(dataset)
        self.out.elapsed = time.monotonic() - self.t0
        return self.out

    def _shutdown(self) -> None:
        fail = self.out.failures
        if self.proxy is not None:
            self.proxy.close()
            self.out.figures.append(f"proxy: {self.proxy.accepted} connections accepted, {self.proxy.cuts} cut")
        for server in self.servers[:-1]:
            server.close()
        if not self.servers:
            return
        last = self.servers[-1]
        last.proc.send_signal(signal.SIGCONT)
        if last.proc.poll() is not None and last.proc.pid not in self.killed:
            fail.append(f"the server exited by itself with {last.proc.returncode}: {last.log()[-1500:]}")
        elif last.proc.poll() is None:
            try:
                code = last.terminate(15.0)
                if code != 0:
                    fail.append(f"the server exited with {code} on SIGTERM: {last.log()[-1500:]}")
            except AssertionError as exc:
                fail.append(str(exc))
            left = glob.glob(f"/dev/shm/fuelline-handoff-{last.proc.pid}-*")
            if left:
                fail.append(f"the server stopped by SIGTERM left hand-off files {left[:5]}")
        last.close()

    # -- the invariant --------------------------------------------------------------------------
    def _check(self, dataset: Path) -> None:
        o, fail = self.o, self.out.failures
        groups = [pq.ParquetFile(f).read_row_group(g, columns=["sample_id"]).column(0).to_numpy()
                  for f in sorted((dataset / "train").glob("*.parquet")) for g in range(pq.ParquetFile(f).num_row_groups)]
        ids_of_row, lengths = np.concatenate(groups), np.array([len(g) for g in groups])
        expected, pads = walk(o, self.s.stops, lambda e: ids_of_row[epoch_order(lengths, o.seed, e, True, o.shuffle_block)])
        for (job, rank), (when, exc) in sorted(self.errors.items()):
            if self.mismatch_restart is not None and when > self.mismatch_restart and isinstance(exc, FingerprintMismatch):
                self.out.figures.append(f"job {job} rank {rank} raised, as allowed: {exc!r:.300}")
            else:
                fail.append(f"job {job} rank {rank} raised {exc!r:.600}")
        for job, rank, epoch, batches in expected:
            got = self.got.get((job, rank, epoch), [])
            if (job, rank) not in self.finished:
                batches = batches[:len(got)]  # an error (reported above, or allowed) ended the reader
            bad = next((i for i, (want, have) in enumerate(zip(batches, got)) if not np.array_equal(want, have)), None)
            if bad is not None:
                fail.append(f"job {job} rank {rank} epoch {epoch} batch {bad}: got ids {got[bad][:6]}... "
                            f"({len(got[bad])}), expected {batches[bad][:6]}... ({len(batches[bad])})")
            elif len(got) != len(batches):
                fail.append(f"job {job} rank {rank} epoch {epoch}: {len(got)} batches, expected {len(batches)}")
        for key in sorted(set(self.got) - {(j, r, e) for j, r, e, _ in expected}):
            fail.append(f"job {key[0]} rank {key[1]} epoch {key[2]}: {len(self.got[key])} batches nobody expected")
        if not self.errors and not fail:  # the same, without the reference: each id once, but padding
            for epoch in range(o.epochs):
                ids = np.concatenate([b for (_, _, e), bs in self.got.items() if e == epoch for b in bs])
                distinct = np.unique(ids)
                if not np.array_equal(distinct, np.sort(ids_of_row)) or len(ids) - len(distinct) > pads[epoch]:
                    fail.append(f"epoch {epoch}: {len(distinct)} distinct ids of {len(ids_of_row)}, "
                                f"{len(ids) - len(distinct)} repeated (padding allows {pads[epoch]})")
        for pid, (rss0, threads0, rss, threads) in self.peaks.items():
            self.out.figures.append(f"server {pid}: RSS {rss0:.0f} -> peak {rss:.0f} MB, threads {threads0} -> {threads}")
            if rss - rss0 > RSS_BOUND_MB or threads - threads0 > THREAD_BOUND:
                fail.append(f"server {pid} grew from {rss0:.0f} MB / {threads0} threads at readiness to {rss:.0f} MB / "
                            f"{threads} threads (bounds +{RSS_BOUND_MB:.0f} MB, +{THREAD_BOUND} threads)")


def run_schedule(schedule: Schedule, workdir: Path | None = None, deadline: float = 120.0) -> Outcome:
    """Run ``schedule`` in ``workdir`` (by default a temporary folder, removed after a pass)."""
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix=f"faults-{schedule.seed}-")) if own else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    out = Run(schedule, workdir, deadline).execute()
    if not out.ok:
        out.figures.append(f"server logs in {workdir}")
    elif own:
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the schedule to run (the first, with --soak)")
    parser.add_argument("--steps", type=int, default=6, help="faults and client resumes drawn per schedule")
    parser.add_argument("--soak", type=float, default=0.0, metavar="MINUTES", help="run seed, seed+1... this long")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds to draw from")
    args = parser.parse_args(argv)
    logging.getLogger("fuelline.client").setLevel(logging.ERROR)  # reconnect warnings: faults are the point
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds: unknown {sorted(set(kinds) - set(KINDS))}; known: {', '.join(KINDS)}")
    end, seed, failed = time.monotonic() + args.soak * 60, args.seed, []
    while True:
        out = run_schedule(make_schedule(seed, args.steps, kinds))
        print(out.report() if not out.ok or not args.soak else out.report().splitlines()[0], flush=True)
        failed += [] if out.ok else [seed]
        seed += 1
        if time.monotonic() >= end:
            break
    if args.soak:
        print(f"{seed - args.seed} schedules, failed seeds: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
