"""What every peer's reader process shares: its command line, the process tree it measures, and
the timed loop that prints one JSON line of measurements.

A reader runs in its peer's own environment (``benchmarks/.venvs/<peer>``), so this module needs
nothing but the standard library and numpy, and is imported by the readers as a plain module from
their own folder. It measures everything that the reader starts: servers, DataLoader workers,
dispatchers, raylets are its descendants, and their CPU time and peak resident memory are read
from /proc for the whole tree.

The timed pass is ``epochs`` epochs of batches of ``batch_size`` rows, each a tuple of numpy
arrays or of tensors with a ``.numpy()`` (torch, TensorFlow), one per column of the data, in the
columns' order (``columns``: the flat table's features, label and row id, or what the data folder's
``columns.json`` names: the sources of a window). Every array is touched (one element read), and
the ids of every batch (the id column: a row id, a window's sample id) are kept (a copy of 8 bytes
a row) to count, after the pass, each epoch's distinct rows and how many groups each batch mixes (id
// ``--rows-per-group``: a row group of the table, a recording of the windows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

__all__ = ["parser", "Column", "columns", "id_column", "table_arrays", "ProcTree", "measure", "emit", "fail"]

SAMPLE_INTERVAL_S = 0.2
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def parser(description: str | None) -> argparse.ArgumentParser:
    """The options every reader takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", required=True, help="the benchmark's data folder (parquet/ and the peers' copies)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--rows-per-group", type=int, required=True, help="rows per Parquet row group (for the batch mix)")
    p.add_argument("--rows", type=int, required=True, help="rows in the table (each epoch must deliver them)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers, where the peer has them")
    p.add_argument("--seed", type=int, default=0, help="this round's seed, where the peer takes one")
    p.add_argument("--shuffle-rows", type=int, default=40_000,
                   help="rows of a shuffle buffer, for the peers whose shuffle is one")
    p.add_argument("--prepare", action="store_true", help="write the peer's copy of the table, then exit")
    p.add_argument("--timeout", type=float, default=120.0, help="the longest wait for any one batch, where the peer has one")
    p.add_argument("--dataset", default=None,
                   help="what fuelline serves, where it is not the data folder's parquet/ (the converted multimodal "
                        "dataset, whose windows the others read materialised)")
    return p


# -- the columns -------------------------------------------------------------------------------------
class Column(NamedTuple):
    """A column as a batch delivers it: [B, *shape] of dtype. In Parquet, an array column is a
    fixed-size list of its flattened values."""

    name: str
    dtype: str  # numpy's, e.g. "<f4"
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


TABLE_COLUMNS = (Column("features", "<f4", (64,)), Column("label", "<i8", ()), Column("row_id", "<i8", ()))


def _described(data: str | Path) -> dict[str, Any] | None:
    path = Path(data) / "columns.json"
    return json.loads(path.read_text()) if path.is_file() else None


def columns(data: str | Path) -> list[Column]:
    """The columns of the data folder: those its ``columns.json`` lists, else the flat table's."""
    described = _described(data)
    if described is None:
        return list(TABLE_COLUMNS)
    return [Column(c["name"], c["dtype"], tuple(c["shape"])) for c in described["columns"]]


def id_column(data: str | Path) -> str:
    """The column that names a row (unique in the data, id // rows per group: its group)."""
    described = _described(data)
    return "row_id" if described is None else str(described["id"])


def table_arrays(table: Any, cols: Sequence[Column]) -> dict[str, np.ndarray]:
    """A pyarrow table's columns as numpy arrays of [rows, *shape] (fixed-size lists flattened and
    reshaped, without a copy where the data allow)."""
    out = {}
    for c in cols:
        column = table.column(c.name).combine_chunks()
        if c.shape:
            out[c.name] = column.flatten().to_numpy().reshape(len(column), *c.shape)
        else:
            out[c.name] = column.to_numpy()
    return out


