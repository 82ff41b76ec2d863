"""What every benchmark shares: timing a stream of batches, running contenders alternately, and
data servers in their own processes. The report is ``benchmarks.report``.

Figures are only ever compared within one run: contenders take turns (A B A B ...), so that a
noisy neighbour on a shared machine slows all of them rather than one.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from fuelline.protocol.common.cpu import process_cpu_seconds, threads_cpu_seconds
from fuelline.protocol.common.endpoints import parse_ready_line

__all__ = [
    "BENCH_DIR", "ROOT", "RESULTS_DIR", "DEFAULT_DATA_DIR",
    "Round", "Contender", "ServerProcess", "SourceTree", "time_batches", "process_cpu_seconds", "processes_cpu_seconds",
    "THREAD_ROLES", "threads_cpu_by_role",
    "alternate", "progress",
]

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_DATA_DIR = BENCH_DIR / ".data"



# -- measuring one pass ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Round:
    """One timed pass over a stream of batches.

    ``rows`` and ``bytes`` count the batches after the first, and ``seconds`` runs from the
    arrival of the first batch to the arrival of the last: the first batch pays for connecting
    and for the source's first read, which is latency, not throughput.
    """

    batches: int  # all batches of the pass, the first included
    rows: int
    bytes: int
    seconds: float
    consumer_cpu_s: float  # this process, all threads, first batch to end of pass
    producer_cpu_s: float | None  # the sending process over the same span; None if in-process
    # The CPU seconds of the processes whose batches are prepared (``time_batches``' ``threads_of``)
    # over the same span, by what their threads do (``THREAD_ROLES``); None where not measured.
    threads_cpu_s: dict[str, float] | None = field(default=None, kw_only=True)


# What a thread does, from the name it carries (``fuelline.protocol.common.threadnames``); a
# process's main thread (a `fuelline serve` process's serving loop, a consumer's own gathering) is
# "main", libzmq's I/O threads "libzmq", any other "other".
THREAD_ROLES = (("fl-produce", "producers"), ("fl-read", "read-ahead"), ("fl-fetch", "fetch"),
                ("fl-workers", "workers"), ("fl-stage", "stages"), ("fl-serve", "serving loop"), ("ZMQbg/IO", "libzmq"),
                ("fl-keepalive", "keep-alive"), ("fl-plan", "plan"))


def threads_cpu_by_role(pids: Iterable[int] | Mapping[str, int], children: bool = True) -> dict[str, float]:
    """The CPU seconds of the live threads of these processes (and, with ``children``, of their live
    descendants), by role; with processes named (``{"server": pid, ...}``), each role is named by
    its process too ("server libzmq"). Threads that ended are not counted: take it over a span the
    threads of interest live through."""
    named = pids.items() if isinstance(pids, Mapping) else (("", pid) for pid in pids)
    out: dict[str, float] = {}
    for label, pid in named:
        for (proc, tid), (name, seconds) in threads_cpu_seconds(pid, children).items():
            role = "main" if tid == proc else next((r for prefix, r in THREAD_ROLES if name.startswith(prefix)), "other")
            role = f"{label} {role}" if label else role
            out[role] = out.get(role, 0.0) + seconds
    return out


def time_batches(batches: Iterable[Sequence[np.ndarray]], producer_pid: int | Sequence[int] | None = None,
                 threads_of: Sequence[int] | Mapping[str, int] = (), threads_of_children: bool = True) -> Round:
    """Consume a stream of batches (tuples of arrays whose first axis is rows), touching one
    element of every array so that nothing is merely passed along unread, and time it.
    ``producer_pid``: the sending process, or processes (their CPU is added up). ``threads_of``:
    processes whose CPU is also taken by thread role (``threads_cpu_by_role``) over the timed span,
    with their child processes' unless ``threads_of_children`` is false; named (a mapping), each
    role is named by its process."""
    pids = [] if producer_pid is None else [producer_pid] if isinstance(producer_pid, int) else list(producer_pid)

    def producers_cpu() -> float | None:
        return processes_cpu_seconds(pids) if pids else None

    first = last = None
    cpu0 = prod0 = None
    roles0: dict[str, float] = {}
    count = rows = nbytes = 0
    for batch in batches:
        now = time.perf_counter()
        count += 1
        for arr in batch:
            if arr.size:
                arr.item(0)
        if first is None:
            first = now
            cpu0 = time.process_time()
            prod0 = producers_cpu()
            roles0 = threads_cpu_by_role(threads_of, threads_of_children)
            continue
        last = now
        rows += len(batch[0])
        nbytes += sum(arr.nbytes for arr in batch)
    if first is None or last is None or last <= first:
        raise RuntimeError(f"a pass needs at least two batches to be timed, got {count}")
    cpu1 = time.process_time()
    prod1 = producers_cpu()
    roles1 = threads_cpu_by_role(threads_of, threads_of_children)
    producer = prod1 - prod0 if prod0 is not None and prod1 is not None else None
    # (A thread that started after the first batch counts from 0; one that ended is left out.)
    roles = {role: max(0.0, roles1.get(role, 0.0) - roles0.get(role, 0.0)) for role in {*roles0, *roles1}} if threads_of else None
    return Round(count, rows, nbytes, last - first, cpu1 - cpu0, producer, threads_cpu_s=roles)  # type: ignore[operator]


def processes_cpu_seconds(pids: Iterable[int]) -> float | None:
    """The CPU seconds of several processes (each with its live children) added up; None if any
    of them cannot be read (no /proc)."""
    seconds = [process_cpu_seconds(pid) for pid in pids]
    return None if None in seconds else sum(s for s in seconds if s is not None)


# -- alternating contenders ------------------------------------------------------------------------
@dataclass(frozen=True)
class Contender:
    """A named way of reading the same data; ``run`` performs one pass and times it."""

    name: str
    run: Callable[[], Round]


def alternate(contenders: Sequence[Contender], rounds: int, describe: Callable[[Round], str]) -> dict[str, list[Round]]:
    """One untimed warm-up pass of each contender, then ``rounds`` rounds of one pass each, in turn.

    Warm-up first, for all alike: the page cache, the allocator, lazily imported code and the
    first connection would otherwise count against whoever runs first.
    """
    for c in contenders:
        started = time.perf_counter()
        c.run()
        progress(f"warm-up   {c.name}: {time.perf_counter() - started:.1f}s")
    results: dict[str, list[Round]] = {c.name: [] for c in contenders}
    for i in range(rounds):
        for c in contenders:
            r = c.run()
            results[c.name].append(r)
            progress(f"round {i + 1}/{rounds} {c.name}: {describe(r)}")
    return results


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# -- data servers in their own processes -----------------------------------------------------------


class ServerProcess:
    """A data server in a child process, ready once it prints ``serving on tcp://HOST:PORT``.

    Its stdout is drained by a thread (a full pipe would block the server); its stderr goes to
    ``log_path`` and is quoted when the server fails.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, ready_timeout: float = 60.0,
                 pythonpath: str | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.pythonpath = pythonpath  # where ``fuelline`` is imported from, if not this tree's install
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.host = ""
        self.port = 0
        self.exit_status: dict[str, Any] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), self.pythonpath, env.get("PYTHONPATH", "")) if p)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen(
                self.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1
            )
        threading.Thread(target=self._drain, name=f"stdout-{self.name}", daemon=True).start()
        try:
            self._await_ready()
        except BaseException:
            self.stop()
            raise

    def _drain(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.name}: no 'serving on' line within {self.ready_timeout:.0f}s{self._log_tail()}")
            try:
                line = self._lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                assert self._proc is not None
                rc = self._proc.wait(timeout=10)
                raise RuntimeError(f"{self.name} exited with status {rc} before serving{self._log_tail()}")
            ready = parse_ready_line(line)
            if ready is not None:
                self.host, self.port = ready
                return

    def stop(self, timeout: float = 10.0) -> dict[str, Any]:
        """SIGTERM, then wait; a server that outlives ``timeout`` is killed and reported as such."""
        proc = self._proc
        if proc is None or self.exit_status:
            return self.exit_status
        status: dict[str, Any] = {"sigterm": False, "killed": False}
        if proc.poll() is None:
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            status["sigterm"] = True
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
                status["killed"] = True
            status["exit_s"] = round(time.monotonic() - started, 3)
        status["exit_code"] = proc.returncode
        status["clean"] = proc.returncode == 0 and not status["killed"]
        self.exit_status = status
        if not status["clean"]:
            progress(f"WARNING: {self.name} did not exit cleanly after SIGTERM: {status}{self._log_tail()}")
        return status

    def _log_tail(self, lines: int = 20) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return ("\n  " + "\n  ".join(tail)) if tail else ""


