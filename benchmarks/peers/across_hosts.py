"""``python -m benchmarks.peers --bed``: the peers that serve from another host (fuelline, tf.data
service, Ray Data) across two hosts of a bed (``benchmarks/bed.py``, root only): the serving side
on host 0, confined to CPU 1, the reader on host 1, confined to CPU 0, as a trainer host would
lend one core to its input pipeline. Nothing crosses but the bed's own link.

- fuelline: ``fuelline serve --host H0 --insecure`` (the bed is a private network) on host 0; the
  reader's ``ServerDataStream`` on host 1 reads over TCP with checksums (the bed gives each host a
  ``/dev/shm`` of its own, so nothing moves to a Unix socket or shared memory).
- tf.data service: the dispatcher and the worker (advertising H0) on host 0; the client on host 1.
- Ray Data: a head node (``ray start --head``, one CPU) on host 0 and a node without CPUs on
  host 1, where the reader's driver joins the cluster; the read tasks run on the head.

The serving side's processes are started by this process, which samples their CPU time (with the
wall clock) every 0.1 s and takes it over the reader's timed span (from the wall-clock times of its
first and last batch); their peak memory is added to the reader's. Servers start anew each round,
and time to first batch "from start" runs from their start.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks import bed as bedlib
from benchmarks.common import RESULTS_DIR, ROOT, Round, progress
from benchmarks.peers import dataset, readerlib, venvs
from benchmarks.peers.bench import BATCH_SIZE, EPOCHS, METRICS, SHUFFLE_GROUPS, PeerRound
from benchmarks.peers.contenders import FUELLINE, PEERS, ReaderFailed, python_of, reader_env, run_reader
from benchmarks.report import RatioSpec, build_report, environment, write_results
from fuelline.protocol.common.endpoints import parse_ready_line

__all__ = ["run"]

SERVER_CPUS, READER_CPUS = "1", "0"
READY_TIMEOUT_S = 120.0
READER_TIMEOUT_S = 900.0
RAY_PORT = 6379


class ServingSide:
    """Processes started on the bed's hosts for one pass, each in a session of its own; their CPU
    time is sampled with wall-clock stamps."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[str]] = []
        self.trees: list[readerlib.ProcTree] = []
        self.samples: list[tuple[float, float]] = []
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="serving-cpu", daemon=True)
        self._thread.start()

    def start(self, name: str, argv: Sequence[str], env: dict[str, str], ready: Callable[[str], bool]) -> str:
        """Start ``argv``; returns the first line of its stdout that ``ready`` accepts."""
        with open(self.logs / f"{name}.log", "a") as err:
            proc = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                    start_new_session=True)
        self.procs.append(proc)
        tree = readerlib.ProcTree(proc.pid)
        self.trees.append(tree.__enter__())
        # Lines through a thread and a queue: a select() on the pipe says nothing of lines a
        # readline already took into its buffer (Ray writes its banner's lines in one go, and the
        # line it is ready on was never seen).
        lines: queue.Queue[str | None] = queue.Queue()

        def drain(stream: Any = proc.stdout) -> None:
            for text in stream:
                lines.put(text)
            lines.put(None)

        threading.Thread(target=drain, name=f"stdout-{name}", daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                raise ReaderFailed(f"{name} exited {proc.wait(timeout=10)} before it was ready "
                                   f"(see {self.logs / f'{name}.log'})")
            if ready(line):
                return line.strip()
        raise ReaderFailed(f"{name} was not ready within {READY_TIMEOUT_S:.0f}s")

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append((time.time(), sum(t.cpu_seconds() for t in list(self.trees))))

    def cpu_between(self, t0: float, t1: float) -> float:
        def at(t: float) -> float:
            before = [s for s in self.samples if s[0] <= t]
            after = [s for s in self.samples if s[0] >= t]
            if not before:
                return after[0][1] if after else 0.0
            if not after:
                return before[-1][1]
            (ta, ca), (tb, cb) = before[-1], after[0]
            return ca if tb == ta else ca + (cb - ca) * (t - ta) / (tb - ta)

        return max(0.0, at(t1) - at(t0))

    def peak_rss_bytes(self) -> int:
        return sum(t.peak_rss_bytes() for t in self.trees)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for proc in reversed(self.procs):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                try:
                    proc.wait(timeout=15)
                    break
                except subprocess.TimeoutExpired:
                    continue
        for tree in self.trees:
            tree.__exit__(None, None, None)


@dataclass(frozen=True)
class System:
    key: str
    start: Callable[[ServingSide, Any, Path, int], list[str]]  # → the reader's extra options


def _fuelline(side: ServingSide, bed: Any, root: Path, seed: int) -> list[str]:
    h0 = bed.hosts[0]
    argv = [python_of(PEERS[0]), "-m", "fuelline.server.cli", "serve", str(root / "parquet"), "--host", h0.address,
            "--port", "0", "--insecure", "--batch-size", str(BATCH_SIZE), "--hwm", "10", "--seed", str(seed),
            "--status-interval", "0"]
    line = side.start("fuelline-serve", h0.command(argv), reader_env(PEERS[0]), lambda s: parse_ready_line(s) is not None)
    ready = parse_ready_line(line)
    assert ready is not None
    return ["--server", f"{ready[0]}:{ready[1]}"]


def _tfdata(side: ServingSide, bed: Any, root: Path, seed: int) -> list[str]:
    peer = _peer("tfdata")
    h0 = bed.hosts[0]
    script = str(Path(__file__).parent / peer.script)
    base = [python_of(peer), script, "--data", ".", "--rows-per-group", "1", "--rows", "1"]
    line = side.start("tf-dispatcher", h0.command([*base, "--serve", "dispatcher"]), reader_env(peer),
                      lambda s: s.startswith("ready"))
    port = line.rsplit(":", 1)[1]
    side.start("tf-worker", h0.command([*base, "--serve", "worker", "--dispatcher", f"{h0.address}:{port}",
                                        "--advertise", h0.address]), reader_env(peer), lambda s: s.startswith("ready"))
    return ["--service", f"grpc://{h0.address}:{port}"]


def _ray(side: ServingSide, bed: Any, root: Path, seed: int) -> list[str]:
    peer = _peer("ray")
    ray = str(venvs.ENVS["ray"].path / "bin" / "ray")
    h0, h1 = bed.hosts
    env = reader_env(peer)
    common = ["--block", "--disable-usage-stats", "--temp-dir=/dev/shm/ray"]
    # (--include-dashboard is the head's alone: a worker node given it exits at once.)
    side.start("ray-head", h0.command([ray, "start", "--head", f"--node-ip-address={h0.address}", f"--port={RAY_PORT}",
                                       "--num-cpus=1", "--include-dashboard=false", *common]), env,
               lambda s: "Ray runtime started" in s)
    side.start("ray-node", h1.command([ray, "start", f"--address={h0.address}:{RAY_PORT}",
                                       f"--node-ip-address={h1.address}", "--num-cpus=0", *common]), env,
               lambda s: "Ray runtime started" in s)
    return ["--address", f"{h0.address}:{RAY_PORT}", "--node-ip", h1.address]


def _peer(key: str) -> Any:
    return next(p for p in PEERS if p.key == key)


SYSTEMS = (System("fuelline", _fuelline), System("tfdata", _tfdata), System("ray", _ray))


def _pass(system: System, bed: Any, root: Path, options: dict[str, Any], logs: Path, seed: int) -> PeerRound:
    peer = _peer(system.key)
    side = ServingSide(logs)
    try:
        extra = system.start(side, bed, root, seed)
        argv_options = {**options, "seed": seed}
        result = run_reader(peer, argv_options, logs / f"bed-{peer.key}.log", READER_TIMEOUT_S,
                            prefix=bed.hosts[1].command([]), extra=extra)
        server_cpu = side.cpu_between(result["first_batch_at"], result["last_batch_at"])
        server_cpu_pass = side.cpu_between(result["reader_started_at"], result["last_batch_at"])
        peak = result["peak_rss_bytes"] + side.peak_rss_bytes()
    finally:
        side.close()
    return PeerRound(
        result["batches"], result["rows"], result["bytes"], result["seconds"], result["cpu_s"], server_cpu,
        cpu_reader_s=result["cpu_reader_s"] + server_cpu_pass, peak_rss_bytes=peak, first_batch_s=result["first_batch_s"],
        first_batch_from_start_s=result["first_batch_at"] - side.started, mix=result["mix"],
        epoch_rows=result["epoch_rows"], epoch_distinct_rows=result["epoch_distinct_rows"],
        processes=result.get("processes", {}),
    )


def run(rounds: int, data_dir: Path, results_dir: Path = RESULTS_DIR, quick: bool = False,
        peers: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the three serving systems across the bed; writes peers-bed.json and .md (and returns the record)."""
    why = bedlib.unavailable()
    if why:
        raise RuntimeError(f"--bed: {why}")
    env = environment()
    table = dataset.QUICK if quick else dataset.FULL
    root, generation = dataset.ensure(data_dir, table)
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    chosen = [s for s in SYSTEMS if not peers or s.key in peers or s.key == "fuelline"]
    not_run: dict[str, str] = {}
    for s in chosen:
        p = _peer(s.key)
        if p.env is not None and not venvs.ready(venvs.ENVS[p.env]):
            not_run[p.name] = f"its environment {venvs.ENVS[p.env].path} is not built (run without --bed first)"
        elif p.prepare and not (root / {"tfdata": "records"}.get(s.key, "")).is_dir():
            not_run[p.name] = "its copy of the table is not written (run without --bed first)"
    options = {"data": root, "epochs": EPOCHS, "batch_size": BATCH_SIZE, "rows_per_group": table.rows_per_group,
               "rows": table.rows, "shuffle_rows": SHUFFLE_GROUPS * table.rows_per_group}
    results: dict[str, list[Round]] = {}
    with bedlib.Bed(2, cpus=[SERVER_CPUS, READER_CPUS]) as bed:
        active = [s for s in chosen if _peer(s.key).name not in not_run]
        for i in range(rounds + 1):
            label = "warm-up" if i == 0 else f"round {i}/{rounds}"
            for s in active:
                name = _peer(s.key).name
                if name in not_run:
                    continue
                try:
                    r = _pass(s, bed, root, options, logs, i)
                except (ReaderFailed, RuntimeError, OSError) as exc:
                    not_run[name] = f"failed in {label}: {exc}"
                    progress(f"bed {label} {name}: FAILED: {exc}")
                    continue
                progress(f"bed {label} {name}: {r.rows / r.seconds:,.0f} rows/s, "
                         f"{METRICS[2].of(r):.4f} CPU s/1k rows (server {1e3 * (r.producer_cpu_s or 0) / r.rows:.4f}), "
                         f"first batch {r.first_batch_s:.2f}s ({r.first_batch_from_start_s:.2f}s from start)")
                if i:
                    results.setdefault(name, []).append(r)
    results = {n: rs for n, rs in results.items() if n not in not_run}
    if FUELLINE not in results:
        raise RuntimeError(f"fuelline did not run across the bed: {not_run.get(FUELLINE)}")
    others = [n for n in results if n != FUELLINE]
    ratios = [RatioSpec(FUELLINE, o, 1.0) for o in others]
    ratios += [RatioSpec(FUELLINE, o, None, metric=METRICS[2].unit, higher=False) for o in others]
    parameters = {"rounds": rounds, "quick": quick, "rows": table.rows, "rows_per_group": table.rows_per_group,
                  "batch_size": BATCH_SIZE, "epochs_per_round": EPOCHS, "server_cpus": SERVER_CPUS,
                  "reader_cpus": READER_CPUS, "link": "the bed's veth pair through its switch, not rate-limited"}
    notes = [
        "Two hosts of a bed (network namespaces on one machine, benchmarks/bed.py): the serving side on host 0 "
        f"(taskset CPU {SERVER_CPUS}), the reader on host 1 (CPU {READER_CPUS}); links not rate-limited.",
        f"Each round: the servers started anew, one reader process, {EPOCHS} epochs of batches of {BATCH_SIZE}, "
        "then the servers stopped; after one untimed warm-up pass of each, contenders alternately.",
        "CPU s/1k rows: the reader's process tree over the timed span plus the serving side's processes (sampled "
        "every 0.1 s with the wall clock) over the same span; 'whole pass': both from the reader's start to its last "
        "batch, over every row; 'CPU s/GB' likewise. peak MB: both sides' peaks added.",
        "fuelline: `fuelline serve --host H0 --insecure` (a private network), ServerDataStream over TCP with "
        "checksums. tf.data service: dispatcher and worker on host 0. Ray: a head of one CPU on host 0 and a node "
        "of none on host 1 for the driver, so that the read tasks run on host 0.",
        *[f"{n}: not run: {w}" for n, w in not_run.items()],
    ]
    record, md = build_report("peers-bed", f"peers across two hosts — {EPOCHS} epochs of a {table.rows:,}-row table, "
                              f"batches of {BATCH_SIZE}", results, METRICS, ratios, parameters, notes, env, exits={},
                              extra={"not_run": {n: f"not run: {w}" for n, w in not_run.items()},
                                     "generation": generation})
    print(md, flush=True)
    for path in write_results("peers-bed", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    return record