# -- the process tree --------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, int, float, float] | None:
    """(parent pid, start time in ticks, own CPU seconds, CPU seconds of its reaped children) of a
    process, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15, cutime 16, cstime 17, starttime 22.
    return (int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
            (int(fields[13]) + int(fields[14])) / CLOCK_TICKS)


def _cpu_clock_s(pid: int) -> float | None:
    """A live process's CPU seconds (all its threads, those ended too) from its CPU-time clock, to
    the nanosecond where /proc/PID/stat counts 10 ms ticks; None once it is gone. (The clock id of
    process PID is ``~PID << 3 | CPUCLOCK_SCHED``, as clock_getcpuclockid(3) makes it; Linux lets
    any process read it.)"""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        return None


def _hwm_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class ProcTree:
    """A process and all its descendants.

    Their CPU time at a moment is the sum, over the live processes of the tree, of each one's own
    time (from its CPU-time clock, to the nanosecond) and that of its children that ended and were
    reaped (from /proc, in 10 ms ticks; the kernel adds them to the parent that waits for them):
    a DataLoader worker that ends with its epoch, or a server stopped, still
    counts, once. (A process whose parent ended before it, and that ends unreaped by the tree, is
    lost: none of the readers leaves one.) A thread samples the tree every ``SAMPLE_INTERVAL_S``
    for memory: each process's peak is the kernel's own high-water mark of its resident set
    (VmHWM), so a short peak between samples is not missed; a process is known by (pid, start
    time). Pages shared between processes (shared memory, memory-mapped files) count once in each
    process that maps them.
    """

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self._lock = threading.Lock()
        self._hwm: dict[tuple[int, int], int] = {}
        self._names: dict[tuple[int, int], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="proctree", daemon=True)

    def __enter__(self) -> "ProcTree":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.sample()

    def members(self) -> list[tuple[int, int]]:
        """(pid, start time) of the root and every live descendant."""
        parents: dict[int, list[tuple[int, int]]] = {}
        start_of: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            st = _stat(int(entry))
            if st is None:
                continue
            parents.setdefault(st[0], []).append((int(entry), st[1]))
            start_of[int(entry)] = st[1]
        if self.root not in start_of:
            return []
        out, todo = [], [(self.root, start_of[self.root])]
        while todo:
            pid, start = todo.pop()
            out.append((pid, start))
            todo.extend(parents.get(pid, []))
        return out

    def sample(self) -> float:
        """Record the tree's memory peaks and names; returns its CPU seconds now (see the class)."""
        cpu = 0.0
        for pid, start in self.members():
            st = _stat(pid)
            own = _cpu_clock_s(pid)
            if st is None or st[1] != start or (again := _stat(pid)) is None or again[1] != start:
                continue
            cpu += (st[2] if own is None else own) + again[3]
            key = (pid, start)
            hwm = _hwm_bytes(pid)
            with self._lock:
                self._hwm[key] = max(self._hwm.get(key, 0), hwm)
                if key not in self._names:
                    self._names[key] = _comm(pid)
        return cpu

    def cpu_seconds(self) -> float:
        """The CPU seconds of the tree's processes, live or ended and reaped within it."""
        return self.sample()

    def peak_rss_bytes(self) -> int:
        with self._lock:
            return sum(self._hwm.values())

    def process_names(self) -> dict[str, int]:
        """How many processes of each name the tree had."""
        with self._lock:
            names = list(self._names.values())
        return {n: names.count(n) for n in sorted(set(names))}


# -- the timed pass ----------------------------------------------------------------------------------
def _as_numpy(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else np.asarray(a.numpy())


def measure(tree: ProcTree, epochs: Callable[[int], Iterable[Sequence[Any]]], args: argparse.Namespace,
            reader_started: float, server_started: float | None = None) -> dict[str, Any]:
    """Read ``args.epochs`` epochs (``epochs(e)`` gives epoch e's batches) and measure them.

    ``reader_started``: ``time.perf_counter()`` when the reader was made (its dataset, loader or
    stream); ``server_started``: when its server or cluster was started, for those that have one.
    Rates count the rows after the first batch over the span from its arrival to the last
    batch's; the CPU time of the whole tree is taken over that span too, and also from the
    reader's start to the end.
    """
    at = [c.name for c in columns(args.data)].index(id_column(args.data))
    cpu_reader0 = tree.cpu_seconds()
    first = last = None
    cpu_first = 0.0
    batches = rows = nbytes = 0
    ids: list[list[np.ndarray]] = []

    for e in range(args.epochs):
        ids.append([])
        for batch in epochs(e):
            now = time.perf_counter()
            arrays = [_as_numpy(a) for a in batch]
            for a in arrays:
                if a.size:
                    a.item(0)
            ids[-1].append(np.array(arrays[at], dtype=np.int64).reshape(-1))
            batches += 1
            if first is None:
                first = now
                cpu_first = tree.cpu_seconds()
                continue
            last = now
            rows += len(arrays[0])
            nbytes += sum(a.nbytes for a in arrays)
    if first is None or last is None:
        raise RuntimeError(f"a pass needs at least two batches to be timed, got {batches}")
    cpu_last = tree.cpu_seconds()
    wall = time.time() - time.perf_counter()  # (for a benchmark that measures a server on another host)
    return {
        "batches": batches, "rows": rows, "bytes": nbytes, "seconds": last - first,
        "cpu_s": cpu_last - cpu_first, "cpu_reader_s": cpu_last - cpu_reader0,
        "first_batch_s": first - reader_started,
        "first_batch_from_server_s": None if server_started is None else first - server_started,
        "reader_started_at": wall + reader_started, "first_batch_at": wall + first, "last_batch_at": wall + last,
        **_mix(ids, args),
    }


def _mix(ids: list[list[np.ndarray]], args: argparse.Namespace) -> dict[str, Any]:
    """Each epoch's rows and distinct rows, and the mean number of distinct groups (id // rows per
    group: row groups of the table, recordings of the windows) in a full batch."""
    per_batch = [len(np.unique(b // args.rows_per_group)) for epoch in ids for b in epoch if len(b) == args.batch_size]
    epoch_rows = [int(sum(len(b) for b in epoch)) for epoch in ids]
    distinct = [int(len(np.unique(np.concatenate(epoch)))) if epoch else 0 for epoch in ids]
    firsts = [[int(x) for x in epoch[0][:8]] if epoch else [] for epoch in ids]
    return {"epoch_rows": epoch_rows, "epoch_distinct_rows": distinct,
            "mix": float(np.mean(per_batch)) if per_batch else float("nan"),
            "full_batches": len(per_batch), "first_ids": firsts}


def emit(result: dict[str, Any], tree: ProcTree, **extra: Any) -> None:
    """Print the one JSON line the benchmark reads (the last line of stdout)."""
    result = {**result, "peak_rss_bytes": tree.peak_rss_bytes(), "processes": tree.process_names(), **extra}
    print(json.dumps(result), flush=True)


def fail(exc: BaseException) -> int:
    """Print a JSON line naming the failure (the benchmark records it), and the traceback to stderr."""
    traceback.print_exc()
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
    sys.stdout.flush()
    return 1