# -- another revision, for before/after in one run -------------------------------------------------
class SourceTree:
    """Another revision of this project, importable as ``fuelline`` from ``pythonpath``: a
    detached ``git worktree`` of ``rev``, and a folder of links named as the installed package is
    (the folders are mapped into the namespace by setup.cfg, not nested under fuelline/). A
    PYTHONPATH entry is found before the editable install of this tree."""

    def __init__(self, rev: str, parent: Path) -> None:
        self.rev = rev
        self.src = parent / "before-src"
        self.root = parent / "before-root"
        self.commit = ""

    @property
    def pythonpath(self) -> str:
        return str(self.root)

    def __enter__(self) -> "SourceTree":
        self.commit = subprocess.run(["git", "rev-parse", "--verify", f"{self.rev}^{{commit}}"], cwd=ROOT, check=True,
                                     capture_output=True, text=True, timeout=30).stdout.strip()
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(self.src), self.commit], cwd=ROOT,
                       check=True, capture_output=True, timeout=120)
        (self.root / "fuelline").mkdir(parents=True)
        for folder in ("protocol", "client", "server", "trainer"):
            (self.root / "fuelline" / folder).symlink_to(self.src / folder)
        return self

    def __exit__(self, *exc: Any) -> None:
        subprocess.run(["git", "worktree", "remove", "--force", str(self.src)], cwd=ROOT, capture_output=True, timeout=120)

    def run(self, *argv: str) -> None:
        """``python -m fuelline.server.cli ARGV`` of this revision; raises with its stderr if it fails."""
        env = dict(os.environ, PYTHONPATH=self.pythonpath)
        done = subprocess.run([sys.executable, "-m", "fuelline.server.cli", *argv], cwd=self.src, env=env,
                              capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise RuntimeError(f"{self.rev}: fuelline {' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
