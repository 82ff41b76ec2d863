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
    shared-memory file (``fuelline.server.workers.handoff``), the pipe carries only their layout, the
    worker's counter increments and, for a failure, the exception's message and traceback. Where
    no such file can be written (a full /dev/shm), the arrays come through the pipe (logged once).
    The worker's side is ``fuelline.server.workers.child``.
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

This module hands tasks out and reads the answers; starting, replacing and stopping the
processes is ``fuelline.server.workers.supervision``.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import os
import pickle
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import wait
from typing import Any, Sequence

from fuelline.protocol import DataError
from fuelline.protocol.common.threadnames import name_this_thread
from fuelline.protocol.common.wakepipe import WakePipe
from fuelline.server.workers import handoff
from fuelline.server.workers.messages import Done, FromWorker, Inline, Ready, SetupFailed, Task
from fuelline.server.workers.supervision import (
    WorkerError,
    WorkerPoolBroken,
    WorkerSupervision,
    _fail,
    _Task,
    _Worker,
)

__all__ = ["WorkerPool", "WorkerError", "WorkerPoolBroken"]

log = logging.getLogger("fuelline.server")


class RemoteTraceback(Exception):
    """A traceback formatted in a worker, chained to the error raised here so logs show both."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]).rstrip()


class WorkerPool(WorkerSupervision):
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
    STOP_TIMEOUT = 5.0  # seconds a worker gets to exit, or to be reaped once it died

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
        self._wake_pipe = WakePipe()  # rings the dispatcher: a task queued, or closing

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
        self._wake_pipe.close()

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
        self._wake_pipe.ring()

    # -- the dispatcher thread ------------------------------------------------------------------
    def _run(self) -> None:
        name_this_thread("fl-workers")
        try:
            while not self._closed and self._broken is None:
                self._dispatch()
                watched: dict[Any, _Worker | None] = {self._wake_pipe.fd: None}
                for worker in self._workers:
                    watched[worker.conn] = worker
                    watched[worker.process.sentinel] = worker
                for obj in wait(list(watched), timeout=self.POLL):
                    w = watched[obj]
                    if w is None:
                        self._wake_pipe.drain()  # (the loop dispatches next: a ring during it is seen)
                    elif self._workers[w.index] is not w:
                        continue  # already replaced (its pipe and sentinel fire together)
                    elif obj is w.conn:
                        self._receive(w)
                    else:
                        self._died(w)
        except Exception as exc:  # a bug here must not leave tasks waiting forever
            log.exception("the worker pool's dispatcher failed")
            self._break(f"the dispatcher failed: {type(exc).__name__}: {exc}")

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
                w.conn.send(Task(task.id, task.split, task.unit, task.columns, task.path))
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

    def _handle(self, w: _Worker, message: FromWorker) -> None:
        if isinstance(message, Ready):
            w.ready = True
            return
        if isinstance(message, SetupFailed):
            self._break(f"{w.name} could not set up its copy of the source:\n{message.traceback}")
            return
        task, w.task = w.task, None
        if task is None or task.id != message.task_id:
            log.error("%s answered a task it was not given: %r", w.name, message.task_id)
            return
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: done with %s", w.name, self._describe(task))
        if message.counts:
            self.source.counters.add_all(message.counts)
        self.source.counters.add("worker_tasks")
        if isinstance(message, Done):
            try:
                arrays = handoff.map_arrays(task.path if message.written else None, message.layout)
            except Exception as exc:
                _fail(task.future, WorkerError(f"{self._describe(task)}: cannot map the decoded arrays: {exc}"))
            else:
                _resolve(task.future, arrays)
        elif isinstance(message, Inline):
            self._inline(w, task, message)
        elif message.data_error:
            _fail(task.future, DataError(message.message))
        else:
            error = WorkerError(f"{self._describe(task)}: {message.type_name}: {message.message} (in {w.name})")
            error.__cause__ = RemoteTraceback(message.traceback)
            _fail(task.future, error)

    def _inline(self, w: _Worker, task: _Task, message: Inline) -> None:
        if not self._piped:
            self._piped = True
            log.warning(
                "%s: no room for hand-off files (%s); decoded units come through the worker processes' "
                "pipes instead, which is slower: give %s more room (docker --shm-size, a memory-backed "
                "emptyDir) or set %s", w.name, message.why, self._dir, handoff.ENV_DIR,
            )
        for a in message.arrays.values():
            a.setflags(write=False)  # (as mapped ones are: batches cut from them go out zero-copy)
        _resolve(task.future, message.arrays)

    def _describe(self, task: _Task) -> str:
        try:
            return self.source.describe_unit(task.split, task.unit)
        except Exception:
            return f"unit {task.unit} of split {task.split}"


def _resolve(future: Future, value: Any) -> None:
    try:
        future.set_result(value)
    except InvalidStateError:
        pass

