"""Worker processes that decode units for a ``UnitSource`` (``fuelline serve --workers N``).

Why processes: loading, aligning and normalising a unit is Python and numpy work that one process
runs on about one core, whatever its threads. With N workers the serving process only gathers
decoded rows into batches and sends them.

How:
  * Each worker is started with the "spawn" method (a fresh interpreter: the serving process has
    ZeroMQ and other threads, which a fork would copy in an undefined state) and gets a pickled copy
    of the source (``UnitSource.__getstate__`` leaves out pools, locks and caches). Pickle is safe
    here: it only ever crosses from this process to its own children and back, never a network.
  * A task is one unit: ``source.decode_unit(split, u, columns)``. The arrays come back through a
    shared-memory file (``fuelline.server.handoff``), the pipe carries only their layout, the
    worker's counter increments and, for a failure, the exception's message and traceback. Where
    no such file can be written (a full /dev/shm), the arrays come through the pipe (logged once).
    The worker's side is ``fuelline.server.worker_process``.
  * One dispatcher thread owns the pipes: it hands queued tasks to idle workers and waits on every
    worker's pipe and process sentinel at once, so a worker that dies (signal, segfault,
    ``os._exit``, the OOM killer) is noticed at once, never waited on silently. The dispatcher logs
    which worker died, how, and which unit it was decoding, starts a replacement and retries the
    unit once; a unit that kills a worker twice fails with a DataError naming it (so
    ``--on-bad-shard skip`` leaves it out). More than ``max_restarts`` restarts within
    ``restart_window`` seconds break the pool: every pending and later task fails with
    ``WorkerPoolBroken`` and the reason, rather than a crash loop spinning.
  * Workers exit when the serving process goes: their pipe reaches EOF, and a watcher thread
    checks the parent pid every second in case a task is running. faulthandler is on in workers, so
    a crash in native code prints a traceback to the server's stderr.
  * A worker stuck on one unit past ``task_timeout`` (``--worker-timeout``) dumps where its threads
    are and exits: a hang is reported and handled like a death, never a silent stall.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from fuelline.protocol import DataError, FuellineError
from fuelline.server import handoff
from fuelline.server.worker_process import worker_main

__all__ = ["WorkerPool", "WorkerError", "WorkerPoolBroken"]

log = logging.getLogger("fuelline.server")


class WorkerError(FuellineError):
    """A worker raised something other than DataError (a bug, most likely), or the pool closed
    while a task waited. The worker's traceback is the ``__cause__``."""


class WorkerPoolBroken(WorkerError):
    """Workers died too often, or could not start: no task can run."""


