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
* ``slow-stage``: the server's user stage (``fault_stage.py``; served with ``--stage`` only when a
  stage kind is drawn) takes 0.3–1.5 s a batch, 1 to 5 server heartbeats, for a few seconds, on
  the train split, the val split or both; where val is slowed, a val reader reads an epoch of it
  meanwhile, and must get it whole, each id once;
* ``hanging-stage``: the stage hangs every batch; then SIGTERM, which must end the server with
  exit status 0 within its stop deadline, naming the stage it abandoned, and a restart with the
  same options;
* ``shard-swap``: kill -9, one train shard's bytes replaced by another's of the same size with
  its modification time kept (``cp`` then ``touch -r``), and a restart with the same options:
  readers must raise ``FingerprintMismatch`` naming the footers (the shard is put back before the
  check; like ``other-options``, it is last);
* ``resume`` / ``resume-resized`` / ``resume-epoch-end``: every rank stops after the same batch,
  as a torchrun job would, saves its ``state_dict`` and closes; new readers go on from there, on
  the same world size (each from its own state) or another (each from rank 0's).

The invariant: per (job, rank, epoch) the batches equal the reference, which follows the documented
order (``fuelline.server.sources.ordering``: the epoch's order, contiguous wrap-padded rank spans,
``remaining_order`` after a resize); apart from that, per epoch the ranks together got every id
of the split, repeated no more than padding allows; every ``features`` row matches its id; every
reader completed, unless a restart with other options made it raise ``FingerprintMismatch`` (then
what it got is a prefix of the reference); the server's RSS and threads stayed within bounds of
their values at readiness; worker processes die with a killed server; the last server exits 0 on
SIGTERM and leaves no hand-off file. A failure prints its seed and schedule; ``--seed N`` replays it.
The schedule, the reference and the check of the invariant live in ``fault_plan.py``; this module
runs them.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from fuelline.client import ServerDataStream
from fuelline.protocol import Credit, FingerprintMismatch, Hello, encode
from fuelline.server.serving.start import STOP_DEADLINE
from fuelline.server.sources.sample import expected_features, write_sample_dataset

from support.fault_plan import (
    CLIENT_KINDS,
    KINDS,
    RSS_BOUND_MB,
    STAGE,
    TERMINAL_KINDS,
    THREAD_BOUND,
    Fault,
    Options,
    Schedule,
    Stop,
    check,
    make_schedule,
    walk,
)
from support.fault_stage import set_control
from support.processes import ServerProcess, wait_until
from support.tcp_proxy import TcpProxy

TESTS = Path(__file__).resolve().parents[1]  # on the server's PYTHONPATH, for its stage
STOP_GRACE = 2.0  # seconds beyond the server's stop deadline that a SIGTERM may take

# The plan's names stay importable from here, where the harness began.
__all__ = ["CLIENT_KINDS", "KINDS", "RSS_BOUND_MB", "THREAD_BOUND", "Fault", "Options", "Outcome", "Run", "Schedule",
           "Stop", "alive", "descendants", "main", "make_schedule", "proc_status", "run_schedule", "walk"]



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
        self.control = str(workdir / "stage-control.json")  # steers the server's stage (fault_stage.py)
        self.env = {**os.environ, "FAULT_STAGE_CONTROL": self.control, "FAULT_STAGE_VAL_FROM": str(self.o.train_rows),
                    "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}
        self.val_readers: list[tuple[threading.Thread, list[np.ndarray], list[tuple[float, BaseException]]]] = []
        self.swapped: tuple[Path, bytes, int, int] | None = None  # a shard swapped: its path, bytes and times
        self.swapped_server: ServerProcess | None = None  # the server started after a shard swap
        self.hanging = False  # readers read on past the next fault's batch until one hangs in the stage

    def _left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def _on_schedule(self) -> bool:
        faults = self.s.faults
        return (self.abort.is_set() or self.hanging or self.started == len(faults)
                or self.progress < faults[self.started].at)

    def _stop(self) -> None:
        with self.cond:
            self.abort.set()
            self.cond.notify_all()

    def _start(self, args: list[str]) -> ServerProcess:
        server = ServerProcess(args, self.dir / f"server-{len(self.servers)}.log", env=self.env)
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

    def _read_val(self, got: list[np.ndarray], errors: list[tuple[float, BaseException]]) -> None:
        """One epoch of the val split, beside the train readers (while a stage slows val)."""
        o = self.o
        try:
            with ServerDataStream(("sample_id", "features"), host="127.0.0.1", port=self.proxy.port, split="val",
                                  hwm=o.hwm, timeout=o.timeout, heartbeat=o.heartbeat, receive_timeout=o.timeout,
                                  local=False, client_id=f"val{len(self.val_readers)}") as s:
                for ids, features in s.get_epoch_iterator():
                    if not np.array_equal(features, expected_features(ids, o.dim)):
                        raise AssertionError(f"val: features do not match sample ids {ids[:4]}")
                    got.append(ids.copy())
        except BaseException as exc:  # the check reports it, with the schedule
            errors.append((time.monotonic(), exc))

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
                due = self.cond.wait_for(lambda at=fault.at: self.progress >= at or self.readers_done, self._left())
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
        if f.kind in ("kill", "other-options", "shard-swap"):
            children = descendants(server.proc.pid)
            self.killed.add(server.proc.pid)
            server.kill()
            try:
                wait_until(lambda: not any(alive(p) for p in children), 10.0, "worker processes end")
            except AssertionError:
                self.out.failures.append(f"{f}: {sorted(p for p in children if alive(p))} outlived the killed server")
            if f.kind == "shard-swap":
                self._swap(f.count)
            self.abort.wait(hold)
            args = server.args[:]
            args[args.index("--port") + 1] = str(self.port)
            if f.kind == "other-options":
                args[args.index(f.change[0]) + 1] = f.change[1]
            if f.kind in TERMINAL_KINDS:
                self.mismatch_restart = self.mismatch_restart or time.monotonic()
            restarted = self._start(args)
            if f.kind == "shard-swap":
                self.swapped_server = restarted
        elif f.kind == "slow-stage":
            splits = f.change[1].split(",")
            if "val" in splits:  # a reader of val meets the slow batches, and must still get its epoch
                got: list[np.ndarray] = []
                errors: list[tuple[float, BaseException]] = []
                reader = threading.Thread(target=self._read_val, args=(got, errors), daemon=True,
                                          name=f"val{len(self.val_readers)}")
                self.val_readers.append((reader, got, errors))
                reader.start()
            set_control(self.control, mode="slow", seconds=f.count / 1000, splits=splits)
            try:
                self.abort.wait(hold)
            finally:
                set_control(self.control)
        elif f.kind == "hanging-stage":
            self._hang_and_stop(server)
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

    def _swap(self, index: int) -> None:
        """Replace a train shard's bytes by another's of the same size, keeping its times."""
        files = sorted((self.dir / "data" / "train").glob("*.parquet"))
        target, donor = files[index % len(files)], files[(index + 1) % len(files)]
        st, data = target.stat(), donor.read_bytes()
        if len(data) != st.st_size:
            raise AssertionError(f"the harness's shards differ in size: {target.name} {st.st_size}, {donor.name} {len(data)}")
        self.swapped = (target, target.read_bytes(), st.st_atime_ns, st.st_mtime_ns)
        with open(target, "r+b") as f:  # in place, as cp does
            f.write(data)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
        self.out.figures.append(f"shard-swap: {target.name} holds {donor.name}'s rows, {st.st_size} bytes, mtime kept")

    def _unswap(self) -> None:
        if self.swapped is not None:
            target, data, atime, mtime = self.swapped
            target.write_bytes(data)
            os.utime(target, ns=(atime, mtime))

    def _hang_and_stop(self, server: ServerProcess) -> None:
        """Have every batch hang in the stage, SIGTERM the server once one does, and restart it."""
        entered = Path(self.control + ".entered")
        entered.unlink(missing_ok=True)
        set_control(self.control, mode="hang")
        with self.cond:
            self.hanging = True
            self.cond.notify_all()
        try:
            wait_until(entered.exists, 10.0, "a batch hangs in the stage")
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(STOP_DEADLINE + STOP_GRACE + 10.0)
            took = time.monotonic() - started
        finally:
            set_control(self.control)
            with self.cond:
                self.hanging = False
                self.cond.notify_all()
        self.out.figures.append(f"hanging-stage: SIGTERM took {took:.2f}s, exit status {code}")
        log = server.log()
        if code != 0 or took > STOP_DEADLINE + STOP_GRACE:
            self.out.failures.append(f"hanging-stage: SIGTERM took {took:.2f}s and exit status {code} (expected 0 "
                                     f"within {STOP_DEADLINE + STOP_GRACE:.0f}s): {log[-1500:]}")
        if f"stopping without stage {STAGE}" not in log:
            self.out.failures.append(f"hanging-stage: the server did not name the stage it abandoned: {log[-1500:]}")
        args = server.args[:]
        args[args.index("--port") + 1] = str(self.port)
        self._start(args)

    # -- the run --------------------------------------------------------------------------------
    def execute(self) -> Outcome:
        o, dataset = self.o, self.dir / "data"
        threads: list[threading.Thread] = []
        try:
            write_sample_dataset(str(dataset), rows=o.rows, dim=o.dim, files=o.files, row_group_rows=o.row_group_rows,
                                 plain=o.plain)
            self.port = self._start(o.serve_args(dataset, 0)).port
            self.proxy = TcpProxy(self.port, lifetime=self._left() + 30)
            threads = [threading.Thread(target=t, daemon=True) for t in (self._watch, self._faults)]
            for t in threads:
                t.start()
            self._jobs()
            with self.cond:
                self.readers_done = True  # (no fault is due once the train readers are done)
                self.cond.notify_all()
            for reader, _, _ in self.val_readers:
                reader.join(self._left())
        finally:
            with self.cond:
                self.readers_done = True
            self._stop()
            for t in threads + self.background + [r for r, _, _ in self.val_readers]:
                t.join(self._left() + 5.0)
            self._shutdown()
            self.ctx.destroy(linger=0)
            self._unswap()
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
        check(self.s, dataset, got=self.got, errors=self.errors, finished=self.finished,
              mismatch_restart=self.mismatch_restart, peaks=self.peaks, failures=self.out.failures,
              figures=self.out.figures)
        fail = self.out.failures
        allowed = lambda when, exc: (self.mismatch_restart is not None and when > self.mismatch_restart  # noqa: E731
                                     and isinstance(exc, FingerprintMismatch))
        val_ids = np.arange(self.o.train_rows, self.o.rows)
        for i, (reader, got, errors) in enumerate(self.val_readers):
            ids = np.concatenate(got) if got else np.array([], dtype=np.int64)
            if reader.is_alive():
                fail.append(f"val reader {i} did not finish its epoch by the run's deadline ({len(ids)} ids)")
            elif errors and not allowed(*errors[0]):
                fail.append(f"val reader {i} raised {errors[0][1]!r:.600}")
            elif not errors and not np.array_equal(np.sort(ids), val_ids):
                fail.append(f"val reader {i}: {len(np.unique(ids))} distinct ids of {len(val_ids)}, {len(ids)} in all")
            elif len(np.unique(ids)) != len(ids):
                fail.append(f"val reader {i}: {len(ids) - len(np.unique(ids))} ids repeated")
            else:
                self.out.figures.append(f"val reader {i}: {len(ids)} ids" + (f", then {errors[0][1]!r:.200}" if errors else ""))
        if self.swapped_server is not None:
            # Every reader that said Hello to the server of the swapped shard must have refused it
            # by its content (one that had all its batches by then never asked: nothing to refuse).
            asked = sorted(set(re.findall(r"client job(\d+)-rank(\d+)#", self.swapped_server.log_path.read_text())))
            for job, rank in ((int(j), int(r)) for j, r in asked):
                exc = self.errors.get((job, rank), (0.0, None))[1]
                if not isinstance(exc, FingerprintMismatch) or "footers" not in str(exc):
                    fail.append(f"shard-swap: job {job} rank {rank} was welcomed by the server of the swapped shard "
                                f"and did not raise FingerprintMismatch naming the footers: {exc!r:.400}")
            self.out.figures.append(f"shard-swap: {len(asked)} readers asked the server of the swapped shard")



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
