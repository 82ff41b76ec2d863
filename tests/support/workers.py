"""A tiny unit source for the worker-pool tests: importable by worker processes (which unpickle it),
with units that misbehave on purpose."""

from __future__ import annotations

import faulthandler
import os
import resource
import signal
import time
from dataclasses import dataclass

import numpy as np

from fuelline.protocol import DataError
from fuelline.server.sources.blocks import UnitSource
from fuelline.server.sources.options import SourceOptions
from fuelline.server.workers.pool import WorkerPool


@dataclass(frozen=True)
class FakeColumn:
    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_schema(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape)}


class FakeUnits(UnitSource):
    """``units`` units of ``rows`` rows; every row of unit u holds u, and ``sample_id`` is
    u * 1000 + row. ``behaviour`` maps a unit to what decoding it does instead:

    * ``"exit"``: the process exits at once with code 3 (as a crash in native code would end it);
    * ``"segv"``: a segmentation fault;
    * ``("exit-once", marker)``: exits with code 4 unless the file ``marker`` exists, which it
      creates first (so the retry in a new worker succeeds);
    * ``"hang"``: never returns (an hour's sleep);
    * ``"data"``: raises DataError; ``"bug"``: raises ZeroDivisionError;
    * ``("until-orphaned", marker)``: creates the file ``marker``, then decodes (polling every
      5 ms) until the process that started this worker is gone, and returns the unit at once:
      a worker busy when its serving process is killed.
    """

    def __init__(self, units: int = 8, rows: int = 10, behaviour: dict | None = None, **options) -> None:
        options.setdefault("batch_size", 7)
        options.setdefault("seed", 0)
        options.setdefault("shuffle", True)
        options.setdefault("shuffle_block", 2)
        super().__init__(SourceOptions.of(**options))
        self._columns = {
            "x": FakeColumn("x", "<f4", (2,)),
            "sample_id": FakeColumn("sample_id", "<i8", ()),
        }
        self._splits = {"train": None}
        self.rows_per_unit = np.full(units, rows, dtype=np.int64)
        self.behaviour = behaviour or {}
        self.prefetched: list[tuple[int, list[int]]] = []  # (pid that was called, units)

    def info(self, split: str) -> dict:
        return {"kind": "fake-units", "units": len(self.rows_per_unit)}

    def fingerprint(self, split: str) -> dict[str, str]:
        return {"units": ",".join(map(str, self.rows_per_unit)), "batch_size": str(self.batch_size)}

    def unit_rows(self, split: str) -> np.ndarray:
        return self.rows_per_unit

    def column_specs(self, sources: tuple[str, ...]) -> list[FakeColumn]:
        return [self._columns[n] for n in sources]

    def decode_unit(self, split: str, u: int, columns) -> dict[str, np.ndarray]:
        how = self.behaviour.get(u)
        if how == "exit":
            os._exit(3)
        if how == "segv":
            faulthandler._sigsegv()
        if isinstance(how, tuple) and how[0] == "exit-once":
            try:
                open(how[1], "x").close()
            except FileExistsError:
                pass
            else:
                os._exit(4)
        if how == "hang":
            time.sleep(3600)  # a read that never returns
        if isinstance(how, tuple) and how[0] == "until-orphaned":
            parent = os.getppid()
            open(how[1], "w").close()
            _until_orphaned(parent)
        if how == "data":
            raise DataError(f"unit {u} is unreadable on purpose")
        if how == "bug":
            raise ZeroDivisionError("a bug in decode_unit")
        self.counters["units_decoded"] += 1
        rows = int(self.rows_per_unit[u])
        out = {
            "x": np.full((rows, 2), u, dtype="<f4"),
            "sample_id": u * 1000 + np.arange(rows, dtype="<i8"),
        }
        return {c.name: out[c.name] for c in columns}

    def prefetch_units(self, split: str, units) -> None:
        self.prefetched.append((os.getpid(), list(units)))


class UncopyableUnits(FakeUnits):
    """Fails to set up in a worker process, as a source whose copy cannot load its dataset would."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.home = os.getpid()

    def __setstate__(self, state: dict) -> None:
        if os.getpid() != state["home"]:
            raise RuntimeError("the dataset is not reachable from here")
        super().__setstate__(state)


def _until_orphaned(parent: int, within: float = 120.0) -> None:
    """Return once this process's parent is no longer ``parent`` (it died), or after ``within`` s."""
    deadline = time.monotonic() + within
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.005)


class StartsUntilOrphaned(FakeUnits):
    """Once ``arm``-ed in a serving process, its workers' copies take, to unpickle, until that
    process is gone: a worker still starting when its serving process is killed."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.home: int | None = None

    def arm(self) -> None:
        self.home = os.getpid()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if state["home"] is not None and os.getpid() != state["home"]:
            _until_orphaned(state["home"])


class FileSizeLimitedUnits(FakeUnits):
    """In a worker process, a file may grow to ``limit`` bytes only (RLIMIT_FSIZE, set as the
    worker unpickles its copy): a larger hand-off file fails there with EFBIG, for real, as a full
    /dev/shm fails with ENOSPC."""

    def __init__(self, limit: int, **options) -> None:
        super().__init__(**options)
        self.limit = limit
        self.home = os.getpid()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if os.getpid() != state["home"]:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (its default ends the process)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def start_pool(pools: list, source, workers: int, **options) -> WorkerPool:
    pool = WorkerPool(source, workers, **options)
    pools.append(pool)
    pool.start()
    return pool


def pool_with_a_unit_in_hand(source, handoff_dir: str, started: str | None = None) -> None:
    """A serving process (run in a process of its own): a pool of one worker, given unit 0 of the
    train split to decode; creates the file ``started`` (if given) once the pool has started its
    worker; then it waits to be killed."""
    if isinstance(source, StartsUntilOrphaned):
        source.arm()
    pool = WorkerPool(source, 1, handoff_dir=handoff_dir)
    pool.start()
    pool.submit("train", 0, source.column_specs(("x", "sample_id")))
    if started is not None:
        open(started, "w").close()
    time.sleep(3600)