class RemoteTraceback(Exception):
    """A traceback formatted in a worker, chained to the error raised here so logs show both."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]).rstrip()


@dataclass
class _Task:
    id: int
    split: str
    unit: int
    columns: Sequence[Any]
    future: Future
    path: str | None  # where the worker writes the arrays; None: through the pipe
    deaths: int = 0  # workers that died running it
    started: bool = False  # the future is running (set once, before the first hand-out)


@dataclass
class _Worker:
    index: int
    process: Any  # multiprocessing.Process
    conn: Connection
    ready: bool = False
    task: _Task | None = None
    task_started: float = 0.0  # monotonic time the current task was handed over
    pids: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"worker {self.index} (pid {self.process.pid})"


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its pipe"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


CRASH_SIGNALS = {-s for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT)}


class WorkerPool:
    """N worker processes decoding units of one source, shared by all its clients.

    Args:
        source: the ``UnitSource`` to decode with; each worker gets a pickled copy.
        workers: how many processes.
        max_restarts: more restarts than this within ``restart_window`` seconds break the pool
            (default 3 × workers).
        task_timeout: seconds one unit may take; a worker still on it then (a deadlock, a read
            that never returns) prints every thread's traceback and exits, and is handled as a
            worker that died: replaced, the unit retried once. None: no limit.
        context: multiprocessing start method, "spawn" or "forkserver" (never "fork").
        handoff_dir: where the hand-off files go; default ``handoff.shm_dir()`` (/dev/shm, or
            ``$FUELLINE_HANDOFF_DIR``).
    """

    POLL = 1.0  # seconds: the dispatcher's longest wait (wake-ups come through a pipe)
    STOP_TIMEOUT = 5.0

    def __init__(
        self, source: Any, workers: int, *, max_restarts: int | None = None, restart_window: float = 60.0,
        context: str = "spawn", task_timeout: float | None = None, handoff_dir: str | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if context not in ("spawn", "forkserver"):
            raise ValueError(f"context must be spawn or forkserver, got {context!r}")
        if task_timeout is not None and not task_timeout > 0:
            raise ValueError(f"task_timeout must be > 0 seconds or None, got {task_timeout!r}")
        self.task_timeout = task_timeout
        self.source = source
        self.n = workers
        self.max_restarts = 3 * workers if max_restarts is None else max_restarts
        self.restart_window = restart_window
        self._ctx = multiprocessing.get_context(context)
        self._payload = pickle.dumps(source, protocol=pickle.HIGHEST_PROTOCOL)
        self._dir = handoff_dir or handoff.shm_dir()
        self._incarnation: handoff.Incarnation | None = None
        self._piped = False  # arrays came through a pipe (logged once)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._queue: deque[_Task] = deque()
        self._workers: list[_Worker] = []
        self._restarts: deque[float] = deque()
        self._broken: str | None = None
        # Units that killed two workers: they would again, so they fail at once from then on.
        self._poisoned: dict[tuple[str, int], str] = {}
        self._closed = False
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        swept = handoff.sweep_dead(self._dir)
        if swept:
            log.warning("removed %d hand-off files in %s left by server processes that were killed", swept, self._dir)
        try:
            self._incarnation = handoff.Incarnation(self._dir)
        except OSError as exc:
            self._piped = True
            log.warning(
                "cannot make a hand-off folder in %s (%s%s): decoded units come through the worker "
                "processes' pipes instead, which is slower", self._dir, exc,
                f"; set by {handoff.ENV_DIR}" if os.environ.get(handoff.ENV_DIR) == self._dir else "",
            )
        self._workers = [self._spawn(i) for i in range(self.n)]
        log.info(
            "started %d worker process%s to load and preprocess units (pids %s); hand-off through %s",
            self.n, "" if self.n == 1 else "es", ", ".join(str(w.process.pid) for w in self._workers), self._dir,
        )
        self._thread = threading.Thread(target=self._run, name="fuelline-workers", daemon=True)
        self._thread.start()
        # fuelline serve does not close its source on the way out: make sure the workers go too.
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the workers (each finishes the unit it is on, for up to STOP_TIMEOUT seconds),
        fail what is still queued, and remove every hand-off file of this pool."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.STOP_TIMEOUT)
        self._stop_workers(WorkerError("the worker pool was closed"))
        if self._incarnation is not None:
            self._incarnation.remove()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    @property
    def alive_pids(self) -> list[int]:
        """The workers running now (one that died shows up here again once replaced)."""
        return [w.process.pid for w in list(self._workers) if w.process.is_alive()]

    # -- tasks -----------------------------------------------------------------------------------
    def submit(self, split: str, u: int, columns: Sequence[Any]) -> Future:
        """Decode unit ``u`` of ``split`` in a worker; the future's result is a dict of read-only
        arrays (or the worker's DataError, or WorkerError)."""
        future: Future = Future()
        task_id = next(self._ids)
        where = self._incarnation
        task = _Task(task_id, split, int(u), list(columns), future, where.task_path(task_id) if where else None)
        with self._lock:
            if self._broken is not None:
                future.set_exception(WorkerPoolBroken(self._broken))
                return future
            poisoned = self._poisoned.get((split, int(u)))
            if poisoned is not None:
                future.set_exception(DataError(poisoned))
                return future
            if self._closed:
                future.set_exception(WorkerError("the worker pool was closed"))
                return future
            self._queue.append(task)
        self._wake()
        return future

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a full pipe wakes the dispatcher as well; a closed one has nobody to wake

    # -- the dispatcher thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closed and self._broken is None:
                self._dispatch()
                watched: dict[Any, _Worker | None] = {self._wake_r: None}
                for w in self._workers:
                    watched[w.conn] = w
                    watched[w.process.sentinel] = w
                for obj in wait(list(watched), timeout=self.POLL):
                    w = watched[obj]
                    if w is None:
                        self._drain_wake()
                    elif self._workers[w.index] is not w:
                        continue  # already replaced (its pipe and sentinel fire together)
                    elif obj is w.conn:
                        self._receive(w)
                    else:
                        self._died(w)
        except Exception as exc:  # a bug here must not leave tasks waiting forever
            log.exception("the worker pool's dispatcher failed")
            self._break(f"the dispatcher failed: {type(exc).__name__}: {exc}")

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _next_task(self) -> _Task | None:
        with self._lock:
            while self._queue:
                task = self._queue.popleft()
                if task.started:
                    return task  # a retry
                if task.future.set_running_or_notify_cancel():
                    task.started = True
                    return task
                # cancelled while queued (its reader closed): skip it
        return None

    def _dispatch(self) -> None:
        for w in self._workers:
            if not w.ready or w.task is not None:
                continue
            task = self._next_task()
            if task is None:
                return
            if log.isEnabledFor(logging.DEBUG):  # (before the hand-out: the worker may answer first)
                log.debug("%s: decoding %s", w.name, self._describe(task))
            try:
                w.conn.send((task.id, task.split, task.unit, task.columns, task.path))
            except OSError:
                with self._lock:
                    self._queue.appendleft(task)  # it never reached the worker: not its fault
                continue  # the sentinel says what happened to the worker
            w.task, w.task_started = task, time.monotonic()

    def _receive(self, w: _Worker) -> None:
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            self._died(w)
            return
        self._handle(w, message)

    def _handle(self, w: _Worker, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            w.ready = True
            return
        if kind == "setup_failed":
            self._break(f"{w.name} could not set up its copy of the source:\n{message[1]}")
            return
        task, w.task = w.task, None
        if task is None or task.id != message[1]:
            log.error("%s answered a task it was not given: %r", w.name, message[:2])
            return
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: done with %s", w.name, self._describe(task))
        counts = message[-1]
        if counts:
            self.source.counters.add_all(counts)
        self.source.counters.add("worker_tasks")
        if kind == "done":
            _, _, written, layout, _ = message
            try:
                arrays = handoff.map_arrays(task.path if written else None, layout)
            except Exception as exc:
                _fail(task.future, WorkerError(f"{self._describe(task)}: cannot map the decoded arrays: {exc}"))
            else:
                _resolve(task.future, arrays)
            return
        if kind == "inline":
            _, _, arrays, why, _ = message
            if not self._piped:
                self._piped = True
                log.warning(
                    "%s: no room for hand-off files (%s); decoded units come through the worker processes' "
                    "pipes instead, which is slower: give %s more room (docker --shm-size, a memory-backed "
                    "emptyDir) or set %s", w.name, why, self._dir, handoff.ENV_DIR,
                )
            for a in arrays.values():
                a.setflags(write=False)  # (as mapped ones are: block tables go out zero-copy)
            _resolve(task.future, arrays)
            return
        _, _, data_error, text, type_name, tb, _ = message
        if data_error:
            _fail(task.future, DataError(text))
            return
        error = WorkerError(f"{self._describe(task)}: {type_name}: {text} (in {w.name})")
        error.__cause__ = RemoteTraceback(tb)
        _fail(task.future, error)

    def _describe(self, task: _Task) -> str:
        try:
            return self.source.describe_unit(task.split, task.unit)
        except Exception:
            return f"unit {task.unit} of split {task.split}"

    def _died(self, w: _Worker) -> None:
        w.process.join(self.STOP_TIMEOUT)  # it is gone or going: its pipe or sentinel fired
        if w.process.exitcode is None:
            w.process.kill()
            w.process.join(self.STOP_TIMEOUT)
        how = describe_exit(w.process.exitcode)
        stuck = (w.task is not None and self.task_timeout is not None and w.process.exitcode == 1
                 and time.monotonic() - w.task_started >= self.task_timeout)
        if stuck:
            how = f"was stuck for more than {self.task_timeout:g}s and stopped by its watchdog"
        try:  # what it sent before it died still counts (a result, or why it could not start)
            while self._broken is None and w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        w.conn.close()
        if self._broken is not None:
            return  # (its setup failed: the pool broke, and says why)
        task, w.task = w.task, None
        doing = f"while decoding {self._describe(task)}" if task else ("while idle" if w.ready else "while starting")
        if task is not None:
            handoff.unlink(task.path)
        if self._closed:
            if task is not None:
                _fail(task.future, WorkerError(f"{self._describe(task)}: the worker pool was closed"))
            return  # no replacement for a pool that is closing
        now = time.monotonic()
        self._restarts.append(now)
        while self._restarts and self._restarts[0] < now - self.restart_window:
            self._restarts.popleft()
        hint = ""
        if w.process.exitcode in CRASH_SIGNALS:
            hint = "; its traceback (faulthandler) is above in this log"
        elif stuck:
            hint = "; where its threads were (faulthandler) is above in this log"
        if len(self._restarts) > self.max_restarts:
            if task is not None:
                with self._lock:
                    self._queue.appendleft(task)  # failed with the rest, with the reason
            self._break(
                f"{len(self._restarts)} worker restarts within {self.restart_window:.0f}s; the last: "
                f"{w.name} {how} {doing}{hint}"
            )
            return
        log.error("%s %s %s%s; starting a replacement", w.name, how, doing, hint)
        self._workers[w.index] = self._spawn(w.index)
        self.source.counters.add("workers_restarted")
        log.info("worker %d restarted as pid %d", w.index, self._workers[w.index].process.pid)
        if task is None:
            return
        task.deaths += 1
        if task.deaths >= 2:
            message = (
                f"{self._describe(task)}: a worker process died while decoding it, twice "
                f"(the last: {w.name} {how}); it is not tried again"
            )
            with self._lock:
                self._poisoned[(task.split, task.unit)] = message
            _fail(task.future, DataError(message))
        else:
            log.warning("retrying %s once, in another worker process", self._describe(task))
            with self._lock:
                self._queue.appendleft(task)

    def _spawn(self, index: int) -> _Worker:
        parent_end, child_end = self._ctx.Pipe(duplex=True)
        level = logging.getLogger().getEffectiveLevel()
        process = self._ctx.Process(
            target=worker_main,
            args=(index, self._payload, child_end, os.getpid(), level, self.task_timeout,
                  self._incarnation.path if self._incarnation is not None else None),
            name=f"fuelline-worker-{index}", daemon=True,
        )
        process.start()
        child_end.close()  # so the worker's death is EOF here
        self.source.counters.add("workers_started")
        return _Worker(index, process, parent_end)

    def _break(self, reason: str) -> None:
        with self._lock:
            if self._broken is not None:
                return
            self._broken = reason
        log.error("worker pool broken, every unit still to decode fails: %s", reason)
        self._stop_workers(WorkerPoolBroken(reason))

    def _stop_workers(self, error: WorkerError) -> None:
        """Ask every worker to exit, then terminate the ones that do not; fail every task."""
        workers = list(self._workers)
        for w in workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + self.STOP_TIMEOUT
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(1.0)
            w.conn.close()
            if w.task is not None:
                _fail(w.task.future, error)
                w.task = None
        with self._lock:
            queued, self._queue = list(self._queue), deque()
        for task in queued:
            _fail(task.future, error)
        if self._incarnation is not None:
            self._incarnation.clear()


def _resolve(future: Future, value: Any) -> None:
    try:
        future.set_result(value)
    except InvalidStateError:
        pass


def _fail(future: Future, error: BaseException) -> None:
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass  # cancelled, or already decided
