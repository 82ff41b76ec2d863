"""``fuelline bench DATASET``: size a server on your own data.

It serves DATASET with ``fuelline serve`` in a child process (loopback TCP, an ephemeral port,
the given serve options), reads whole epochs from it with ``fuelline stream`` in another child
(the client, in a process of its own as a trainer's is), and reads the same epochs in this
process from the same source, built from the same options, as a training script without a data
server would. The two take turns (served, in-process, served, ...), one epoch each a round, and
the median round of each side is reported: rows/s, MB/s, batches/s, data wait per batch and the CPU
spent producing a batch (the server's process and its workers, from /proc; for the in-process
read, this process and its workers). Every figure is measured in this run.

Each round is a first epoch (epoch 0, as a new reader's is) on both sides, so the order and the
batches are the same; the sources' decoded caches carry over between rounds on both sides alike.
The served reader does nothing between batches, so its data wait per batch is its epoch's time
over its batches; the in-process reader's is the time spent in ``next()``. The server's CPU is
taken from just before the reader starts to just after it exits: it includes the session's
handshake, which a long epoch makes small.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, Iterator

from fuelline.protocol import DataError, OptionError
from fuelline.protocol.common.argtypes import non_negative_int, positive_int, seconds
from fuelline.protocol.common.cpu import process_cpu_seconds
from fuelline.protocol.common.endpoints import parse_ready_line

__all__ = ["register", "run", "process_cpu_seconds"]

SIDES = ("served", "in_process")
FIGURES = (("rows_per_s", "rows/s"), ("mb_per_s", "MB/s"), ("batches_per_s", "batches/s"),
           ("data_wait_ms_per_batch", "data wait ms/batch"), ("cpu_ms_per_batch", "CPU ms/batch"))


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    bench = sub.add_parser("bench", help="serve and read a dataset, against reading it in-process, to size servers")
    bench.add_argument("dataset", help="what `fuelline serve` takes: a Parquet dataset or a converted one")
    bench.add_argument("--epochs", type=positive_int, default=2, help="epochs read by each side, in turns")
    bench.add_argument("--split", default="train", help="which split to read")
    bench.add_argument("--timeout", type=seconds, default=600.0, metavar="SECONDS",
                       help="longest wait for the server to start, and for one epoch to be read")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    # The `fuelline serve` options that change what serving costs; the server gets them as given,
    # and they are checked by serve's own parser before anything starts.
    serve = bench.add_argument_group("serve options (as `fuelline serve` takes them)")
    serve.add_argument("--hwm", type=positive_int, default=10, help="batches in flight to the reader")
    serve.add_argument("--batch-size", type=positive_int, default=64, help="rows (windows) per batch")
    serve.add_argument("--seed", type=int, default=0, help="seeds every epoch's order, with the epoch number")
    serve.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True,
                       help="shuffle across shards each epoch (off: storage order)")
    serve.add_argument("--shuffle-block", type=positive_int, default=8, help="row groups whose rows are mixed together")
    serve.add_argument("--workers", type=non_negative_int, default=0,
                       help="processes that decode in parallel, on each side; 0: threads of the process")
    serve.add_argument("--decoded-cache-mb", type=non_negative_int, default=1024, metavar="MB",
                       help="decoded units kept in memory, on each side; 0 decodes every epoch again")
    serve.add_argument("--window", type=float, default=2.0, help="window length in seconds (converted datasets)")
    serve.add_argument("--hop", type=float, default=1.0, help="seconds between window starts (converted datasets)")
    serve.add_argument("--max-gap", type=int, default=2, help="most missing samples in a row in a valid window")
    serve.add_argument("--normalize", choices=["zscore", "none"], default="zscore",
                       help="per-channel z-score with the train split's statistics, or none")
    serve.add_argument("--stage", action="append", default=[], metavar="MODULE:FUNCTION",
                       help="a preprocessing stage run on every batch (repeatable, in order)")
    bench.set_defaults(func=run)


def _serve_argv(args: argparse.Namespace) -> list[str]:
    """``fuelline serve``'s arguments for the benchmarked server, from ours."""
    argv = [args.dataset, "--host", "127.0.0.1", "--port", "0", "--status-interval", "0",
            # TCP, the path a trainer on another host takes, not this host's Unix socket.
            "--no-local-ipc", "--shuffle" if args.shuffle else "--no-shuffle"]
    for name in ("hwm", "batch_size", "seed", "shuffle_block", "workers", "decoded_cache_mb", "window", "hop",
                 "max_gap", "normalize"):
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    for stage in args.stage:
        argv += ["--stage", stage]
    return argv


def _serve_namespace(argv: list[str]) -> argparse.Namespace:
    from fuelline.server.cli import serve

    parser = argparse.ArgumentParser(prog="fuelline")
    serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def _elapsed_cpu(before: float | None, after: float | None) -> float | None:
    return after - before if before is not None and after is not None else None


def _figures(batches: int, rows: int, nbytes: int, secs: float, wait_s: float, cpu_s: float | None) -> dict[str, Any]:
    if batches == 0 or secs <= 0:
        raise DataError(f"an epoch of the split delivered {batches} batches: nothing to time")
    return {
        "batches": batches, "rows": rows, "bytes": nbytes, "seconds": round(secs, 4),
        "rows_per_s": round(rows / secs, 1), "mb_per_s": round(nbytes / secs / 1e6, 3),
        "batches_per_s": round(batches / secs, 2), "data_wait_ms_per_batch": round(wait_s / batches * 1e3, 4),
        "cpu_ms_per_batch": round(cpu_s / batches * 1e3, 4) if cpu_s is not None else None,
    }


@contextlib.contextmanager
def _interrupt_deferred() -> Iterator[None]:
    """Ctrl-C while a child process starts is raised once the child is known: an interrupt inside
    ``Popen`` would leave it running, with nobody knowing its pid to stop it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


class _Server:
    """The benchmarked ``fuelline serve`` child: ready once it prints its ready line; stdout is
    drained by a thread (a full pipe would stall it), stderr goes to a file quoted on failure."""

    def __init__(self, log: IO[str]) -> None:
        self.log = log
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, serve_argv: list[str]) -> None:
        with _interrupt_deferred():
            self.proc = subprocess.Popen([sys.executable, "-m", "fuelline.server.cli", "serve", *serve_argv],
                                         stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        threading.Thread(target=self._drain, name="bench-server-stdout", daemon=True).start()

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self, timeout: float) -> tuple[str, int]:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(timeout=10)
                raise DataError(f"the server exited with status {self.proc.returncode} before serving{self.tail()}")
            ready = parse_ready_line(line)
            if ready is not None:
                return ready
        raise DataError(f"the server printed no ready line within {timeout:.0f}s{self.tail()}")

    def tail(self, lines: int = 5) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-lines:]
        return ("; its log ends: " + " | ".join(text)) if text else ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (the server tells its clients and exits), then SIGKILL if it outlives ``timeout``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _served_epoch(server: _Server, host: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    """One epoch read by ``fuelline stream`` in a child process; the server's CPU over its run."""
    argv = [sys.executable, "-m", "fuelline.server.cli", "stream", f"{host}:{port}", "--epochs", "1", "--json",
            "--split", args.split, "--hwm", str(args.hwm), "--timeout", str(args.timeout)]
    cpu0 = process_cpu_seconds(server.pid)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout + 30)
    except subprocess.TimeoutExpired:
        raise DataError(f"reading one epoch from the server took over {args.timeout:.0f}s (--timeout)") from None
    cpu1 = process_cpu_seconds(server.pid)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise DataError(f"reading from the server failed ({said}){server.tail()}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    secs = report["seconds"]
    # The reader does no work between batches: all of its time per batch is waiting for data.
    return _figures(report["batches"], report["rows"], report["bytes"], secs, secs, _elapsed_cpu(cpu0, cpu1))


def _in_process_epoch(source: Any, split: str, skip: frozenset[int]) -> dict[str, Any]:
    """One epoch of the same source in this process, timed the way the served one is."""
    batches = rows = nbytes = 0
    wait = 0.0
    cpu0 = process_cpu_seconds(os.getpid(), skip)
    start = time.perf_counter()
    it = source.iter_batches(split, 0, 0, 1, 0, source.sources)
    while True:
        asked = time.perf_counter()
        batch = next(it, None)
        wait += time.perf_counter() - asked
        if batch is None:
            break
        first = next(iter(batch.values()))
        batches += 1
        rows += len(first) if first.ndim else 1
        nbytes += sum(a.nbytes for a in batch.values())
    secs = time.perf_counter() - start
    cpu = _elapsed_cpu(cpu0, process_cpu_seconds(os.getpid(), skip))
    return _figures(batches, rows, nbytes, secs, wait, cpu)


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median round by epoch time (of an even number, the faster of the middle two), whole: a
    median of each figure alone would mix rounds (a cold first epoch, a warm second) into figures
    that disagree with each other."""
    median = sorted(rounds, key=lambda r: r["seconds"])[(len(rounds) - 1) // 2]
    out: dict[str, Any] = {key: median[key] for key, _ in FIGURES}
    out["rounds"] = rounds
    return out


def _table(record: dict[str, Any]) -> str:
    def cell(value: float | None) -> str:
        return "n/a" if value is None else f"{value:,.3f}" if value < 10 else f"{value:,.0f}"

    lines = [f"fuelline bench {record['dataset']} (split {record['split']}, batch size {record['batch_size']}, "
             f"workers {record['workers']}; the median of {record['epochs']} epochs each, read in turns)",
             f"{'':<20}{'served':>14}{'in-process':>14}{'served/in-process':>20}"]
    for key, label in FIGURES:
        values = [record[side][key] for side in SIDES] + [record["ratio"][key]]
        lines.append(f"{label:<20}" + "".join(f"{cell(v):>{w}}" for v, w in zip(values, (14, 14, 20))))
    lines.append("data wait: served, the reader's time per batch (it does nothing else); in-process, time in next()")
    lines.append("CPU ms/batch: served, the server and its workers; in-process, this process and its workers")
    lines.append(f"server pid {record['server_pid']}: stopped, exit code {record['server_exit_code']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from fuelline.server.cli.serve import _open_source, flag

    serve_args = _serve_namespace(_serve_argv(args))
    try:
        source = _open_source(serve_args)  # first: a bad path or option fails before a server starts
    except OptionError as exc:
        raise DataError(f"{flag(exc.option)} {exc.rule}") from None
    try:
        if args.split not in source.splits:
            raise DataError(f"--split {args.split!r}: {args.dataset} has the splits {', '.join(source.splits)}")
        with tempfile.NamedTemporaryFile("w+", prefix="fuelline-bench-", suffix=".log") as log:
            record = _measure(args, source, log)
    finally:
        source.close()
    print(json.dumps(record) if args.json else _table(record), flush=True)
    return 0


def _measure(args: argparse.Namespace, source: Any, log: IO[str]) -> dict[str, Any]:
    server = _Server(log)
    try:
        server.start(_serve_argv(args))
        host, port = server.wait_ready(args.timeout)
        rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        # The readers are this process's children too; they are not the in-process read's cost.
        skip = frozenset({server.pid})
        for _ in range(args.epochs):
            rounds["served"].append(_served_epoch(server, host, port, args))
            rounds["in_process"].append(_in_process_epoch(source, args.split, skip))
    finally:
        server.stop()
    assert server.proc is not None
    record: dict[str, Any] = {
        "dataset": args.dataset, "split": args.split, "epochs": args.epochs, "batch_size": args.batch_size,
        "workers": args.workers, "server_pid": server.pid, "server_exit_code": server.proc.returncode,
    }
    record.update({side: _summary(rounds[side]) for side in SIDES})
    record["ratio"] = {
        key: round(record["served"][key] / record["in_process"][key], 3)
        if record["served"][key] is not None and record["in_process"][key] else None
        for key, _ in FIGURES
    }
    return record
